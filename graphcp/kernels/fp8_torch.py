"""FP8 projections at call time, and the one dispatch every FP8 weight goes through.

Weights stay FP8 in memory on every device. On CUDA the block-scaled Triton GEMM runs them once its
start-up check accepted it (``probe_gemm``), per-channel weights the row-wise scaled GEMM
(``fp8_rowwise.py``); everywhere else a projection dequantizes its weight
for the one call (``dequantize_weight``: fp8 x its block scale, in fp32, then the activation
dtype), so a CPU forward is the same arithmetic as HF on the exactly dequantized checkpoint.
``fp8_linear_torch`` is the Triton GEMM's own arithmetic in torch (activations quantized per token
group too): the GEMM's oracle, not a serving path.
"""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

from graphcp.kernels.fp8_rowwise import is_rowwise, rowwise_linear_torch, rowwise_unusable
from graphcp.kernels.fp8_types import FP8, FP8_MAX, Fp8Experts, Fp8Weight
from graphcp.kernels.registry import KernelChoices, chosen


def dequantize_weight(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype``: each element times its block's scale, in fp32. Tensor ops
    only (no new constants), so a captured graph may hold it."""
    k = w.weight.shape[1]
    scale = w.scale.index_select(0, w.scale_rows)
    if scale.shape[1] == 1:     # one K block spans the row (per-channel scales): broadcast
        return (w.weight.float() * scale).to(dtype)
    scale = scale.repeat_interleave(w.block[1], dim=1)
    return (w.weight.float() * scale[:, w.k_offset:w.k_offset + k]).to(dtype)


def dequantize_expert(w: Fp8Experts, expert: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_weight(w.expert(expert), dtype)


def dense_weight(weight: torch.Tensor | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A projection's weight as a plain tensor (FP8: dequantized for this call only)."""
    return dequantize_weight(weight, dtype) if isinstance(weight, Fp8Weight) else weight


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for an ``Fp8Weight`` the Triton GEMM (block scales) or the row-wise scaled
    GEMM (per-channel scales) where it was accepted at start (CUDA), else the weight dequantized
    for this call."""
    if not isinstance(weight, Fp8Weight):
        return nn.functional.linear(x, weight, bias)
    op = "fp8_rowwise" if is_rowwise(weight) else "fp8_gemm"
    fn = chosen(op) if x.is_cuda else None
    if fn is not None:
        return fn(x, weight, bias)
    return nn.functional.linear(x, dequantize_weight(weight, x.dtype), bias)


def gemm_available(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether the Triton GEMM can run here: FP8 tensor cores (compute capability 8.9+) and a
    power-of-two K block of 16 to 256 (one K tile per block: per-channel scales, one K block per
    row, take the dequantizing form)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    k = block[1]
    return torch.cuda.get_device_capability(device) >= (8, 9) and 16 <= k <= 256 \
        and k & (k - 1) == 0


def probe_gemm(choices: KernelChoices, weight: Fp8Weight | None, dtype: torch.dtype) -> None:
    """At engine start, eagerly: the Triton GEMM once on one of the model's FP8 weights against its
    torch form; one that fails or disagrees is replaced by the dequantizing form with a warning.
    Where the GEMM cannot run at all, the dequantizing form serves without a check."""
    if weight is None or not weight.weight.is_cuda:
        return
    x = torch.randn(5, weight.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(
        weight.weight.device, dtype)
    if is_rowwise(weight):
        why = rowwise_unusable(weight.weight.device, dtype, weight)
        if why is None:
            choices.probe("fp8_rowwise", lambda fn: fn(x, weight),
                          lambda: rowwise_linear_torch(x, weight), dtype)
        return
    if not gemm_available(weight.weight.device, weight.block):
        return
    choices.probe("fp8_gemm", lambda fn: fn(x, weight), lambda: fp8_linear_torch(x, weight), dtype)


def quantize_activations(
    x: torch.Tensor, block_k: int, k_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token groups of ``block_k`` columns on the weight's K-block grid (column 0 at
    ``k_offset``): FP8 values [M, K blocks * block_k] (zeros outside x) and float32 scales [M, K
    blocks], amax / 448."""
    m, k = x.shape
    blocks = -(-(k + k_offset) // block_k)
    padded = torch.zeros(m, blocks * block_k, dtype=torch.float32, device=x.device)
    padded[:, k_offset : k_offset + k] = x.float()
    groups = padded.view(m, blocks, block_k)
    scale = groups.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    return (groups / scale[..., None]).to(FP8).view(m, -1), scale


def rounded_activations(x: torch.Tensor, block_k: int, k_offset: int = 0) -> torch.Tensor:
    """x [M, K] as the FP8 GEMMs multiply it: quantized (``quantize_activations``), then back to
    float32, same shape."""
    m, k = x.shape
    xq, xs = quantize_activations(x, block_k, k_offset)
    return (xq.float().view(m, -1, block_k) * xs[..., None]).flatten(1)[:, k_offset:k_offset + k]


def fp8_linear_torch(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The Triton GEMM's arithmetic in torch, the same quantization and products in float32: its
    reference at start and in the tests."""
    k = w.weight.shape[1]
    x2 = x.reshape(-1, k)
    y = rounded_activations(x2, w.block[1], w.k_offset) @ dequantize_weight(w, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)

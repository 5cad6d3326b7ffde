"""Per-channel FP8 projections on CUDA (compressed-tensors' ``strategy: channel`` weights with
``strategy: token`` dynamic activations, as GLM-4.5-FP8 ships): activations quantized per token,
then one ``torch._scaled_mm`` with row-wise scales on both sides (cuBLASLt's FP8 GEMM; capturable,
no Triton). ``rowwise_linear_torch`` is the same arithmetic in float32: the start-up check's
reference. CPU serving keeps the dequantizing form (HF's arithmetic)."""
from __future__ import annotations

import torch

from graphcp.kernels.fp8_types import FP8, FP8_MAX, WHOLE_ROW, Fp8Weight


def is_rowwise(w: Fp8Weight) -> bool:
    """One scale per output row over the whole row (per-channel)."""
    return w.block[1] == WHOLE_ROW


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scales [M, 1]): each token by its amax / 448."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def _weight_scales(w: Fp8Weight) -> torch.Tensor:
    """[1, N] float32: each output row's scale (a fused or sharded weight maps rows freely)."""
    return w.scale.index_select(0, w.scale_rows).view(1, -1)


def rowwise_linear(x: torch.Tensor, w: Fp8Weight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ the per-channel FP8 weight [N, K] -> [..., N] in x's dtype (bf16 on CUDA:
    row-wise scaled GEMMs write bf16)."""
    n, k = w.weight.shape
    xq, xs = quantize_rows(x.reshape(-1, k))
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=_weight_scales(w),
                         out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def rowwise_linear_torch(x: torch.Tensor, w: Fp8Weight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rowwise_linear``'s arithmetic in float32: the same quantized activations and weights."""
    n, k = w.weight.shape
    xq, xs = quantize_rows(x.reshape(-1, k))
    y = (xq.float() * xs) @ (w.weight.float() * _weight_scales(w).t()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], n)


def rowwise_unusable(device: torch.device, dtype: torch.dtype, w: Fp8Weight) -> str | None:
    """Why the scaled GEMM cannot serve here (None: it can): FP8 tensor cores (compute capability
    8.9+), bf16 activations (its row-wise form writes bf16), and K and N multiples of 16."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "needs FP8 tensor cores (compute capability 8.9+)"
    if dtype != torch.bfloat16:
        return f"row-wise scaled GEMMs write bf16, the model runs {dtype}"
    n, k = w.weight.shape
    if n % 16 or k % 16:
        return f"needs N and K multiples of 16, the weight is [{n}, {k}]"
    return None


__all__ = ["is_rowwise", "quantize_rows", "rowwise_linear", "rowwise_linear_torch",
           "rowwise_unusable"]

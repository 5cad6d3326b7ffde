"""FP8 block-quantized checkpoints (the DeepSeek/Qwen format): float8_e4m3fn projection weights,
each with a float32 ``<name>_scale_inv`` holding one scale per ``weight_block_size`` block (edge
blocks partial); the real weight is ``fp8.float() * scale`` of its block.

One path serves every Linear weight, dense projections and MoE experts: ``quantized_names`` and
``quantized_expert_names`` say which checkpoint tensors are FP8, ``read_dequantized`` turns any
TP/EP slice of one into float32 (CPU, GPUs without FP8 tensor cores, MoE experts everywhere), and
``hold_fp8`` + ``attach`` keep a dense module's slice in FP8 with the scale rows that cover it, for
the block-scaled Triton GEMM (CUDA). A slice need not start on a block.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from graphcp.errors import ConfigError
from graphcp.models.config import ModelConfig
from graphcp.kernels.fp8_types import FP8, FP8_MAX, Fp8Weight  # noqa: F401 - re-exported
from graphcp.kernels.registry import chosen, probe_op

_SCALE_DTYPES = ("F32", "BF16", "F16")


def scale_name(weight_name: str) -> str:
    return weight_name + "_scale_inv"


def _skipped(module: str, skip: tuple[str, ...]) -> bool:
    """Entries match whole name components: 'mlp.gate' is not 'mlp.gate_proj'."""
    return any(module == s or module.endswith("." + s) or module.startswith(s + ".") for s in skip)


def quantized_names(model: nn.Module, cfg: ModelConfig) -> list[str]:
    """Checkpoint names of the FP8 weights: every Linear of the model (a meta-device build is
    enough) but the LM head and the modules the config leaves unconverted, as transformers' FP8
    integration converts. A module that loads experts or other linears under its own names adds them
    here."""
    if cfg.fp8_block is None:
        return []
    return [
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name != "lm_head" and not _skipped(name, cfg.fp8_skip)
    ]


def quantized_expert_names(prefix: str, tensors: dict[str, tuple], cfg: ModelConfig) -> list[str]:
    """Which of an experts module's checkpoint tensors (``Experts.checkpoint_tensors``) are FP8:
    every per-expert projection weight, unless the experts module (transformers converts it as one
    unit) or that projection is in ``modules_to_not_convert``. The router is no Linear there nor
    here, so it stays unquantized. Fused 3-D expert tensors are not read as FP8."""
    if cfg.fp8_block is None or _skipped(prefix, cfg.fp8_skip):
        return []
    return [
        name
        for name, shape in tensors.items()
        if len(shape) == 2 and not _skipped(name.removesuffix(".weight"), cfg.fp8_skip)
    ]


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def check_dtype(name: str, dtype: str, quantized: set[str], scales: set[str]) -> None:
    """Checkpoint dtypes: FP8 exactly where the config says so, a floating-point scale for each."""
    if name in quantized and dtype != "F8_E4M3":
        raise ConfigError(
            f"--model-path: tensor {name} is {dtype}, but quantization_config fp8 needs "
            "float8_e4m3fn (F8_E4M3) projection weights"
        )
    if name in scales and dtype not in _SCALE_DTYPES:
        raise ConfigError(
            f"--model-path: tensor {name} is {dtype}; fp8 block scales must be float32"
        )
    if name not in quantized and dtype.startswith("F8"):
        raise ConfigError(
            f"--model-path: tensor {name} is {dtype} but has no block scale here "
            "(only projection weights of an fp8 quantization_config may be float8)"
        )


def scale_shard(
    shard: tuple[int, int, int] | None, block: tuple[int, int]
) -> tuple[int, int, int] | None:
    """The block rows (dim 0) or block columns (dim 1) of the scale grid that cover a weight shard.
    """
    if shard is None:
        return None
    dim, start, end = shard
    return dim, start // block[dim], -(-end // block[dim])


def _origin(shard: tuple[int, int, int] | None) -> tuple[int, int]:
    """(first row, first column) of a shard in the whole weight."""
    if shard is None:
        return 0, 0
    return (shard[1], 0) if shard[0] == 0 else (0, shard[1])


def _block_index(first: int, count: int, block: int) -> torch.Tensor:
    """For elements first..first+count-1 of a dimension: their block, counted from the block of
    ``first``."""
    return torch.arange(first, first + count) // block - first // block


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    shard: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """float32 weight of an FP8 slice; ``scale`` holds the scale rows/columns covering it
    (``scale_shard``)."""
    row0, col0 = _origin(shard)
    rows = _block_index(row0, weight.shape[0], block[0])
    cols = _block_index(col0, weight.shape[1], block[1])
    scale = (
        scale.float().index_select(0, rows.to(scale.device)).index_select(1, cols.to(scale.device))
    )
    return weight.float() * scale


def read_dequantized(
    read,
    name: str,
    shard: tuple[int, int, int] | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """A slice of an FP8 checkpoint weight, dequantized exactly: ``read(tensor_name, shard)``
    returns that slice of a checkpoint tensor (the loader's reader)."""
    return dequantize(
        read(name, shard), read(scale_name(name), scale_shard(shard, block)), block, shard
    )


def gemm_available(device: torch.device, block: tuple[int, int]) -> bool:
    """Keep weights in FP8 where the Triton GEMM can run them: FP8 tensor cores (compute capability
    8.9+) and a power-of-two K block of at least 16 (one K tile per block). Elsewhere dequantize at
    load."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    k = block[1]
    return torch.cuda.get_device_capability(device) >= (8, 9) and k >= 16 and k & (k - 1) == 0


def hold_fp8(model: nn.Module, quantized: set[str], block: tuple[int, int]) -> dict[str, tuple]:
    """Before loading: each quantized module holds an FP8 weight and, as a buffer, the scale
    rows/columns covering its shard, so the state dict (and ``stats()["weight_bytes_per_rank"]``)
    counts what is stored. Returns the scale buffers' shards for the loader."""
    shards = {}
    for name, module in model.named_modules():
        if f"{name}.weight" not in quantized:
            continue
        shape, device = module.weight.shape, module.weight.device
        module.weight = nn.Parameter(
            torch.empty(shape, dtype=FP8, device=device), requires_grad=False
        )
        shard = getattr(module, "shard", None)
        row0, col0 = _origin(shard)
        grid = (
            -(-(row0 + shape[0]) // block[0]) - row0 // block[0],
            -(-(col0 + shape[1]) // block[1]) - col0 // block[1],
        )
        module.register_buffer(
            "weight_scale_inv", torch.empty(grid, dtype=torch.float32, device=device)
        )
        shards[scale_name(f"{name}.weight")] = scale_shard(shard, block)
    return shards


def attach(model: nn.Module, block: tuple[int, int]) -> None:
    """After loading: every module holding FP8 gets its ``fp8`` view for the GEMM."""
    for module in model.modules():
        if getattr(module, "weight_scale_inv", None) is None:
            continue
        row0, col0 = _origin(getattr(module, "shard", None))
        rows = _block_index(row0, module.weight.shape[0], block[0]).to(torch.int32)
        module.fp8 = Fp8Weight(
            module.weight.data,
            module.weight_scale_inv,
            rows.to(module.weight.device),
            col0 % block[1],
            block,
        )


def is_fp8(module: nn.Module) -> bool:
    return getattr(module, "fp8", None) is not None


def fuse(linears: tuple[nn.Module, ...]) -> tuple:
    """Concatenate FP8 projections that share their input (q/k/v, gate/up) into one GEMM: weights
    and scale rows stack, each part's rows point into its own scales; parts keep views of the fused
    tensors."""
    parts = [m.fp8 for m in linears]
    if len({p.k_offset for p in parts}) != 1:
        raise ValueError("fused fp8 projections must split their input the same way")
    weight = torch.cat([p.weight for p in parts])
    scale = torch.cat([p.scale for p in parts])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    rows, sizes, row, block_row = [], [], 0, 0
    for m, p in zip(linears, parts):
        n, nb = p.weight.shape[0], p.scale.shape[0]
        m.weight.data, m.weight_scale_inv.data = (
            weight[row : row + n],
            scale[block_row : block_row + nb],
        )
        m.fp8 = Fp8Weight(m.weight.data, m.weight_scale_inv, p.scale_rows, p.k_offset, p.block)
        if bias is not None:
            m.bias.data = bias[row : row + n]
        rows.append(p.scale_rows + block_row)
        sizes.append(n)
        row, block_row = row + n, block_row + nb
    return Fp8Weight(weight, scale, torch.cat(rows), parts[0].k_offset, parts[0].block), bias, sizes


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear``, or the block-scaled FP8 GEMM for an ``Fp8Weight`` (Triton on CUDA once
    ``probe_gemm`` accepted it at start; the torch form serves where Triton cannot)."""
    if not isinstance(weight, Fp8Weight):
        return nn.functional.linear(x, weight, bias)
    fn = chosen("fp8_gemm") if x.is_cuda else None
    if fn is None:
        return fp8_linear_torch(x, weight, bias)
    return fn(x, weight, bias)


def probe_gemm(model: nn.Module, dtype: torch.dtype) -> None:
    """At engine start, eagerly: run the Triton GEMM once on one of the model's FP8 weights against its
    torch form; one that fails or disagrees is replaced by the torch form with a warning."""
    weight = next((m.fp8 for m in model.modules() if getattr(m, "fp8", None) is not None), None)
    if weight is None or not weight.weight.is_cuda:
        return
    x = torch.randn(5, weight.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(
        weight.weight.device, dtype)
    probe_op("fp8_gemm", lambda fn: fn(x, weight), lambda: fp8_linear_torch(x, weight), dtype)


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


def fp8_linear_torch(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch form of the Triton GEMM, the same quantization and products in float32: its
    reference, and the path where the kernel cannot run."""
    k, (_, block_k) = w.weight.shape[1], w.block
    x2 = x.reshape(-1, k)
    xq, xs = quantize_activations(x2, block_k, w.k_offset)
    xf = (xq.float().view(x2.shape[0], -1, block_k) * xs[..., None]).flatten(1)[
        :, w.k_offset : w.k_offset + k
    ]
    cols = (torch.arange(k, device=x.device) + w.k_offset) // block_k
    scale = w.scale.index_select(0, w.scale_rows.long()).index_select(1, cols)
    y = xf @ (w.weight.float() * scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)

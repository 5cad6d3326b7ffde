"""FP8 block-quantized checkpoints (the DeepSeek/Qwen format) as files: float8_e4m3fn projection
weights, each with a float32 ``<name>_scale_inv`` holding one scale per ``weight_block_size`` block
(edge blocks partial); the real weight is ``fp8.float() * scale`` of its block.

Which checkpoint tensors are FP8 (``quantized_names``, ``quantized_expert_names``: exactly what
transformers' FP8 integration converts), their dtypes checked before any allocation, and the exact
dequantization of a slice (``read_dequantized``) for the one weight a form needs plain. Holding FP8
in the model is ``models/common/quantized.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import Pieces
from graphcp.errors import ConfigError
from graphcp.models.common.quantized import block_index, origin, row_blocks, scale_name, scale_shard
from graphcp.models.config import ModelConfig

_SCALE_DTYPES = ("F32", "BF16", "F16")


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


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    shard: tuple[int, int, int] | Pieces | None = None,
) -> torch.Tensor:
    """float32 weight of an FP8 slice; ``scale`` holds the scale rows/columns covering it
    (``scale_shard``)."""
    col0 = origin(shard)[1]
    rows = row_blocks(shard, weight.shape[0], block[0])
    cols = block_index(col0, weight.shape[1], block[1])
    scale = (
        scale.float().index_select(0, rows.to(scale.device)).index_select(1, cols.to(scale.device))
    )
    return weight.float() * scale


def read_dequantized(
    read,
    name: str,
    shard: tuple[int, int, int] | Pieces | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """A slice of an FP8 checkpoint weight, dequantized exactly: ``read(tensor_name, shard)``
    returns that slice of a checkpoint tensor (the loader's reader)."""
    return dequantize(
        read(name, shard), read(scale_name(name), scale_shard(shard, block)), block, shard
    )



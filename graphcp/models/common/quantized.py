"""FP8 weights held in the model: FP8 stays FP8 on every device. ``hold_fp8`` (on the meta model,
before allocation) gives each quantized Linear an FP8 weight and, as a buffer, the scale
rows/columns covering its TP slice (a slice need not start on a block; experts modules hold theirs
the same way); ``attach`` (after loading) gives it the ``Fp8Weight`` view the GEMMs read
(``kernels/fp8_torch.py``, ``kernels/triton_fp8_gemm.py``); ``fuse`` stacks projections that share
an input. A module whose form needs the plain weight (``dequantized_at_load``: MLA's ``kv_b_proj``)
is not held: the loader dequantizes it (``checkpoint/fp8.py`` knows the file format).
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import Pieces
from graphcp.kernels import fp8_torch
from graphcp.kernels.fp8_types import FP8, Fp8Weight
from graphcp.kernels.registry import KernelChoices


def scale_name(weight_name: str) -> str:
    return weight_name + "_scale_inv"


def scale_shard(
    shard: tuple[int, int, int] | Pieces | None, block: tuple[int, int]
) -> tuple[int, int, int] | Pieces | None:
    """The block rows (dim 0) or block columns (dim 1) of the scale grid that cover a weight shard;
    for row ``Pieces``, those of each range (a block two ranges share is read for each)."""
    if shard is None:
        return None
    if isinstance(shard, Pieces):
        return Pieces(0, tuple((start // block[0], -(-end // block[0]))
                               for start, end in shard.ranges))
    dim, start, end = shard
    return dim, start // block[dim], -(-end // block[dim])


def origin(shard: tuple[int, int, int] | Pieces | None) -> tuple[int, int]:
    """(first row, first column) of a shard in the whole weight."""
    if shard is None:
        return 0, 0
    if isinstance(shard, Pieces):
        return shard.ranges[0][0], 0
    return (shard[1], 0) if shard[0] == 0 else (0, shard[1])


def row_blocks(shard: tuple[int, int, int] | Pieces | None, count: int,
                     block: int) -> torch.Tensor:
    """For each of the ``count`` rows of a weight slice: its row among the scale rows
    ``scale_shard`` reads."""
    if not isinstance(shard, Pieces):
        return block_index(origin(shard)[0], count, block)
    parts, base = [], 0
    for start, end in shard.ranges:
        parts.append(block_index(start, end - start, block) + base)
        base += -(-end // block) - start // block
    return torch.cat(parts)


def block_index(first: int, count: int, block: int) -> torch.Tensor:
    """For elements first..first+count-1 of a dimension: their block, counted from the block of
    ``first``."""
    return torch.arange(first, first + count) // block - first // block


def _held(module: nn.Module, name: str, quantized: set[str]) -> bool:
    return (isinstance(module, nn.Linear) and f"{name}.weight" in quantized
            and not getattr(module, "dequantized_at_load", False))


def hold_fp8(model: nn.Module, quantized: set[str], block: tuple[int, int]) -> dict[str, tuple]:
    """On the meta model, before allocation: each quantized Linear holds an FP8 weight and, as a
    buffer, the scale rows/columns covering its shard; experts modules do the same for their
    projections (``Experts.hold_fp8``). The state dict then counts what is stored. Returns the
    Linear scale buffers' shards for the loader."""
    shards = {}
    for name, module in model.named_modules():
        if hasattr(module, "hold_fp8"):
            module.hold_fp8(name, quantized, block)
        if not _held(module, name, quantized):
            continue
        shape, device = module.weight.shape, module.weight.device
        module.weight = nn.Parameter(
            torch.empty(shape, dtype=FP8, device=device), requires_grad=False
        )
        shard = getattr(module, "shard", None)
        module.register_buffer(
            "weight_scale_inv",
            torch.empty(block_grid(shard, shape, block), dtype=torch.float32, device=device),
        )
        shards[scale_name(f"{name}.weight")] = scale_shard(shard, block)
    return shards


def block_grid(shard: tuple[int, int, int] | Pieces | None, shape: tuple[int, ...],
               block: tuple[int, int]) -> tuple[int, int]:
    """The scale blocks (rows, columns) covering a weight slice of ``shape`` at ``shard``."""
    if isinstance(shard, Pieces):
        return scale_shard(shard, block).rows, -(-shape[1] // block[1])
    row0, col0 = origin(shard)
    return (-(-(row0 + shape[0]) // block[0]) - row0 // block[0],
            -(-(col0 + shape[1]) // block[1]) - col0 // block[1])


def block_rows(first: int, count: int, block: int) -> torch.Tensor:
    """int32 [count]: the scale row of each of rows first..first+count-1 of a slice."""
    return block_index(first, count, block).to(torch.int32)


def attach(model: nn.Module, block: tuple[int, int]) -> None:
    """After loading: every module holding FP8 gets its view for the GEMMs."""
    for module in model.modules():
        if hasattr(module, "attach_fp8"):
            module.attach_fp8()
        if getattr(module, "weight_scale_inv", None) is None:
            continue
        shard = getattr(module, "shard", None)
        rows = row_blocks(shard, module.weight.shape[0], block[0]).to(torch.int32)
        col0 = origin(shard)[1]
        module.fp8 = Fp8Weight(
            module.weight.data,
            module.weight_scale_inv,
            rows.to(module.weight.device),
            col0 % block[1],
            block,
        )


def is_fp8(module: nn.Module) -> bool:
    return getattr(module, "fp8", None) is not None


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` without a copy where the loader allocated the parts back to back (a
    fusion group: ``plan_fusion``); a copy otherwise."""
    first, end = parts[0], parts[0].data_ptr()
    for part in parts:
        if not part.is_contiguous() or part.data_ptr() != end or part.dtype != first.dtype:
            return torch.cat(parts)
        end += part.numel() * part.element_size()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def fuse(linears: tuple[nn.Module, ...]) -> tuple:
    """Projections that share their input (q/k/v, gate/up) as one GEMM: (weight, bias, sizes).
    FP8 weights and scale rows stack, each part's rows pointing into its own scales. The parts
    keep views of the fused tensors; loaded back to back, nothing is copied."""
    bias = joined([m.bias.data for m in linears]) if linears[0].bias is not None else None
    sizes = [m.weight.shape[0] for m in linears]
    if not is_fp8(linears[0]):
        weight = joined([m.weight.data for m in linears])
        _rebind(linears, weight, bias)
        return weight, bias, sizes
    parts = [m.fp8 for m in linears]
    if len({p.k_offset for p in parts}) != 1:
        raise ValueError("fused fp8 projections must split their input the same way")
    weight = joined([p.weight for p in parts])
    scale = joined([p.scale for p in parts])
    rows, block_row = [], 0
    for m, p in zip(linears, parts):
        rows.append(p.scale_rows + block_row)
        nb = p.scale.shape[0]
        m.weight_scale_inv.data = scale[block_row:block_row + nb]
        block_row += nb
    _rebind(linears, weight, bias)
    for m, p in zip(linears, parts):
        m.fp8 = Fp8Weight(m.weight.data, m.weight_scale_inv, p.scale_rows, p.k_offset, p.block)
    return Fp8Weight(weight, scale, torch.cat(rows), parts[0].k_offset, parts[0].block), bias, sizes


def _rebind(linears: tuple[nn.Module, ...], weight: torch.Tensor,
            bias: torch.Tensor | None) -> None:
    """Each part's parameters become views of the fused tensors (the same memory when joined)."""
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row:row + n]
        if bias is not None:
            m.bias.data = bias[row:row + n]
        row += n


def first_weight(model: nn.Module) -> Fp8Weight | None:
    """One of the model's FP8 weights (the GEMM's start-up check runs on it)."""
    return next((m.fp8 for m in model.modules() if isinstance(getattr(m, "fp8", None), Fp8Weight)),
                None)


def probe_gemm(choices: KernelChoices, model: nn.Module, dtype: torch.dtype) -> None:
    fp8_torch.probe_gemm(choices, first_weight(model), dtype)

"""Tensor-parallel layers: each rank builds and loads only its shard.

With a group of size 1 they are plain Linear/Embedding layers. Shards are contiguous ranges of the HF
tensor (whole heads for attention projections); the loader reads just that range from safetensors.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.comm import all_gather_into, all_reduce
from graphcp.distributed.shards import TPInfo, section_pieces, shard_range
from graphcp.kernels.fp8_torch import linear
from graphcp.kernels.fp8_types import Fp8Weight


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be FP8 (``fp8``, set by the loader): every projection of
    every family runs through the one FP8 dispatch (``kernels/fp8_torch.linear``)."""

    fp8: Fp8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.fp8 or self.weight, self.bias)


def fused_linear(x: torch.Tensor, fused: tuple | None) -> torch.Tensor:
    """[T, sum of sizes]: projections fused by ``quantized.fuse`` (weight, bias, sizes), side by side
    (F.linear, or the FP8 GEMM)."""
    if fused is None:
        raise RuntimeError("projections are not fused: call fuse_projections() after loading weights")
    return linear(x, fused[0], fused[1])


class ColumnLinear(Linear):
    """Output features split across the group; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo, unit: int = 1,
                 rows: tuple[int, int] | None = None) -> None:
        """``rows``: this rank's [start, end) of the output features where it is not its share
        (replicated KV heads)."""
        start, end = rows or shard_range(out_features, tp.size, tp.rank, unit)
        super().__init__(in_features, end - start, bias=bias)
        self.shard = (0, start, end)


class SectionColumnLinear(Linear):
    """Output features made of sections side by side (q|k|v of one projection), each split across
    the group: a rank holds its part of every section, in section order (``section_pieces``)."""

    def __init__(self, in_features: int, sections: tuple[tuple[int, int], ...], tp: TPInfo) -> None:
        pieces = section_pieces(sections, tp.size, tp.rank)
        super().__init__(in_features, pieces.rows, bias=False)
        self.shard = pieces


class RowLinear(Linear):
    """Input features split across the group; partial outputs are summed over the group (``reduce``),
    or left partial for a caller that reduces them itself (a reduce-scatter, then ``add_bias``). A bias is
    whole on every rank and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, tp: TPInfo, unit: int = 1, bias: bool = False) -> None:
        start, end = shard_range(in_features, tp.size, tp.rank, unit)
        super().__init__(end - start, out_features, bias=bias)
        self.shard = (1, start, end)
        self.tp = tp

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        weight = self.fp8 or self.weight
        if reduce and self.tp.size == 1:
            return linear(x, weight, self.bias)          # one GEMM with the bias, as an unsplit Linear
        y = linear(x, weight)
        return self.reduce(y) if reduce else y

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.add_bias(all_reduce(partial, self.tp.group) if self.tp.size > 1 else partial)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Embedding):
    """Vocabulary rows split across the group: each rank embeds the ids it owns, the group sums."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo) -> None:
        start, end = shard_range(vocab_size, tp.size, tp.rank)
        # An empty weight skips nn.Embedding's normal_ init: on the meta device that op imports
        # torch._dynamo (about 2 s of every rank's start) for values the loader overwrites.
        super().__init__(end - start, hidden, _weight=torch.empty(end - start, hidden))
        self.shard, self.tp, self.vocab_size = (0, start, end), tp, vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        _, start, end = self.shard
        owned = (ids >= start) & (ids < end)
        out = super().forward(torch.where(owned, ids - start, torch.zeros_like(ids)))
        out = out * owned[:, None].to(out.dtype)
        return all_reduce(out, self.tp.group)


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TPInfo, vocab_size: int) -> torch.Tensor:
    """LM head over a vocabulary-split weight: local logits, gathered along the vocabulary."""
    logits = nn.functional.linear(hidden, weight)
    if tp.size == 1:
        return logits
    per = -(-vocab_size // tp.size)
    padded = torch.zeros(hidden.shape[0], per, dtype=logits.dtype, device=logits.device)
    padded[:, :logits.shape[1]] = logits
    gathered = padded.new_empty((tp.size * padded.shape[0], per))
    all_gather_into(gathered, padded, tp.group)                       # [size * R, per], rank-major
    return gathered.view(tp.size, -1, per).transpose(0, 1).reshape(padded.shape[0], -1)[:, :vocab_size]

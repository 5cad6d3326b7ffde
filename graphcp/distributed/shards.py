"""What each rank holds, by arithmetic on the flags alone: tensor-parallel slices (``TPInfo``,
``shard_range``), experts (``EPInfo``), even splits and pipeline stages. Pure: no process group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class TPInfo:
    size: int = 1
    rank: int = 0
    group: Any = None


def shard_range(total: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank's [start, end) of ``total`` rows, split in whole ``unit``s; the last shard may be shorter."""
    units = total // unit
    per = -(-units // size)
    start = min(units, rank * per)
    return start * unit, min(units, start + per) * unit


def kv_head_range(kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's [start, end) of ``kv_heads`` heads: a contiguous share, or where the group is larger
    than the heads, the one head of the query heads it holds (rank // (size / kv_heads))."""
    if size <= kv_heads:
        return shard_range(kv_heads, size, rank)
    head = rank // (size // kv_heads)
    return head, head + 1


class Pieces(NamedTuple):
    """A shard made of several row ranges of one tensor, stacked in order: a rank's part of each
    section of a projection whose output is sections side by side (q|k|v), or of a weight over
    those channels. ``dim`` comes first, as in a ``(dim, start, end)`` shard."""
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return sum(end - start for start, end in self.ranges)


def section_pieces(sections: tuple[tuple[int, int], ...], size: int, rank: int) -> Pieces:
    """Rank's rows of outputs made of ``sections`` ((rows, unit) each, side by side): its
    ``shard_range`` of every section, in section order."""
    ranges, offset = [], 0
    for rows, unit in sections:
        start, end = shard_range(rows, size, rank, unit)
        ranges.append((offset + start, offset + end))
        offset += rows
    return Pieces(0, tuple(ranges))


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index``'s [start, end) of ``total`` items in ``parts`` contiguous parts as even as
    possible, the first ``total % parts`` one longer (10 over 4: 3, 3, 2, 2; 6 over 4: 2, 2, 1,
    1)."""
    per, longer = divmod(total, parts)
    start = index * per + min(index, longer)
    return start, start + per + (index < longer)


def pipeline_stage(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Stage ``pp_rank``'s [start, end) of the layers, as SGLang (and vLLM) place them: even, the
    remainder one layer each on the stages before the last, counted back from the second-to-last
    (the last stage also runs the final norm and the LM head). 10 over 4: 2, 3, 3, 2."""
    sizes = [num_layers // pp_size] * pp_size
    for stage in range(num_layers % pp_size):
        sizes[-2 - stage] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass(frozen=True)
class EPInfo:
    """This rank's place for the experts: EP rank (which experts), expert-TP rank (which slice)."""
    ep_size: int = 1
    ep_rank: int = 0
    expert_tp_size: int = 1
    expert_tp_rank: int = 0

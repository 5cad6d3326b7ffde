"""build_layout: the pure, host-side view of a CP layout, for users and tests.

It computes the layout of SPEC section 3 with numpy (a serving loop may call it per batch); a property
test holds it equal to the tensor metadata the engine's forward builds (``cp/metadata.py``), so the layout
users read is the layout that runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcp.cp.strategy import make_strategy


@dataclass
class CPLayout:
    strategy: str
    cp_size: int
    rank: int
    local_indices: list[int]
    per_rank_tokens: list[int]
    q_lens_early: list[int] = field(default_factory=list)
    q_lens_late: list[int] = field(default_factory=list)
    kv_lens_early: list[int] = field(default_factory=list)
    kv_lens_late: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lens)), without a Python loop."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(lens) - lens                       # where each range starts in the output
    return np.repeat(starts - first, lens) + np.arange(total)


def build_layout(strategy: str, cp_size: int, rank: int, extend_lens: list[int],
                 prefix_lens: list[int] | None = None) -> CPLayout:
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} is outside a CP group of size {cp_size}")
    extend_lens = [int(n) for n in extend_lens]
    prefix_lens = [0] * len(extend_lens) if prefix_lens is None else [int(p) for p in prefix_lens]
    if len(prefix_lens) != len(extend_lens) or any(n < 0 for n in extend_lens + prefix_lens):
        raise ValueError("extend_lens and prefix_lens must be equally long lists of non-negative lengths")
    strat = make_strategy(strategy, cp_size)
    counts = strat.per_rank_tokens(extend_lens) if extend_lens else [0] * cp_size
    if not extend_lens:
        return CPLayout(strategy, cp_size, rank, [], counts)
    ext, pre = np.asarray(extend_lens, dtype=np.int64), np.asarray(prefix_lens, dtype=np.int64)
    offsets = np.cumsum(ext) - ext                       # each request's first flat index
    if strategy == "zigzag":
        nblk = 2 * cp_size
        blk = ext[:, None] // nblk + (np.arange(nblk)[None, :] < (ext % nblk)[:, None])     # [R, 2C]
        end = np.cumsum(blk, axis=1)
        early, late = rank, nblk - 1 - rank
        q_early, q_late = blk[:, early], blk[:, late]
        local = np.concatenate([_ranges(offsets + end[:, early] - q_early, q_early),
                                _ranges(offsets + end[:, late] - q_late, q_late)])
        return CPLayout(strategy, cp_size, rank, local.tolist(), counts, q_early.tolist(), q_late.tolist(),
                        (pre + end[:, early]).tolist(), (pre + end[:, late]).tolist())
    local = np.arange(rank, int(ext.sum()), cp_size)
    requests = np.searchsorted(np.cumsum(ext), local, side="right")
    kv_lens = pre[requests] + (local - offsets[requests]) + 1
    return CPLayout(strategy, cp_size, rank, local.tolist(), counts, requests=requests.tolist(),
                    kv_lens=kv_lens.tolist())

"""build_layout: the pure, host-side view of a CP layout, for users and tests.

It runs the same tensor code as the engine's forward, so the layout users read is the layout that runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    cap = max(counts) if extend_lens else 0
    n_req = len(extend_lens)
    ext = torch.tensor(extend_lens, dtype=torch.long)
    pre = torch.tensor(prefix_lens, dtype=torch.long)
    pages = torch.zeros(max(n_req, 1), max(1, max((p + e for p, e in zip(prefix_lens, extend_lens)), default=1)),
                        dtype=torch.long)[:n_req]
    if n_req == 0:
        return CPLayout(strategy, cp_size, rank, [], counts)
    meta = strat.metadata(ext, pre, pages, rank, cap, page_size=1)
    valid = meta.valid.bool()
    layout = CPLayout(strategy, cp_size, rank, meta.token_index[valid].tolist(), counts)
    if strategy == "zigzag":
        layout.q_lens_early, layout.q_lens_late = meta.q_lens[:n_req].tolist(), meta.q_lens[n_req:].tolist()
        layout.kv_lens_early, layout.kv_lens_late = meta.kv_lens[:n_req].tolist(), meta.kv_lens[n_req:].tolist()
    else:
        seq_of_row = torch.searchsorted(meta.cu_seqlens_q[1:], torch.arange(cap), right=True)
        layout.requests = seq_of_row[valid].tolist()
        layout.kv_lens = meta.q_limits[valid].tolist()
    return layout

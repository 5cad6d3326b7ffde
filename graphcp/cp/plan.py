"""A batch's layout, decided once on the host: the strategy it runs with, what each CP rank holds, the
padded local capacity, and the few host-side maxima that kernels run in graph breaks need. The planner
makes it (``ContextParallelStrategy.plan``); the runner, the attention ops and the graphs only read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphcp.cp.strategy import ContextParallelStrategy


@dataclass
class HostMaxima:
    """Host-side values of one batch on one rank (break arguments) and a per-forward kernel scratch."""
    max_q: int = 0
    max_kv: int = 0
    early_rows: int = 0     # zigzag: local rows held by early blocks (the flashattention path splits there)
    workspace: dict = field(default_factory=dict)   # per-forward values kernels share across layers


@dataclass
class LayoutPlan:
    strategy: "ContextParallelStrategy"  # the strategy the batch runs with (unsharded when CP is off)
    cp_applied: bool                     # False: every rank holds the whole batch
    per_rank_tokens: list[int]           # real new tokens each CP rank holds
    local_cap: int                       # rows of this rank's padded buffers (>= 1)
    host: HostMaxima                     # this rank's host maxima
    whole_on: list[int] | None = None    # adaptive CP: 0 split, r + 1 whole on CP rank r
    unsharded_reason: str | None = None  # why a CP group runs the batch unsharded

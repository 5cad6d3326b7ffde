"""The host-side maxima of a batch on one rank: what kernels run in graph breaks need, decided with the
batch's layout (``cp.strategy.LayoutPlan``) and substituted by name at each graph replay."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class HostMaxima:
    """Host-side values of one batch on one rank (break arguments) and a per-forward kernel scratch."""
    max_q: int = 0
    max_kv: int = 0
    early_rows: int = 0     # zigzag: local rows held by early blocks (the flashattention path splits there)
    workspace: dict = field(default_factory=dict)   # per-forward values kernels share across layers

"""ForwardBatch: everything one forward needs, passed down the call (never shared by reference).

The device side is the raw batch descriptors (static graph buffers when replayed); the host side is the
few maxima that kernels run in graph breaks need. A graph replay hands the live batch's ``HostMaxima`` to
its breaks in place of the capture batch's, so a break always sees the batch it serves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from graphcp.cp.strategy import ContextParallelStrategy
    from graphcp.graph.buffers import Descriptors


@dataclass
class HostMaxima:
    """Host-side maxima of one batch (break arguments) and a per-forward scratch for kernels."""
    max_q: int = 0
    max_kv: int = 0
    early_rows: int = 0     # zigzag: local rows held by early blocks (the flashattention path splits there)
    workspace: dict = field(default_factory=dict)   # per-forward values kernels share across layers


@dataclass
class ForwardBatch:
    inputs: "Descriptors"                 # device descriptors: lengths, page rows, token ids
    strategy: "ContextParallelStrategy"   # the layout this batch runs with (unsharded when CP is off)
    local_cap: int                        # rows of this rank's padded buffers (the bucket when graphed)
    host: HostMaxima
    bucket: int | None = None             # the graph bucket replayed, None when eager
    aux_out: "torch.Tensor | None" = None  # speculative aux hidden states land here (static when graphed)

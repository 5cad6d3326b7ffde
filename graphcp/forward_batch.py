"""What one forward runs on, passed down the call (never shared by reference).

``BatchInputs`` is a batch as the host holds it; the descriptors are filled from it (the graph runner's
static ones for a replay, fresh ones for an eager forward). ``ForwardBatch`` is what the forward reads:
the device descriptors, the layout the planner decided (``cp.plan.LayoutPlan``: strategy, local capacity,
host maxima), and where speculative aux rows go.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from graphcp.cp.plan import LayoutPlan
    from graphcp.graph.buffers import Descriptors


@dataclass
class BatchInputs:
    extend_lens: list[int]
    prefix_lens: list[int]
    page_rows: list                       # per request, its page ids (int64 arrays)
    ids: list["torch.Tensor"]             # per request, its new token ids
    whole_on: list[int] | None = None     # adaptive CP placement (see cp/adaptive.py)


@dataclass
class ForwardBatch:
    inputs: "Descriptors"                 # device descriptors: lengths, page rows, token ids
    plan: "LayoutPlan"                    # the layout this batch runs with, decided once by the planner
    aux_out: "torch.Tensor | None" = None  # speculative aux hidden states land here (static when graphed)

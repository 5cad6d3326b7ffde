"""The forward context: per-forward state that layers read, so model code keeps plain signatures.

The runner sets it around a forward; the attention layer asks it for the attention op, which owns CP
communication, KV cache writes and the kernel. Models never see layouts, ranks or graphs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch


class AttentionOp(Protocol):
    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this rank's tokens -> attention output [T, Hq, D]."""


class Communicator(Protocol):
    """Moves activations between the attention layout and the FFN layout (a layer communicator)."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> the rows the FFN serves."""

    def scatter(self, partial: torch.Tensor, rows: int) -> torch.Tensor | None:
        """The FFN's partial sums -> this rank's rows, summed; None: the layouts agree, reduce in place."""


class _SameLayout:
    """FFN and attention hold the same tokens: nothing to move."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def scatter(self, partial: torch.Tensor, rows: int) -> None:
        return None


class MoECommunicator(Protocol):
    """Brings this rank's rows to their experts and the experts' outputs back (graphcp/distributed/moe_comm.py)."""

    def run(self, x: torch.Tensor, router: Callable, experts: Callable,
            row_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, H] -> sum over each row's routed experts, [rows, H]. ``router(x) -> (weights, ids)``;
        ``experts(x, ids, weights)`` sums this rank's experts' weighted outputs. ``row_ids``
        [rows]: an integer per row (e.g. its token id) that travels with the rows; the router is
        then called ``router(rows, their row_ids)``."""


def route(router: Callable, x: torch.Tensor, row_ids: torch.Tensor | None) -> tuple:
    """``router`` on rows ``x`` (with their ``row_ids`` where the block gave them)."""
    return router(x) if row_ids is None else router(x, row_ids)


class _LocalExperts:
    """One rank holds every expert: route and run in place."""

    def run(self, x: torch.Tensor, router: Callable, experts: Callable,
            row_ids: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = route(router, x, row_ids)
        return experts(x, ids, weights)


@dataclass(frozen=True)
class ForwardContext:
    """One forward's state that layers read: the attention op, the layer communicator, the MoE
    token flow and the mask of real rows."""
    attention: AttentionOp
    communicator: Communicator
    moe: MoECommunicator
    valid_rows: torch.Tensor | None = None


_active: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(attention: AttentionOp, communicator: Communicator | None = None,
                    moe: MoECommunicator | None = None, valid_rows: torch.Tensor | None = None) -> Iterator[None]:
    """Set for one forward (the runner's); forwards do not nest, so a second one is an error rather
    than a silent override. ``valid_rows`` [rows]: 1 for this rank's real tokens, 0 for padding
    (token flows skip padding)."""
    global _active
    if _active is not None:
        raise RuntimeError("graphcp.forward_context is already active: one forward at a time")
    _active = ForwardContext(attention, communicator or _SameLayout(), moe or _LocalExperts(), valid_rows)
    try:
        yield
    finally:
        _active = None


def current_moe_communicator() -> MoECommunicator:
    return _active.moe if _active is not None else _LocalExperts()


def current_valid_rows() -> torch.Tensor | None:
    return _active.valid_rows if _active is not None else None


def current_communicator() -> Communicator:
    return _active.communicator if _active is not None else _SameLayout()


def current_attention() -> AttentionOp:
    if _active is None:
        raise RuntimeError("model forward called outside graphcp.forward_context")
    return _active.attention

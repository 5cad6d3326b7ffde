"""The forward context: per-forward state that layers read, so model code keeps plain signatures.

The runner sets it around a forward; the attention layer asks it for the attention op, which owns CP
communication, KV cache writes and the kernel. Models never see layouts, ranks or graphs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

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


_current: AttentionOp | None = None
_communicator: Communicator = _SameLayout()


@contextlib.contextmanager
def forward_context(attention: AttentionOp, communicator: Communicator | None = None) -> Iterator[None]:
    global _current, _communicator
    previous = (_current, _communicator)
    _current, _communicator = attention, communicator or _SameLayout()
    try:
        yield
    finally:
        _current, _communicator = previous


def current_communicator() -> Communicator:
    return _communicator


def current_attention() -> AttentionOp:
    if _current is None:
        raise RuntimeError("model forward called outside graphcp.forward_context")
    return _current

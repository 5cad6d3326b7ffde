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


_current: AttentionOp | None = None


@contextlib.contextmanager
def forward_context(attention: AttentionOp) -> Iterator[None]:
    global _current
    previous, _current = _current, attention
    try:
        yield
    finally:
        _current = previous


def current_attention() -> AttentionOp:
    if _current is None:
        raise RuntimeError("model forward called outside graphcp.forward_context")
    return _current

"""The linear-attention op of a forward: what a Gated DeltaNet layer asks for, as
``current_attention`` serves full attention (graphcp/forward_context.py; this joins it when the
decoder loop is shared).

The op owns the sequence dimension: it splits this rank's rows into sequences, brings each one's
initial conv window and recurrent state (a request's cache, a CP peer's hand-off, or zeros), runs
the conv and the delta rule (graphcp/models/delta_rule.py) and keeps the final states. The layer
owns the projections and its heads, and hands itself to the op as the ``SequenceMixer``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch


class SequenceMixer(Protocol):
    """What the op asks of a Gated DeltaNet layer."""

    layer_id: int

    @property
    def conv_weight(self) -> torch.Tensor:
        """[conv_dim, kernel] depthwise conv weight over the q|k|v channels."""

    def heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [S, T, conv_dim] -> q, k [S, T, Hv, dk] (l2-normalised, fp32, one per value
        head) and v [S, T, Hv, dv]."""


class LinearAttentionOp(Protocol):
    def __call__(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 mixer: SequenceMixer) -> torch.Tensor:
        """This rank's rows: mixed_qkv [T, conv_dim] (before the conv), g (log decay) and beta
        [T, Hv] -> the delta rule's output [T, Hv, dv], fp32 (zeros on padding rows)."""


_current: LinearAttentionOp | None = None


@contextlib.contextmanager
def linear_attention_context(op: LinearAttentionOp) -> Iterator[None]:
    global _current
    previous, _current = _current, op
    try:
        yield
    finally:
        _current = previous


def current_linear_attention() -> LinearAttentionOp:
    if _current is None:
        raise RuntimeError("a linear-attention layer ran outside graphcp.linear_attention_context")
    return _current

"""The linear-attention op on one rank: each request's new tokens are one sequence, started from the
request's cached conv window and delta-rule state (zeros for a fresh request), whose final states go
back to the pool. Under zigzag CP, graphcp/attention/linear_cp.py wraps the same steps.

A Gated DeltaNet layer calls the forward context's attention op as every layer does,
``current_attention()(layer_id, mixed_qkv, g, beta, mixer=layer)``: the op owns the sequence
dimension (states, conv window, CP hand-off), the layer its projections and heads
(``SequenceMixer``).

Every step is a tensor op on device lengths with a static ``max_len`` (no host sync), so the op can
sit inside a captured graph segment; only the CP collectives are breaks where they cannot be
captured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from graphcp.kv.linear_state import LinearStatePool
from graphcp.models.delta_rule import causal_conv, gated_delta_rule, pack, unpack


class SequenceMixer(Protocol):
    """What the op asks of a Gated DeltaNet layer (graphcp/models/gated_deltanet.py)."""

    @property
    def conv_weight(self) -> torch.Tensor:
        """[conv_dim, kernel] depthwise conv weight over the q|k|v channels."""

    def heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [S, T, conv_dim] -> q, k [S, T, Hv, dk] (l2-normalised, fp32, one per value
        head) and v [S, T, Hv, dv]."""


@dataclass
class LinearBatch:
    """What the linear layers need of a batch: each request's new-token count (its rows are
    consecutive, in request order), its state slot and whether it starts fresh (no cached prefix);
    ``max_len`` bounds the counts (the batch's longest eagerly, the bucket's capacity in a
    graph)."""
    lens: torch.Tensor       # [R] int64
    slots: torch.Tensor      # [R] int64, into LinearStatePool (0: the dummy slot of padding)
    fresh: torch.Tensor      # [R] bool
    max_len: int


def mixer_inputs(mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lens: torch.Tensor,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Consecutive sequences of rows -> padded [S, max_len, ...]; padded steps get g = beta = 0,
    the identity step."""
    return pack(mixed_qkv, lens, max_len), pack(g, lens, max_len), pack(beta, lens, max_len)


def run_sequences(mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  mixer: SequenceMixer, lens: torch.Tensor, max_len: int, window: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [N, ...] made of consecutive sequences of ``lens`` (rows past their sum are padding),
    each started from its ``window`` [S, K-1, C] and ``state`` [S, Hv, dk, dv]. Returns (outputs
    [N, Hv, dv] fp32, zeros on padding rows; final windows; final states)."""
    x, g, beta = mixer_inputs(mixed_qkv, g, beta, lens, max_len)
    conv_out, window = causal_conv(x, window, mixer.conv_weight, lens)
    q, k, v = mixer.heads(conv_out)
    o, state = gated_delta_rule(q, k, v, g, beta, state)
    return unpack(o, lens, mixed_qkv.shape[0]), window, state


class LocalLinearAttention:
    """The op for a batch whose tokens all sit on this rank (no CP, or CP not applied)."""

    def __init__(self, pool: LinearStatePool, batch: LinearBatch) -> None:
        self.pool, self.batch = pool, batch

    def __call__(self, layer_id: int, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 mixer: SequenceMixer) -> torch.Tensor:
        """This rank's rows: mixed_qkv [T, conv_dim] (before the conv), g (log decay) and beta
        [T, Hv] -> the delta rule's output [T, Hv, dv], fp32 (zeros on padding rows)."""
        b = self.batch
        window, state = self.pool.read(layer_id, b.slots, b.fresh)
        out, window, state = run_sequences(mixed_qkv, g, beta, mixer, b.lens, b.max_len, window,
                                           state)
        self.pool.write(layer_id, b.slots, window, state)
        return out

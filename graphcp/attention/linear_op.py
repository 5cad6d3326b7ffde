"""The linear-attention op on one rank: each request's new tokens are one sequence, started from the
request's committed conv window and delta-rule state (zeros for a request without one), whose final
states go to the slot its batch writes (``kv/states.py``). Under zigzag CP,
graphcp/attention/linear_cp.py wraps the same steps.

A Gated DeltaNet layer calls the forward context's attention op as every layer does,
``current_attention()(layer_id, mixed_qkv, g, beta, mixer=layer)``: the op owns the sequence
dimension (states, conv window, CP hand-off), the layer its projections and heads
(``SequenceMixer``).

Every step is a tensor op on device lengths with static sizes (``chunk_layout``: the batch's chunk
count, read once per eager forward; a bound from the local capacity in a graph), so the op can sit
inside a captured graph segment; only the CP collectives are breaks where they cannot be captured.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from graphcp.graph.protocol import capture_active
from graphcp.kernels.delta_rule_torch import (
    ChunkLayout,
    causal_conv,
    chunk_count,
    gated_delta_rule,
    state_outputs,
)
from graphcp.kernels.registry import chosen
from graphcp.kv.states import NO_STATE, StatePool

CONV, RECURRENT = "conv", "recurrent"      # a linear layer's per-request parts (attention/kinds.py)


class SequenceMixer(Protocol):
    """What the op asks of a Gated DeltaNet layer (graphcp/models/gated_deltanet.py)."""

    @property
    def conv_weight(self) -> torch.Tensor:
        """[conv_dim, kernel] depthwise conv weight over the q|k|v channels."""

    def heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [S, T, conv_dim] -> q, k [S, T, Hv, dk] (l2-normalised, fp32, one per value
        head) and v [S, T, Hv, dv]."""


class RequestStates:
    """One forward's per-request states of the linear layers: each request reads its committed slot
    (``state_in``; zeros where it has none) and writes the slot its batch writes (``state_out``)."""

    def __init__(self, states: StatePool, state_in: torch.Tensor, state_out: torch.Tensor) -> None:
        self.states, self.state_in, self.state_out = states, state_in, state_out
        self.fresh = state_in == NO_STATE

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [R, K-1, conv_dim], delta states [R, Hv, dk, dv] fp32)."""
        conv, recurrent = self.states.part(layer, CONV), self.states.part(layer, RECURRENT)
        zero = torch.zeros((), device=conv.device)
        window = torch.where(self.fresh[:, None, None], zero.to(conv.dtype),
                             conv.index_select(0, self.state_in))
        state = torch.where(self.fresh[:, None, None, None], zero.to(recurrent.dtype),
                            recurrent.index_select(0, self.state_in))
        return window, state.float()

    def write(self, layer: int, window: torch.Tensor, state: torch.Tensor) -> None:
        conv, recurrent = self.states.part(layer, CONV), self.states.part(layer, RECURRENT)
        conv.index_copy_(0, self.state_out, window.to(conv.dtype))
        recurrent.index_copy_(0, self.state_out, state.to(recurrent.dtype))


def chunk_layout(lens: torch.Tensor, rows: int) -> ChunkLayout:
    """The chunks of one forward's sequences: as many as the batch needs eagerly (one host read per
    forward), the bound for any lengths that fit the ``rows`` in a graph (a captured segment reads
    no host value)."""
    return ChunkLayout(lens, rows, chunk_count(lens, rows, static=capture_active()))


def delta_rule_forms() -> tuple[Callable, Callable]:
    """(the chunked rule, ``state_outputs``): each one's Triton form where this rank's start-up
    check accepted it (CUDA, ``resolve.probe_delta_rule``), else the torch form (CPU)."""
    return chosen("delta_rule") or gated_delta_rule, chosen("delta_state_outputs") or state_outputs


def run_sequences(mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  mixer: SequenceMixer, layout: ChunkLayout, window: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [N, ...] made of consecutive sequences of ``layout.lens`` (rows past their sum are
    padding), each started from its ``window`` [S, K-1, C] and ``state`` [S, Hv, dk, dv]. Returns
    (outputs [N, Hv, dv] fp32, zeros on padding rows; final windows; final states)."""
    conv_out, window = causal_conv(mixed_qkv, window, mixer.conv_weight, layout.lens)
    q, k, v = (t[0] for t in mixer.heads(conv_out[None]))
    o, state = delta_rule_forms()[0](q, k, v, g, beta, state, layout)
    return o, window, state


class LocalLinearAttention:
    """The op for a batch whose tokens all sit on this rank (no CP, or a batch CP does not split).
    It runs the rows in request order (``order``: the local row of each new token, then the padding
    rows), as a one-rank zigzag holds every request's early half, then every late half."""

    def __init__(self, states: RequestStates, block_lens: torch.Tensor, token_index: torch.Tensor,
                 valid: torch.Tensor) -> None:
        """From the layout's blocks ([R, blocks]) and each local row's new-token index and validity
        (``CPMetadata``)."""
        self.states, lens = states, block_lens.sum(1)
        key = torch.where(valid > 0, token_index, token_index.shape[0] + lens.sum())
        self.order = torch.argsort(key, stable=True)
        self.layout = chunk_layout(lens, token_index.shape[0])

    def __call__(self, layer_id: int, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 mixer: SequenceMixer) -> torch.Tensor:
        """This rank's rows: mixed_qkv [T, conv_dim] (before the conv), g (log decay) and beta
        [T, Hv] -> the delta rule's output [T, Hv, dv], fp32 (zeros on padding rows)."""
        window, state = self.states.read(layer_id)
        rows = [t.index_select(0, self.order) for t in (mixed_qkv, g, beta)]
        out, window, state = run_sequences(*rows, mixer, self.layout, window, state)
        self.states.write(layer_id, window, state)
        return torch.empty_like(out).index_copy_(0, self.order, out)

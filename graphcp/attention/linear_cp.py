"""The linear-attention op under zigzag CP: no rank gathers the sequence.

Zigzag splits each request into 2C blocks in sequence order; rank r holds blocks r and 2C-1-r, its
rows ordered early blocks of every request, then late blocks. Per linear layer:

1. halo: every rank all-gathers each of its blocks' last K-1 conv inputs; scanning the blocks in
   order from the request's cached window gives the window entering each block (and the final one);
2. each rank runs the conv and, from a zero state, the delta rule over its own blocks: per block the
   affine map S_end = A S_start + B and the outputs o = o_zero + q_eff S_start
   (graphcp/kernels/delta_rule_torch.py ``block_transition``);
3. one all-gather of (A, B) for every block; every rank scans the 2C blocks of each request in order
   from its cached state, which gives each block's true initial state and the request's final state;
4. outputs are corrected: o = o_zero + q_eff S_start.

Worked example, C = 2, one fresh request of 8 tokens: blocks b0..b3 of 2 tokens; rank 0 holds b0,
b3, rank 1 holds b1, b2. After the gather both ranks know (A_b, B_b) for all four and compute
    S_in(b0) = 0, S_in(b1) = B_0, S_in(b2) = A_1 B_0 + B_1, S_in(b3) = A_2 S_in(b2) + B_2;
rank 0 corrects b3 with S_in(b3), rank 1 corrects b1 and b2 (b0 is exact already). Both store the
final state A_3 S_in(b3) + B_3. A cached request starts the scan from its stored state instead of 0.

Every rank ends with every request's final states, so the pool (graphcp/kv/states.py) holds them
replicated and a continued request needs no exchange to start. Each rank's work is its own
blocks (about 1/C of the tokens) plus a scan of 2C small matrix products per request and head.
"""
from __future__ import annotations

import torch

from graphcp.attention.context import AttentionContext
from graphcp.attention.linear_op import (
    LocalLinearAttention,
    RequestStates,
    SequenceMixer,
    chunk_layout,
    delta_rule_forms,
)
from graphcp.distributed.comm import CPComm, all_gather_into
from graphcp.graph.protocol import graph_break
from graphcp.kernels.delta_rule_torch import block_transition, causal_conv, last_inputs


def gathered_index(block_lens: torch.Tensor) -> torch.Tensor:
    """[R, 2C]: where block b of request q sits among the all-gathered sequences ([C * 2R],
    rank-major, each rank's in row order: every request's early block, then every late block)."""
    requests, blocks = block_lens.shape
    q = torch.arange(requests, device=block_lens.device)[:, None]
    b = torch.arange(blocks, device=block_lens.device)[None, :]
    early = b < blocks // 2
    owner = torch.where(early, b, blocks - 1 - b)
    return owner * 2 * requests + torch.where(early, q, requests + q)


def scan_windows(window: torch.Tensor, tails: torch.Tensor, lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """window [R, K-1, C] before each request; tails [R, 2C, K-1, C] each block's last K-1 inputs,
    right-aligned (zeros before a short block's inputs); lens [R, 2C]. Returns (the window entering
    each block [R, 2C, K-1, C], the window after the last block [R, K-1, C])."""
    width = window.shape[1]
    j = torch.arange(width, device=window.device)
    entering = []
    for b in range(tails.shape[1]):
        entering.append(window)
        m = lens[:, b].clamp(max=width)[:, None]                       # inputs the block adds
        # The last K-1 of (window ++ the block's m inputs): window rows m.. then the tail's last m.
        rows = torch.where(m + j < width, m + j, width + j)            # [R, K-1] into the concat
        both = torch.cat([window, tails[:, b]], 1)
        window = both.gather(1, rows[..., None].expand(-1, -1, both.shape[-1]))
    return torch.stack(entering, 1), window


def scan_states(state: torch.Tensor, trans: torch.Tensor, offset: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """state [R, H, dk, dv] before each request; trans [R, 2C, H, dk, dk], offset [R, 2C, H, dk, dv]
    each block's affine map. Returns (each block's initial state [R, 2C, H, dk, dv], the final
    state)."""
    entering = []
    for b in range(trans.shape[1]):
        entering.append(state)
        state = trans[:, b] @ state + offset[:, b]
    return torch.stack(entering, 1), state


class ZigzagLinearAttention:
    """The op for a zigzag batch: ``block_lens`` [R, 2C] each request's blocks in sequence order,
    the same on every rank (``CPMetadata.block_lens``); ``capacity``: this rank's rows.
    Counts its exchanges and the bytes this rank receives (inside the collective's break, so graph
    replays count too)."""

    def __init__(self, states: RequestStates, block_lens: torch.Tensor, comm: CPComm,
                 capacity: int) -> None:
        self.states, self.block_lens, self.comm = states, block_lens, comm
        self.lens = self.local_lens(comm.rank)
        self.layout = chunk_layout(self.lens, capacity)
        self.index = gathered_index(block_lens)          # depends on R and C only
        self.num_exchanges = 0
        self.bytes_received = 0

    def local_lens(self, rank: int) -> torch.Tensor:
        """This rank's sequences in row order: every request's early block, then its late block."""
        return torch.cat([self.block_lens[:, rank], self.block_lens[:, -1 - rank]])

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """[2R, ...] from every rank -> [R, 2C, ...] in each request's block order."""
        out = local.new_empty((self.comm.size * local.shape[0],) + local.shape[1:])
        (_exchange if self.comm.capturable else _exchange_break)(self, out, local.contiguous())
        return out[self.index]

    def __call__(self, layer_id: int, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 mixer: SequenceMixer) -> torch.Tensor:
        """As ``LocalLinearAttention``: this rank's zigzag rows in, their outputs out."""
        rank, lens = self.comm.rank, self.lens
        late = 2 * self.comm.size - 1 - rank
        window, state = self.states.read(layer_id)
        # Each local block's last K-1 inputs, right-aligned (zeros before a shorter block's).
        tails = last_inputs(mixed_qkv, window.new_zeros((lens.shape[0],) + window.shape[1:]), lens)
        entering, final_window = scan_windows(window, self._gather(tails), self.block_lens)
        mine = torch.cat([entering[:, rank], entering[:, late]])         # local row order
        conv_out, _ = causal_conv(mixed_qkv, mine, mixer.conv_weight, lens)
        q, k, v = (t[0] for t in mixer.heads(conv_out[None]))
        rule, state_outputs = delta_rule_forms()
        o_zero, q_eff, trans, offset = block_transition(q, k, v, g, beta, self.layout, rule)
        dv = offset.shape[-1]
        maps = self._gather(torch.cat([trans, offset], -1))              # one exchange for both
        starts, final_state = scan_states(state, maps[..., :-dv], maps[..., -dv:])
        start = torch.cat([starts[:, rank], starts[:, late]])
        self.states.write(layer_id, final_window, final_state)
        return o_zero + state_outputs(q_eff, start, self.layout)


def _exchange(op: ZigzagLinearAttention, out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    op.num_exchanges += 1
    op.bytes_received += out.numel() * out.element_size()
    return all_gather_into(out, local, op.comm.group)


_exchange_break = graph_break(_exchange, collective=True)


def exchange_bytes(requests: int, cp_size: int, mixer_dims: tuple[int, int, int, int, int],
                   conv_bytes: int) -> int:
    """Bytes each rank receives per linear layer: the halo and the block maps of 2C blocks per
    request. ``mixer_dims`` = (kernel, conv_dim, heads, dk, dv); the maps are fp32."""
    kernel, conv_dim, heads, dk, dv = mixer_dims
    blocks = 2 * cp_size * requests
    return blocks * ((kernel - 1) * conv_dim * conv_bytes + heads * dk * (dk + dv) * 4)


def linear_attention(ctx: AttentionContext) -> LocalLinearAttention | ZigzagLinearAttention:
    """The op of the ``gated_deltanet`` layer kind for one forward: the zigzag hand-off when CP
    splits the batch, the one-rank op otherwise (CP off, or a batch that runs unsharded)."""
    meta = ctx.meta
    states = RequestStates(ctx.pool.states, meta.state_in, meta.state_out)
    if meta.cp_size > 1:
        return ZigzagLinearAttention(states, meta.block_lens, ctx.comm, meta.local_cap)
    return LocalLinearAttention(states, meta.block_lens, meta.token_index, meta.valid)

"""Gated DeltaNet's sequence mixing as plain functions of (inputs, initial states) -> (outputs,
final states): the short causal conv1d with SiLU, and the chunked gated delta rule.

A batch is S sequences of ``lens`` [S] whose rows lie consecutively in one buffer [N, ...] (rows
past ``lens.sum()`` are padding). Nothing is padded to the longest sequence: the conv reads each
row's K-1 predecessors (from the sequence's own rows, else its initial window), and the delta rule
runs on ``ChunkLayout``'s chunks, each sequence starting a chunk of its own, so the work grows with
the tokens plus at most one partial chunk per sequence. Every function is tensor ops on device
lengths with static sizes, so it can run inside a captured graph.

The delta rule per head, with state S [dk, dv] (dk rows: key space):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(dk)
Each step is affine in S, so a whole sequence is too: S_end = A S_start + B. ``block_transition``
returns A (the decay included) and B, and the outputs as o = o_zero + q_eff S_start
(``state_outputs``), the form the context-parallel hand-off needs (graphcp/attention/linear_cp.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

CHUNK = 64       # the chunk length of the WY form, as HF's torch fallback and FLA use


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's normalisation (eps inside the root), as HF applies it to q and k in fp32."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _row_sequences(lens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence of each row [rows], that sequence's first row, row valid): padding rows are
    invalid and point at the last sequence."""
    ends = torch.cumsum(lens, 0)
    row = torch.arange(rows, device=lens.device)
    seq = torch.searchsorted(ends, row, right=True).clamp(max=lens.shape[0] - 1)
    return seq, (ends - lens)[seq], row < ends[-1]


def _with_windows(x: torch.Tensor, window: torch.Tensor, lens: torch.Tensor,
                  rows: torch.Tensor, starts: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (any shape, may be negative offsets before a sequence's start ``starts``) of
    each sequence ``seq``, read from x where they are the sequence's own, else from its window."""
    width = window.shape[1]
    both = torch.cat([window.reshape(-1, x.shape[-1]).to(x.dtype), x])     # [S * (K-1) + N, C]
    own = rows >= starts
    index = torch.where(own, window.shape[0] * width + rows.clamp(min=0),
                        seq * width + width + (rows - starts).clamp(min=-width))
    return both[index]


def last_inputs(x: torch.Tensor, window: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The last K-1 inputs of each sequence [S, K-1, C], oldest first: its window's where it is
    shorter than K-1 (zeros for a zero window)."""
    width = window.shape[1]
    ends = torch.cumsum(lens, 0)
    rows = ends[:, None] - width + torch.arange(width, device=x.device)
    seq = torch.arange(lens.shape[0], device=x.device)[:, None].expand_as(rows)
    return _with_windows(x, window, lens, rows, (ends - lens)[:, None], seq)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d then SiLU. x [N, C] consecutive sequences of ``lens`` [S] (padding
    rows after), ``window`` [S, K-1, C] the K-1 inputs before each sequence (zeros for a fresh
    one), weight [C, K]. Returns (outputs [N, C], zeros on padding rows; the window after each
    sequence [S, K-1, C])."""
    kernel = weight.shape[1]
    seq, starts, valid = _row_sequences(lens, x.shape[0])
    taps = torch.arange(x.shape[0], device=x.device)[:, None] + torch.arange(
        1 - kernel, 1, device=x.device)                                  # [N, K]: rows t-K+1 .. t
    inputs = _with_windows(x, window, lens, taps, starts[:, None], seq[:, None])   # [N, K, C]
    out = F.silu(torch.einsum("nkc,ck->nc", inputs, weight.to(x.dtype)))
    return out * valid[:, None].to(out.dtype), last_inputs(x, window, lens)


class ChunkLayout:
    """Sequences of ``lens`` in ``chunks`` chunks of CHUNK steps, each sequence starting a new one
    (``chunks`` static, at least the sum of ceil(len / CHUNK)); unused chunks are empty."""

    def __init__(self, lens: torch.Tensor, rows: int, chunks: int) -> None:
        device, self.lens, self.rows = lens.device, lens, rows
        per = torch.div(lens + CHUNK - 1, CHUNK, rounding_mode="floor")
        first = torch.cumsum(per, 0) - per                                  # [S]
        index = torch.arange(chunks, device=device)
        self.seq = torch.searchsorted(torch.cumsum(per, 0), index, right=True).clamp(
            max=lens.shape[0] - 1)                                           # [chunks]
        steps = (index - first[self.seq])[:, None] * CHUNK + torch.arange(CHUNK, device=device)
        self.valid = steps < lens[self.seq][:, None]                         # [chunks, CHUNK]
        self.seq_start = torch.cumsum(lens, 0) - lens                       # [S] first rows
        self.source = (self.seq_start[self.seq][:, None] + steps).clamp(0, max(rows - 1, 0))
        self.chunk_row, self.chunk_len = self.source[:, 0].contiguous(), self.valid.sum(1)
        self.starts = (index == first[self.seq]) & (per[self.seq] > 0)      # a sequence's first
        self.last = (first + per - 1).clamp(min=0)                           # [S]
        seq, row_start, self.row_valid = _row_sequences(lens, rows)
        offset = torch.arange(rows, device=device) - row_start
        self.row_chunk = (first[seq] + torch.div(offset, CHUNK, rounding_mode="floor")).clamp(
            0, chunks - 1)
        self.row_step = torch.remainder(offset, CHUNK)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] rows -> [chunks, CHUNK, ...] fp32, zeros outside the sequences."""
        mask = self.valid.view(self.valid.shape + (1,) * (x.dim() - 1))
        return torch.where(mask, x.float()[self.source], torch.zeros((), device=x.device))

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[chunks, CHUNK, ...] -> [N, ...], zeros on padding rows."""
        picked = y[self.row_chunk, self.row_step]
        mask = self.row_valid.view((self.rows,) + (1,) * (picked.dim() - 1))
        return torch.where(mask, picked, torch.zeros((), dtype=y.dtype, device=y.device))


def _chunked_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, layout: ChunkLayout
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` with its outputs left in chunk space [H, chunks, CHUNK, D]."""
    dk = k.shape[-1]
    q, k, v = (layout.to_chunks(x).permute(2, 0, 1, 3) for x in (q * dk ** -0.5, k, v))
    g, beta = (layout.to_chunks(x).permute(2, 0, 1) for x in (g, beta))     # [H, chunks, CHUNK]
    cum = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    gap = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * gap).tril(-1) + torch.eye(CHUNK, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * gap                          # s <= t, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)   # to chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]                      # [H, chunks, 1, 1]
    initial = state.float().transpose(0, 1)                                # [H, S, dk, D]
    current, out, after = initial[:, 0], [], []
    for i in range(layout.seq.shape[0]):
        start = initial.index_select(1, layout.seq[i:i + 1])[:, 0]
        current = torch.where(layout.starts[i], start, current)
        delta = u[:, i] - w[:, i] @ current
        out.append(q_decayed[:, i] @ current + scores[:, i] @ delta)
        current = current * chunk_decay[:, i] + k_to_end[:, i] @ delta
        after.append(current)
    final = torch.stack(after, 1).index_select(1, layout.last).transpose(0, 1)
    empty = (layout.lens == 0).view(-1, 1, 1, 1)
    return torch.stack(out, 1), torch.where(empty, state.float(), final)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, layout: ChunkLayout
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q, k [N, H, dk] (l2-normalised, one head per value head), v [N, H, D], g (log decay) and
    beta [N, H]; each sequence of ``layout`` started from ``state`` [S, H, dk, D]. Returns (o
    [N, H, D], zeros on padding rows; final states [S, H, dk, D]), fp32.

    Chunked (WY form): within a chunk, with G the cumulative log decay, the per-step corrections
    delta = U - W S_chunk_start solve one unit-lower-triangular system (I + L), L[t, s] =
    beta_t exp(G_t - G_s) k_t.k_s for s < t; then one matmul per chunk carries the state on, in
    chunk order, restarting at each sequence's first chunk."""
    out, final = _chunked_rule(q, k, v, g, beta, state, layout)
    return layout.to_rows(out.permute(1, 2, 0, 3)), final


def block_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, layout: ChunkLayout, rule: Callable = gated_delta_rule
                     ) -> tuple[torch.Tensor, ...]:
    """Each sequence as an affine map of its initial state, from one zero-state pass of ``rule``
    (``gated_delta_rule`` or its Triton form).

    Returns (o_zero [N, H, dv], q_eff [N, H, dk], A [S, H, dk, dk], B [S, H, dk, dv]) with, for any
    initial states S0: outputs = o_zero + ``state_outputs(q_eff, S0)`` and final states = A @ S0 +
    B. The rule acts on each value column alone, so dk extra zero-value columns started from the
    identity carry A (and, as their outputs, q_eff) through the same pass."""
    heads, dk, dv = k.shape[1], k.shape[-1], v.shape[-1]
    seqs = layout.lens.shape[0]
    v_aug = torch.cat([v, v.new_zeros(v.shape[:2] + (dk,))], -1)       # v's dtype: exact
    eye = torch.eye(dk, device=v.device).expand(seqs, heads, dk, dk)
    start = torch.cat([eye.new_zeros(seqs, heads, dk, dv), eye], -1)
    out, final = rule(q, k, v_aug, g, beta, start, layout)
    return out[..., :dv], out[..., dv:], final[..., dv:], final[..., :dv]


def state_outputs(q_eff: torch.Tensor, state: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """q_eff @ S0 per row [N, H, dv]: what initial states ``state`` [S, H, dk, dv] add to the
    zero-state outputs of rows q_eff [N, H, dk], one matmul per chunk (its sequence's state; no
    per-row copy of a state)."""
    chunked = layout.to_chunks(q_eff).permute(2, 0, 1, 3)                # [H, chunks, CHUNK, dk]
    initial = state.float().transpose(0, 1)                                # [H, S, dk, dv]
    out = [chunked[:, i] @ initial.index_select(1, layout.seq[i:i + 1])[:, 0]
           for i in range(layout.seq.shape[0])]
    return layout.to_rows(torch.stack(out, 1).permute(1, 2, 0, 3))


def chunk_count(lens: torch.Tensor, capacity: int, static: bool) -> int:
    """Chunks a ``ChunkLayout`` of ``lens`` needs: the exact count (one host read), or the bound a
    graph can take for any lengths summing to ``capacity`` rows (a partial chunk per sequence)."""
    if static:
        return -(-capacity // CHUNK) + lens.shape[0]
    return max(int(torch.div(lens + CHUNK - 1, CHUNK, rounding_mode="floor").sum()), 1)

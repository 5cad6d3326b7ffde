"""Gated DeltaNet's sequence mixing as plain functions of (inputs, initial states) -> (outputs,
final states): the short causal conv1d with SiLU, and the chunked gated delta rule.

Batches are padded per sequence: [S, T, ...] with each sequence's rows first. A padded step carries
``beta = 0`` and ``g = 0``, which makes it the identity on the state, so a sequence's final state is
the one after its last real token whatever the padding.

The delta rule per head, with state S [dk, dv] (dk rows: key space):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(dk)
Each step is affine in S, so a whole block of steps is too: S_end = A S_start + B.
``block_transition`` returns A (the decay included) and B, and the outputs as o = o_zero + q_eff
S_start, the form the context-parallel hand-off needs (graphcp/attention/linear_cp.py).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

CHUNK = 64       # the chunk length of the WY form, as HF's torch fallback and FLA use


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's normalisation (eps inside the root), as HF applies it to q and k in fp32."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d then SiLU. x [S, T, C] right-padded inputs, ``window`` [S, K-1, C]
    the K-1 inputs before each sequence (zeros for a fresh one), weight [C, K], lens [S]. Returns
    (outputs [S, T, C], the window after each sequence's last real input [S, K-1, C])."""
    channels, kernel = weight.shape
    full = torch.cat([window.to(x.dtype), x], 1)                       # [S, K-1+T, C]
    out = F.conv1d(full.transpose(1, 2), weight[:, None, :].to(x.dtype), groups=channels)
    tail = lens[:, None] + torch.arange(kernel - 1, device=x.device)   # rows of the last K-1 inputs
    new_window = full.gather(1, tail[..., None].expand(-1, -1, channels))
    return F.silu(out.transpose(1, 2)), new_window


def _chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """[S, T, H, ...] padded to n * CHUNK steps -> [S, H, n, CHUNK, ...] in fp32."""
    x = x.float().transpose(1, 2)
    pad = n * CHUNK - x.shape[2]
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[:2] + (pad,) + x.shape[3:])], 2)
    return x.reshape(x.shape[:2] + (n, CHUNK) + x.shape[3:])


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [S, T, H, dk] (l2-normalised, one head per value head), v [S, T, H, D], g (log decay)
    and beta [S, T, H], state [S, H, dk, D] -> (o [S, T, H, D], final state [S, H, dk, D]), fp32.

    Chunked (WY form): within a chunk, with G the cumulative log decay, the per-step corrections
    delta = U - W S_chunk_start solve one unit-lower-triangular system (I + L), L[t, s] =
    beta_t exp(G_t - G_s) k_t.k_s for s < t; then one matmul per chunk carries the state on."""
    seqs, steps, heads, dk = k.shape
    n = max(1, -(-steps // CHUNK))
    q, k, v = _chunks(q, n) * dk ** -0.5, _chunks(k, n), _chunks(v, n)
    g, beta = _chunks(g, n), _chunks(beta, n)
    cum = g.cumsum(-1)                                                   # [S, H, n, c]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    gap = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * gap).tril(-1) + torch.eye(CHUNK, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * gap                          # s <= t, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]             # keys decayed to chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]                    # [S, H, n, 1, 1]
    state = state.float()
    out = []
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ delta)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ delta
    o = torch.stack(out, 2).reshape(seqs, heads, n * CHUNK, -1)[:, :, :steps]
    return o.transpose(1, 2), state


def block_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each sequence as an affine map of its initial state, from one zero-state pass.

    Returns (o_zero [S, T, H, dv], q_eff [S, T, H, dk], A [S, H, dk, dk], B [S, H, dk, dv]) with,
    for any initial state S0: outputs = o_zero + q_eff @ S0 and final state = A @ S0 + B. The rule
    acts on each value column alone, so dk extra zero-value columns started from the identity carry
    A (and, as their outputs, q_eff) through the same chunked pass."""
    seqs, _, heads, dk = k.shape
    dv = v.shape[-1]
    v_aug = torch.cat([v.float(), v.new_zeros(v.shape[:3] + (dk,), dtype=torch.float32)], -1)
    eye = torch.eye(dk, device=v.device).expand(seqs, heads, dk, dk)
    start = torch.cat([eye.new_zeros(seqs, heads, dk, dv), eye], -1)
    o, final = gated_delta_rule(q, k, v_aug, g, beta, start)
    return o[..., :dv], o[..., dv:], final[..., dv:], final[..., :dv]


def pack(rows: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Consecutive sequences of ``rows`` [N, ...] with lengths ``lens`` [S] -> [S, max_len, ...],
    zero past each length. Tensor ops with a static ``max_len`` (at least 1, so an empty sequence
    still passes one identity step), so it can run inside a captured graph."""
    steps = torch.arange(max(max_len, 1), device=rows.device)
    starts = torch.cumsum(lens, 0) - lens
    index = (starts[:, None] + steps).clamp(max=max(rows.shape[0] - 1, 0))
    valid = (steps < lens[:, None]).view(index.shape + (1,) * (rows.dim() - 1))
    return torch.where(valid, rows[index], torch.zeros((), dtype=rows.dtype, device=rows.device))


def unpack(padded: torch.Tensor, lens: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of ``pack``: [S, T, ...] -> [rows, ...]; rows past sum(lens) are zeros."""
    ends = torch.cumsum(lens, 0)
    row = torch.arange(rows, device=padded.device)
    seq = torch.searchsorted(ends, row, right=True).clamp(max=lens.shape[0] - 1)
    offset = row - (ends - lens)[seq]
    valid = (offset < lens[seq]).view((rows,) + (1,) * (padded.dim() - 2))
    picked = padded[seq, offset.clamp(0, padded.shape[1] - 1)]
    return torch.where(valid, picked, torch.zeros((), dtype=padded.dtype, device=padded.device))

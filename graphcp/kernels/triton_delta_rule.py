"""The chunked gated delta rule in Triton (CUDA), with the contract of ``delta_rule_torch``'s
``gated_delta_rule`` and ``state_outputs``: three launches per call instead of a Python loop of
aten ops over every 64-step chunk.

Same WY form as the torch code (see its docstring), split by what can run in parallel:

1. ``_wy_kernel``, one program per (chunk, head), every chunk at once: the chunk's cumulative log
   decay G, T = (I + L)^-1 with L[t, s] = beta_t exp(G_t - G_s) k_t.k_s (s < t) by substitution
   (exact fp32 element operations), w = T (beta exp(G) k), u = T (beta v), and the causal decayed
   scores exp(G_t - G_s) q_t.k_s (s <= t);
2. ``_state_kernel``, one program per (sequence, head, block of value columns), chunks in order:
   the state block stays in registers; per chunk delta = u - w S, o = exp(G) q S + scores delta,
   S = exp(G_end) S + (exp(G_end - G) k)^T delta. Lengths come from device memory (capturable);
   an empty sequence leaves its initial state.

``_state_outputs_kernel`` is ``state_outputs``: each chunk's rows q_eff @ S0 of its sequence.

Rows are ``ChunkLayout``'s (consecutive sequences, padding rows after; their outputs are zeros).
No integer argument depends on the batch (lengths and chunk offsets are read from tensors; the
ints are per-model strides and head counts, the latter unspecialised), so a new length never
compiles a kernel. Everything
is fp32; the dots run on TF32 tensor cores on CUDA (so the forms serve 16-bit models, whose values
are coarser than TF32) and exactly in Triton's interpreter.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphcp.kernels.delta_rule_torch import CHUNK, ChunkLayout
from graphcp.kernels.registry import DELTA_HEAD_DIMS


# The head count and the row strides of g and beta (= heads) vary between models but not between
# batches; unspecialised, the start-up probe (2 heads) compiles the very kernels serving then runs.
@triton.jit(do_not_specialize=["heads", "stride_gn", "stride_bn"])
def _wy_kernel(Q, K, V, G, BETA, CHUNK_ROW, CHUNK_LEN, W, U, GC, AQK,
               stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
               stride_gn, stride_gh, stride_bn, stride_bh, heads, scale,
               BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
               PREC: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(CHUNK_LEN + c).to(tl.int32)
    if n > 0:
        row0 = tl.load(CHUNK_ROW + c).to(tl.int64)
        t = tl.arange(0, BT)
        ok = t < n
        d = tl.arange(0, DK)
        g = tl.load(G + row0 * stride_gn + h * stride_gh + t * stride_gn, mask=ok, other=0.0)
        gc = tl.cumsum(g.to(tl.float32), 0)
        beta = tl.load(BETA + row0 * stride_bn + h * stride_bh + t * stride_bn, mask=ok,
                       other=0.0).to(tl.float32)
        k = tl.load(K + row0 * stride_kn + h * stride_kh + t[:, None] * stride_kn + d[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        diff = gc[:, None] - gc[None, :]
        lower = t[:, None] > t[None, :]
        kk = tl.dot(k, tl.trans(k), input_precision=PREC)
        strict = tl.where(lower, beta[:, None] * kk * tl.exp(tl.where(lower, diff, 0.0)), 0.0)
        # T = (I + L)^-1 = I - T L, column by column from the last: column j reads only the
        # final columns right of it. Column j of L is read back as a row of L^T, written to this
        # chunk's rows of AQK (its scores come later): each step reduces along rows of T, with no
        # row extracted across warps.
        out_row = row0 * heads + h                         # W, U, GC, AQK: contiguous [N, H, ...]
        cols = AQK + out_row * BT + t[None, :] * (heads * BT) + t[:, None]
        tl.store(cols, strict, mask=ok[None, :])           # L[i, j] at row j, column i
        tl.debug_barrier()
        eye = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
        inv = eye
        for step in range(2, n + 1):                        # columns n-2 .. 0; the rest are I's
            j = n - step
            col_j = tl.load(AQK + out_row * BT + j * (heads * BT) + t, mask=ok, other=0.0)
            inv = tl.where(t[None, :] == j, eye - tl.sum(inv * col_j[None, :], 1)[:, None], inv)
        tl.debug_barrier()                                 # every column read before the scores
        w = tl.dot(inv, k * (beta * tl.exp(gc))[:, None], input_precision=PREC)
        tl.store(W + out_row * DK + t[:, None] * (heads * DK) + d[None, :], w, mask=ok[:, None])
        e = tl.arange(0, BV)
        for vb in tl.static_range(0, DV // BV):
            v = tl.load(V + row0 * stride_vn + h * stride_vh + t[:, None] * stride_vn
                        + vb * BV + e[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
            tl.store(U + out_row * DV + t[:, None] * (heads * DV) + vb * BV + e[None, :], u,
                     mask=ok[:, None])
        q = tl.load(Q + row0 * stride_qn + h * stride_qh + t[:, None] * stride_qn + d[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32) * scale
        causal = t[:, None] >= t[None, :]
        scores = tl.dot(q, tl.trans(k), input_precision=PREC)
        scores = tl.where(causal, scores * tl.exp(tl.where(causal, diff, 0.0)), 0.0)
        tl.store(AQK + out_row * BT + t[:, None] * (heads * BT) + t[None, :], scores,
                 mask=ok[:, None])
        tl.store(GC + out_row + t * heads, gc, mask=ok)


@triton.jit(do_not_specialize=["heads"])
def _state_kernel(Q, K, W, U, GC, AQK, STARTS, LENS, S0, OUT, SN,
                  stride_qn, stride_qh, stride_kn, stride_kh, stride_on, stride_oh,
                  stride_ss, stride_sh, stride_sk, heads, scale,
                  BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  PREC: tl.constexpr):
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(LENS + s).to(tl.int32)
    row0 = tl.load(STARTS + s).to(tl.int64)
    t = tl.arange(0, BT)
    d = tl.arange(0, DK)
    e = vb * BV + tl.arange(0, BV)
    state_at = s.to(tl.int64) * stride_ss + h * stride_sh + d[:, None] * stride_sk + e[None, :]
    state = tl.load(S0 + state_at).to(tl.float32)                       # [DK, BV]
    for start in range(0, n, BT):
        ok = start + t < n
        rows = row0 + start + t                                             # [BT] int64
        cells = rows * heads + h                                            # W, U, GC, AQK rows
        gc = tl.load(GC + cells, mask=ok, other=0.0)
        g_end = tl.load(GC + (row0 + tl.minimum(n, start + BT) - 1) * heads + h)
        w = tl.load(W + cells[:, None] * DK + d[None, :], mask=ok[:, None], other=0.0)
        u = tl.load(U + cells[:, None] * DV + e[None, :], mask=ok[:, None], other=0.0)
        delta = u - tl.dot(w, state, input_precision=PREC)                 # [BT, BV]
        # Row scalings go on the small [BT, BV] sides, so q and k feed the dots as loaded.
        q = tl.load(Q + rows[:, None] * stride_qn + h * stride_qh + d[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.load(AQK + cells[:, None] * BT + t[None, :], mask=ok[:, None], other=0.0)
        o = tl.dot(q, state, input_precision=PREC) * (scale * tl.exp(gc))[:, None]
        o += tl.dot(scores, delta, input_precision=PREC)
        tl.store(OUT + rows[:, None] * stride_on + h * stride_oh + e[None, :], o,
                 mask=ok[:, None])
        k = tl.load(K + rows[:, None] * stride_kn + h * stride_kh + d[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        delta = delta * tl.where(ok, tl.exp(g_end - gc), 0.0)[:, None]     # decay to chunk end
        state = state * tl.exp(g_end) + tl.dot(tl.trans(k), delta, input_precision=PREC)
    tl.store(SN + state_at, state)


@triton.jit
def _state_outputs_kernel(QE, S0, CHUNK_ROW, CHUNK_LEN, CHUNK_SEQ, OUT,
                          stride_qn, stride_qh, stride_ss, stride_sh, stride_sk,
                          stride_on, stride_oh,
                          BT: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
                          PREC: tl.constexpr):
    c, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(CHUNK_LEN + c).to(tl.int32)
    if n > 0:
        row0 = tl.load(CHUNK_ROW + c).to(tl.int64)
        seq = tl.load(CHUNK_SEQ + c).to(tl.int64)
        t = tl.arange(0, BT)
        ok = t < n
        d = tl.arange(0, DK)
        e = vb * BV + tl.arange(0, BV)
        q = tl.load(QE + row0 * stride_qn + h * stride_qh + t[:, None] * stride_qn + d[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        state = tl.load(S0 + seq * stride_ss + h * stride_sh + d[:, None] * stride_sk
                        + e[None, :]).to(tl.float32)
        o = tl.dot(q, state, input_precision=PREC)
        tl.store(OUT + row0 * stride_on + h * stride_oh + t[:, None] * stride_on + e[None, :], o,
                 mask=ok[:, None])


class DeltaTiles(NamedTuple):
    block_v: int          # value columns per program of the state and state-output kernels
    num_warps: int        # their warps
    num_stages: int       # the chunk loop's: 1, as pipelined loads pass sm_90a's shared memory
    wy_block_v: int       # the WY kernel's value columns per dot (u), and its warps
    wy_warps: int


def delta_rule_tiles(dk: int, dv: int) -> DeltaTiles:
    """The state block [dk, block_v] stays in registers beside the chunk's [64, dk] q, k and w
    tiles: at dk 128, 16 value columns and 8 warps fit sm_90a's 255 registers without spills
    (``profiles/kernel_report.py``); narrower keys take 32 columns on 4 warps."""
    wide = dk > 64
    block_v = min(16 if wide else 32, dv & -dv)        # a power of two dividing dv
    return DeltaTiles(block_v, 8 if wide else 4, 1, min(64, dv & -dv), 8)


def _check_dims(dk: int, dv: int) -> None:
    assert dk in DELTA_HEAD_DIMS, \
        f"the Triton delta rule supports key head dims {DELTA_HEAD_DIMS}, not {dk}"
    assert dv >= 16 and dv % 16 == 0 and dv <= 512, \
        f"the Triton delta rule needs value widths a multiple of 16 up to 512, not {dv}"


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself where its last dim is contiguous (rows and heads at any strides, e.g. column
    slices of a packed buffer), else a contiguous copy: the conv's output is column-major, and
    its strides, which grow with the rows, would specialise the kernels per length."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _precision(x: torch.Tensor) -> str:
    """TF32 tensor cores on CUDA (the forms serve 16-bit models there: ``probe_delta_rule``);
    exact fp32 in the interpreter."""
    return "tf32" if x.device.type == "cuda" else "ieee"


def triton_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor, layout: ChunkLayout
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule_torch.gated_delta_rule``: rows q, k [N, H, dk], v [N, H, dv], g and beta
    [N, H]; ``state`` [S, H, dk, dv]. Returns (o [N, H, dv] fp32, zeros on padding rows; final
    states [S, H, dk, dv] fp32)."""
    rows, heads, dk = k.shape
    dv = v.shape[-1]
    _check_dims(dk, dv)
    q, k, v, g, beta = (_unit_last(x) for x in (q, k, v, g, beta))
    device, f32 = q.device, torch.float32
    w = torch.empty(rows, heads, dk, dtype=f32, device=device)
    u = torch.empty(rows, heads, dv, dtype=f32, device=device)
    gc = torch.empty(rows, heads, dtype=f32, device=device)
    scores = torch.empty(rows, heads, CHUNK, dtype=f32, device=device)
    out = torch.zeros(rows, heads, dv, dtype=f32, device=device)
    initial = state.float().contiguous()
    final = torch.empty_like(initial)
    seqs, chunks = layout.lens.shape[0], layout.seq.shape[0]
    tiles = delta_rule_tiles(dk, dv)
    prec, scale = _precision(q), dk ** -0.5
    if rows and heads and chunks:
        _wy_kernel[(chunks, heads)](
            q, k, v, g, beta, layout.chunk_row, layout.chunk_len, w, u, gc, scores,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), heads, scale,
            BT=CHUNK, DK=dk, DV=dv, BV=tiles.wy_block_v, PREC=prec, num_warps=tiles.wy_warps)
    if heads and seqs:
        _state_kernel[(seqs, heads, dv // tiles.block_v)](
            q, k, w, u, gc, scores, layout.seq_start, layout.lens, initial, out, final,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
            initial.stride(0), initial.stride(1), initial.stride(2), heads, scale,
            BT=CHUNK, DK=dk, DV=dv, BV=tiles.block_v, PREC=prec, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
    return out, final


def triton_state_outputs(q_eff: torch.Tensor, state: torch.Tensor, layout: ChunkLayout
                         ) -> torch.Tensor:
    """``delta_rule_torch.state_outputs``: q_eff [N, H, dk] rows times their sequence's state
    [S, H, dk, dv] -> [N, H, dv] fp32, zeros on padding rows."""
    rows, heads, dk = q_eff.shape
    dv = state.shape[-1]
    _check_dims(dk, dv)
    q_eff = _unit_last(q_eff)
    initial = state.float().contiguous()
    out = torch.zeros(rows, heads, dv, dtype=torch.float32, device=q_eff.device)
    chunks = layout.seq.shape[0]
    tiles = delta_rule_tiles(dk, dv)
    if rows and heads and chunks:
        _state_outputs_kernel[(chunks, heads, dv // tiles.block_v)](
            q_eff, initial, layout.chunk_row, layout.chunk_len, layout.seq, out,
            q_eff.stride(0), q_eff.stride(1), initial.stride(0), initial.stride(1),
            initial.stride(2), out.stride(0), out.stride(1),
            BT=CHUNK, DK=dk, BV=tiles.block_v, PREC=_precision(q_eff), num_warps=tiles.num_warps)
    return out


__all__ = ["triton_delta_rule", "triton_state_outputs", "delta_rule_tiles", "DeltaTiles"]

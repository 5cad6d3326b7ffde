"""Dense causal MLA prefill in Triton (DeepSeek-V3 / R1, Kimi-K2): the absorbed form of
``kernels/mla_torch.py`` over the paged latent rows ``[kv_latent | k_rope]``, with the contract
of ``mla_attention`` (an ``MLAArgs``), capturable on CUDA.

Each head's no-RoPE query goes into the latent space through its slice of ``kv_b_proj`` (W_UK,
one batched GEMM); the kernel then runs one-KV-head attention of those queries and their RoPE
parts over the latent rows, gathered through the page table, with an online softmax and each
row's causal limit read from ``q_limits``: no mask tensor, no key expanded to heads, no host
length. Its latent outputs go through W_UV (one batched GEMM) into the values. All heads share
the one KV row, so a program's query tile is BLOCK_T tokens x BLOCK_H heads of one sequence: the
heads read each latent block once. The grid is the dense paged kernel's (``triton_attention``):
sequence tiles found from a prefix sum over ``cu_seqlens_q``, then zero-filling tiles for the
padding rows, at most T // BLOCK_T + S + 1, each once per head block (consecutive programs). The
integer lengths are not specialised, so no batch compiles a new kernel.

Where the absorbed queries of every head would pass ``_CHUNK_BYTES``, heads run in chunks (static
per shape, so a graph holds them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphcp.kernels.mla_torch import MLAArgs
from graphcp.kernels.triton_attention import _load_rows, _tile_segment
from graphcp.kernels.triton_util import LOG2E, dot_mode, needs_int64

_CHUNK_BYTES = 1 << 30       # absorbed queries + latent outputs of one head chunk, at most


@triton.jit
def _latent_block(q_lat, q_rope, m_i, l_i, acc, start, hi, lim, pr_row, KV, c, r, c_ok, r_ok,
                  stride_kvs, stride_pp, qk_scale, LATENT: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                  DOT_F32: tl.constexpr, MASKED: tl.constexpr, PAD_C: tl.constexpr,
                  PAD_R: tl.constexpr, WIDE: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N); masked: row i sees [0, lim_i)."""
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos < hi
    if MASKED:
        page = tl.load(pr_row + (kpos // PAGE_SIZE) * stride_pp, mask=k_ok, other=0)
    else:
        page = tl.load(pr_row + (kpos // PAGE_SIZE) * stride_pp)
    page = page.to(tl.int64) if WIDE else page.to(tl.int32)
    base = KV + (page * PAGE_SIZE + (kpos % PAGE_SIZE))[:, None] * stride_kvs
    lat = _load_rows(base + c[None, :], k_ok, c_ok, MASKED, PAD_C)           # [N, C]
    rp = _load_rows(base + LATENT + r[None, :], k_ok, r_ok, MASKED, PAD_R)    # [N, R]
    if DOT_F32:
        lat, rp = lat.to(tl.float32), rp.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(lat), input_precision=PREC)
    s = (s + tl.dot(q_rope, tl.trans(rp), input_precision=PREC)) * qk_scale   # log2 domain
    if MASKED:
        s = tl.where(kpos[None, :] < lim[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(lat.dtype)                  # P@V in the cache dtype, as flash kernels do
    acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "S", "P", "heads", "stride_pr"])
def _mla_prefill_kernel(
    QL, QR, KV, CU, PR, LIM, OUT,
    stride_lt, stride_lh, stride_rt, stride_rh, stride_kvs, stride_ot, stride_oh,
    stride_pr, stride_pp,
    T, S, P, heads, head_blocks, qk_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, WIDE: tl.constexpr,
):
    # A tile's head blocks are consecutive programs: they run together and share its rows in L2.
    pid = tl.program_id(0) // head_blocks
    m = tl.arange(0, BLOCK_T * BLOCK_H)
    h = (tl.program_id(0) % head_blocks) * BLOCK_H + m % BLOCK_H   # row m: token m // BLOCK_H
    h_ok = h < heads
    h = h.to(tl.int64) if WIDE else h     # head-major latents: h * stride may pass 2**31
    t_off = m // BLOCK_H
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    c_ok = c < LATENT
    r_ok = r < ROPE

    seq, q_start, q_end, tile, pid, total_q, total_tiles = _tile_segment(CU, S, pid, BLOCK_T,
                                                                         BLOCK_S)
    if seq < S:
        rows = q_start + tile * BLOCK_T + t_off
        rows = rows.to(tl.int64) if WIDE else rows
        row_ok = (rows < q_end) & h_ok
        lim = tl.load(LIM + rows, mask=row_ok, other=0).to(tl.int32)
        lim = tl.where(row_ok, lim, 0)
        hi = tl.minimum(tl.max(lim, 0), P * PAGE_SIZE)
        q_lat = _load_rows(QL + rows[:, None] * stride_lt + h[:, None] * stride_lh + c[None, :],
                           row_ok, c_ok, True, BLOCK_C != LATENT)
        q_rope = _load_rows(QR + rows[:, None] * stride_rt + h[:, None] * stride_rh + r[None, :],
                            row_ok, r_ok, True, BLOCK_R != ROPE)
        if DOT_F32:
            q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
        m_i = tl.full([BLOCK_T * BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_C], dtype=tl.float32)
        pr_row = PR + seq * stride_pr
        # Key blocks below every live row's limit need no mask (most of a long causal row).
        lo = tl.min(tl.where(row_ok, lim, 2147483647), 0)
        full_end = (tl.minimum(lo, hi) // BLOCK_N) * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _latent_block(q_lat, q_rope, m_i, l_i, acc, start, hi, lim, pr_row, KV,
                                          c, r, c_ok, r_ok, stride_kvs, stride_pp, qk_scale,
                                          LATENT, PAGE_SIZE, BLOCK_N, PREC, DOT_F32, False,
                                          BLOCK_C != LATENT, BLOCK_R != ROPE, WIDE)
        for start in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _latent_block(q_lat, q_rope, m_i, l_i, acc, start, hi, lim, pr_row, KV,
                                          c, r, c_ok, r_ok, stride_kvs, stride_pp, qk_scale,
                                          LATENT, PAGE_SIZE, BLOCK_N, PREC, DOT_F32, True,
                                          BLOCK_C != LATENT, BLOCK_R != ROPE, WIDE)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(OUT + rows[:, None] * stride_ot + h[:, None] * stride_oh + c[None, :],
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])
    else:
        # Padding tail [cu_seqlens_q[-1], T): zeros. Programs past the last padding tile idle.
        pad_rows = total_q + (pid - total_tiles) * BLOCK_T + t_off
        pad_rows = pad_rows.to(tl.int64) if WIDE else pad_rows
        pad_ok = (pad_rows < T) & (pad_rows >= total_q) & h_ok
        zero = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_C], dtype=tl.float32)
        tl.store(OUT + pad_rows[:, None] * stride_ot + h[:, None] * stride_oh + c[None, :],
                 zero.to(OUT.dtype.element_ty), mask=pad_ok[:, None] & c_ok[None, :])


class MLATiles(NamedTuple):
    block_h: int
    block_t: int
    block_n: int
    num_warps: int
    num_stages: int


def mla_prefill_tiles(heads: int, dtype: torch.dtype, on_cuda: bool = True) -> MLATiles:
    """bf16/fp16: a query tile of 32 rows (BLOCK_T tokens x BLOCK_H heads, up to 32 heads) over 8
    warps, 32 keys a block: the [32, latent] fp32 accumulator and the latent queries fit in
    registers for latent 512 + rope 64 (64 rows would spill). fp32 runs its dots on the FMA units
    (operand rows whole per thread): 16 rows and 16 keys. No spills for sm_90a
    (``profiles/kernel_report.py``). The interpreter takes 16 x 16 tiles (less numpy work)."""
    fp32 = dtype == torch.float32
    rows = 32 if on_cuda and not fp32 else 16
    block_h = min(rows, triton.next_power_of_2(max(1, heads)))
    if not on_cuda:
        return MLATiles(block_h, rows // block_h, 16, 1, 1)
    return MLATiles(block_h, rows // block_h, 16 if fp32 else 32, 8, 2)


def triton_mla_prefill(args: MLAArgs, workspace: dict | None = None) -> torch.Tensor:
    """``mla_attention``'s contract (absorbed form, every group): q [T, H, nope + rope] over the
    paged rows -> ``args.out`` [T, H, value]; rows past the last sequence are zeros."""
    d, q, out = args.dims, args.q, args.out
    T, H, _ = q.shape
    S, P = args.page_rows.shape
    assert q.shape[2] == d.nope + d.rope and args.kv_pool.shape[-1] == d.latent + d.rope
    assert out.shape == (T, H, d.value) and args.cu_seqlens_q.shape[0] == S + 1
    page_size = args.page_size
    assert page_size >= 1 and page_size & (page_size - 1) == 0, f"page_size {page_size}"
    if T == 0:
        return out
    if S == 0:
        return out.zero_()
    w = args.kv_b.view(H, d.nope + d.value, d.latent)
    tiles = mla_prefill_tiles(H, q.dtype, q.device.type == "cuda")
    per_head = 2 * T * d.latent * q.element_size()
    chunk = max(tiles.block_h, _CHUNK_BYTES // per_head // tiles.block_h * tiles.block_h)
    dot_f32, prec = dot_mode(q)
    kv = args.kv_pool
    for h0 in range(0, H, chunk):
        hc = min(chunk, H - h0)
        q_part = q[:, h0:h0 + hc]
        # W_UK: [hc, T, nope] @ [hc, nope, latent] -> absorbed queries, head-major
        q_lat = torch.bmm(q_part[..., :d.nope].transpose(0, 1), w[h0:h0 + hc, :d.nope])
        o_lat = torch.empty_like(q_lat)
        q_rope = q_part[..., d.nope:]
        head_blocks = triton.cdiv(hc, tiles.block_h)
        grid = ((T // tiles.block_t + S + 1) * head_blocks,)
        _mla_prefill_kernel[grid](
            q_lat, q_rope, kv, args.cu_seqlens_q, args.page_rows, args.q_limits, o_lat,
            q_lat.stride(1), q_lat.stride(0), q_rope.stride(0), q_rope.stride(1), kv.stride(0),
            o_lat.stride(1), o_lat.stride(0), args.page_rows.stride(0), args.page_rows.stride(1),
            T, S, P, hc, head_blocks, float(args.scale) * LOG2E,
            LATENT=d.latent, ROPE=d.rope, PAGE_SIZE=page_size, BLOCK_H=tiles.block_h,
            BLOCK_T=tiles.block_t, BLOCK_C=max(16, triton.next_power_of_2(d.latent)),
            BLOCK_R=max(16, triton.next_power_of_2(d.rope)), BLOCK_N=tiles.block_n,
            BLOCK_S=max(16, triton.next_power_of_2(S)), PREC=prec, DOT_F32=dot_f32,
            WIDE=needs_int64(q_lat, q, kv, o_lat), num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
        # W_UV: [hc, T, latent] @ [hc, latent, value] -> this chunk's values
        values = torch.bmm(o_lat, w[h0:h0 + hc, d.nope:].transpose(1, 2))
        out[:, h0:h0 + hc] = values.transpose(0, 1)
    return out


__all__ = ["triton_mla_prefill", "mla_prefill_tiles"]

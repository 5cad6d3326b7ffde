"""Paged variable-length attention in Triton, with the contract of ``torch_paged_attention``.

Capturable design: the launch grid depends on tensor *shapes* only (the local token count T and
the number of sequences S), never on the batch's values. Every query tile belongs to exactly one
sequence: sequence s is cut into ceil(q_len_s / BLOCK_M) tiles and the rows past
``cu_seqlens_q[-1]`` (padding) into ceil(pad / BLOCK_M) zero-filling tiles. Summed over the S + 1
segments that is at most T // BLOCK_M + S + 1 tiles, which is the grid's second axis; surplus
programs exit without work. A program finds its segment from a prefix sum over ``cu_seqlens_q``
computed in the kernel, and bounds its key loop by the largest ``q_limits`` among its rows (key
blocks past every row's limit are skipped). A sliding window (``window`` W) also starts the loop at
the smallest row's limit - W; only the blocks no row sees whole are masked. Attention sinks add
each head's logit to the row's softmax denominator after the loop (once per row).

Grid axis 0 is the query head; GQA maps query head h to kv head h // (Hq // Hkv). K and V tiles are
gathered as [BLOCK_N, D] rows through the page table (the QK dot reads K transposed); offsets are
int32 unless a tensor spans 2**31 elements (WIDE), which keeps every tiling free of register spills
for sm_90a (``profiles/kernel_report.py``). Head dims that are not a power of two (80, 96, 192)
run in a tile padded to the next one (``block_d``), masked on the real ones.

The integer lengths (T, S, P, the window, the page table's row stride) are not specialised
(``do_not_specialize``): a batch of a new alignment never compiles a new kernel mid-serving.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphcp.kernels.registry import TRITON_HEAD_DIMS as HEAD_DIMS
from graphcp.kernels.triton_util import LOG2E, dot_mode, needs_int64


@triton.jit
def _load_rows(ptr, row_ok, d_ok, ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """A [rows, BLOCK_D] tile, masked on the rows (``ROWS``) and on the padded head dims
    (``PAD_D``) only where needed: power-of-two head dims load unmasked as before."""
    if ROWS:
        if PAD_D:
            x = tl.load(ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            x = tl.load(ptr, mask=row_ok[:, None], other=0.0)
    else:
        if PAD_D:
            x = tl.load(ptr, mask=d_ok[None, :], other=0.0)
        else:
            x = tl.load(ptr)
    return x


@triton.jit
def _tile_segment(CU, S, pid, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Which segment program ``pid`` serves (a sequence of ``cu_seqlens`` ``CU`` in tiles of BLOCK
    rows, or the padding tail): (seq, q_start, q_end, tile, pid, total_q, total_tiles), seq == S
    past the sequences. The last tiles go first: in causal rows they see the most keys, so the long
    work starts early."""
    s_idx = tl.arange(0, BLOCK_S)
    s_ok = s_idx < S
    starts = tl.load(CU + s_idx, mask=s_ok, other=0).to(tl.int32)
    ends = tl.load(CU + s_idx + 1, mask=s_ok, other=0).to(tl.int32)
    tiles = tl.where(s_ok, (ends - starts + BLOCK - 1) // BLOCK, 0)
    cum = tl.cumsum(tiles, 0)                              # inclusive tile counts per sequence
    total_q = tl.load(CU + S).to(tl.int32)                 # cu_seqlens_q[-1]
    total_tiles = tl.sum(tiles, 0)
    pid = tl.where(pid < total_tiles, total_tiles - 1 - pid, pid)
    seq = tl.sum((cum <= pid).to(tl.int32), 0)             # first s with cum[s] > pid (S: none)
    sel = s_idx == seq
    q_start = tl.sum(tl.where(sel, starts, 0), 0)
    q_end = tl.sum(tl.where(sel, ends, 0), 0)
    tile = pid - tl.sum(tl.where(sel, cum - tiles, 0), 0)
    return seq, q_start, q_end, tile, pid, total_q, total_tiles


@triton.jit
def _key_block(q, m_i, l_i, acc, start, hi, lim, low, pr_row, K_HEAD, V_HEAD, d, d_ok, stride_ks,
               stride_kd, stride_vs, stride_vd, stride_pp, qk_scale, PAGE_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
               MASKED: tl.constexpr, WINDOW: tl.constexpr, WIDE: tl.constexpr,
               PAD_D: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) of the row's pages; masked: each
    row sees keys [0, lim), or [low, lim) under a window."""
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos < hi                     # read only when MASKED
    if MASKED:
        page = tl.load(pr_row + (kpos // PAGE_SIZE) * stride_pp, mask=k_ok, other=0)
    else:
        page = tl.load(pr_row + (kpos // PAGE_SIZE) * stride_pp)
    page = page.to(tl.int64) if WIDE else page.to(tl.int32)
    slot = page * PAGE_SIZE + (kpos % PAGE_SIZE)
    # K and V as [BLOCK_N, D] rows (each key's D contiguous); the QK dot takes K transposed.
    k_ptr = K_HEAD + slot[:, None] * stride_ks + d[None, :] * stride_kd
    v_ptr = V_HEAD + slot[:, None] * stride_vs + d[None, :] * stride_vd
    k = _load_rows(k_ptr, k_ok, d_ok, MASKED, PAD_D)                      # [BLOCK_N, BLOCK_D]
    if DOT_F32:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale           # log2 domain
    if MASKED:
        seen = kpos[None, :] < lim[:, None]
        if WINDOW:
            seen = seen & (kpos[None, :] >= low[:, None])
        qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_ptr, k_ok, d_ok, MASKED, PAD_D)                      # [BLOCK_N, BLOCK_D]
    p = p.to(v.dtype)                    # P@V in the cache dtype, as flash kernels do
    if DOT_F32:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "S", "P", "window", "stride_pr"])
def _paged_attn_kernel(
    Q, KP, VP, CU, PR, LIM, OUT, SINKS,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_pr, stride_pp,
    T, S, P, qk_scale, window,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr, WIDE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    head = tl.program_id(0)      # heads vary fastest: programs sharing a kv head run together (L2)
    pid = tl.program_id(1)
    kv_head = head // GROUP

    seq, q_start, q_end, tile, pid, total_q, total_tiles = _tile_segment(CU, S, pid, BLOCK_M,
                                                                         BLOCK_S)

    d = tl.arange(0, BLOCK_D)            # the head dims padded to a power of two
    d_ok = d < HEAD_DIM
    PAD_D = BLOCK_D != HEAD_DIM          # masks on the head dims only where padded
    m_off = tl.arange(0, BLOCK_M)
    if seq < S:
        rows = q_start + tile * BLOCK_M + m_off
        rows = rows.to(tl.int64) if WIDE else rows          # WIDE: row * stride may pass 2**31
        row_ok = rows < q_end
        lim = tl.load(LIM + rows, mask=row_ok, other=0).to(tl.int32)
        lim = tl.where(row_ok, lim, 0)
        hi = tl.minimum(tl.max(lim, 0), P * PAGE_SIZE)

        q = _load_rows(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
                       row_ok, d_ok, True, PAD_D)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        pr_row = PR + seq * stride_pr
        k_head = KP + (kv_head.to(tl.int64) if WIDE else kv_head) * stride_kh
        v_head = VP + (kv_head.to(tl.int64) if WIDE else kv_head) * stride_vh
        # Key blocks below every live row's limit need no mask (most of a long causal row).
        lo = tl.min(tl.where(row_ok, lim, 2147483647), 0)
        full_start = 0
        full_end = (tl.minimum(lo, hi) // BLOCK_N) * BLOCK_N
        low = lim                        # read only under a window
        if HAS_WINDOW:
            # Each row sees keys [low, lim), low = lim - window: the loop starts at the smallest
            # low, and only blocks from the largest low on are seen whole by every row.
            low = tl.maximum(lim - window, 0)
            first = (tl.min(tl.where(row_ok, low, 2147483647), 0) // BLOCK_N) * BLOCK_N
            full_start = ((tl.max(tl.where(row_ok, low, 0), 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
            whole = full_end > full_start
            for start in range(first, tl.where(whole, full_start, hi), BLOCK_N):
                m_i, l_i, acc = _key_block(q, m_i, l_i, acc, start, hi, lim, low, pr_row, k_head,
                                           v_head, d, d_ok, stride_ks, stride_kd, stride_vs,
                                           stride_vd, stride_pp, qk_scale, PAGE_SIZE, BLOCK_N, PREC, DOT_F32,
                                           True, True, WIDE, PAD_D)
            full_start = tl.where(whole, full_start, hi)
            full_end = tl.where(whole, full_end, hi)
        for start in range(full_start, full_end, BLOCK_N):
            m_i, l_i, acc = _key_block(q, m_i, l_i, acc, start, hi, lim, low, pr_row, k_head,
                                       v_head, d, d_ok, stride_ks, stride_kd, stride_vs, stride_vd,
                                       stride_pp, qk_scale, PAGE_SIZE, BLOCK_N, PREC, DOT_F32,
                                       False, HAS_WINDOW, WIDE, PAD_D)
        for start in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _key_block(q, m_i, l_i, acc, start, hi, lim, low, pr_row, k_head,
                                       v_head, d, d_ok, stride_ks, stride_kd, stride_vs, stride_vd,
                                       stride_pp, qk_scale, PAGE_SIZE, BLOCK_N, PREC, DOT_F32,
                                       True, HAS_WINDOW, WIDE, PAD_D)
        if HAS_SINKS:       # the head's sink logit joins every row's denominator (log2 domain)
            sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.math.exp2(sink - m_new)
            acc = acc * alpha[:, None]
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(OUT + rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Padding tail [cu_seqlens_q[-1], T): zeros. Programs past the last padding tile idle.
        pad_rows = total_q + (pid - total_tiles) * BLOCK_M + m_off
        pad_rows = pad_rows.to(tl.int64) if WIDE else pad_rows
        pad_ok = (pad_rows < T) & (pad_rows >= total_q)
        zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        tl.store(OUT + pad_rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
                 zero.to(OUT.dtype.element_ty), mask=pad_ok[:, None] & d_ok[None, :])


class AttentionTiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def block_d(head_dim: int) -> int:
    """The head dims a tile holds: ``head_dim`` padded to a power of two (80 and 96 -> 128,
    192 -> 256); the padding is masked on loads and stores and adds zeros to every dot."""
    return max(16, triton.next_power_of_2(head_dim))


def attention_tiles(rows: int, head_dim: int, dtype: torch.dtype,
                    windowed: bool = False) -> AttentionTiles:
    """The CUDA tiling for ``rows`` local query rows: the batch's real (padded) row count eagerly,
    the bucket in a graph (which serves batches of more than half its rows), never a sequence
    capacity.
    Under 2048 rows, 64-row tiles: enough programs to fill the SMs and at most 63 idle rows per
    sequence; from 2048, 128 rows over 8 warps (two warpgroups) halve the K/V traffic per query row.
    fp32 runs its dots (IEEE, no TF32) on the FMA units, whose operand layouts hold a whole row of
    the reduced dimension per thread: 32 x 16 tiles over 8 warps are the largest that fit.
    A 256-wide tile (head_dim 192, 256) holds twice the accumulator per row: bf16/fp16 take
    ``TILES_256`` (32-key blocks, 8 warps at either row count; 64 rows over 4 warps would spill),
    fp32's FMA tiles fit as they are. ``windowed`` (a sliding window or sinks: a third, masked key
    loop) takes smaller tiles where the device's Triton 3.6 spilled the plain ones: fp32 16 x 16
    over 4 warps, 256-wide bf16/fp16 16-key blocks under 2048 rows. Every choice assembles without
    register spills for sm_90a under Triton 3.6 and 3.9 (``profiles/kernel_report.py``); the GPU
    sweep in ``profiles/gpu_check.py`` times them."""
    if dtype == torch.float32:
        return AttentionTiles(16, 16, 4, 2) if windowed else AttentionTiles(32, 16, 8, 2)
    if block_d(head_dim) > 128:
        if windowed and rows < 2048:
            return AttentionTiles(64, 16, 8, 2)
        return AttentionTiles(*TILES_256[rows >= 2048])
    if rows < 2048:
        return AttentionTiles(64, 64, 4, 3)
    return AttentionTiles(128, 64, 8, 3)


# (block_m, block_n, num_warps, num_stages) of 256-wide bf16/fp16 tiles: under 2048 rows, from it
TILES_256 = ((64, 32, 8, 2), (128, 32, 8, 2))


def triton_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor,
                           q_limits: torch.Tensor, page_size: int, scale: float, max_q: int,
                           max_kv: int, out: torch.Tensor, *, block_m: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, workspace: dict | None = None,
                           window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``torch_paged_attention``. ``max_q``/``max_kv`` are accepted for the shared
    signature but never needed: every length is read from device memory, so 0 ("unknown on the
    host") is fine and the launch is graph-capturable. ``block_m``/``block_n`` (powers of two >=
    16), ``num_warps`` and ``num_stages`` override the tiling."""
    T, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    assert D in HEAD_DIMS, f"triton_paged_attention supports head_dim {HEAD_DIMS}, got {D}"
    assert k_pool.shape[-1] == D and v_pool.shape[-1] == D and k_pool.shape[1] == v_pool.shape[1]
    assert Hq % Hkv == 0, f"query heads {Hq} not a multiple of kv heads {Hkv}"
    assert page_size >= 1 and page_size & (page_size - 1) == 0, \
        f"page_size must be a power of two, got {page_size}"
    assert out.shape == q.shape
    S, P = page_rows.shape
    assert cu_seqlens_q.shape[0] == S + 1
    if T == 0:
        return out
    # interpreter: small tiles keep numpy work low on short sequences
    windowed = window > 0 or sinks is not None
    bm, bn, warps, stages = (attention_tiles(T, D, q.dtype, windowed) if q.device.type == "cuda"
                             else AttentionTiles(16, 16, 1, 1))
    bm, bn = block_m or bm, block_n or bn
    warps, stages = num_warps or warps, num_stages or stages
    assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0
    if S == 0:
        return out.zero_()
    block_s = max(16, triton.next_power_of_2(S))
    dot_f32, prec = dot_mode(q)
    grid = (Hq, T // bm + S + 1)
    assert grid[1] <= 65535, f"{T} query rows need more than 65535 tiles of {bm}; raise block_m"
    assert sinks is None or sinks.shape == (Hq,), f"sinks must be [{Hq}] (one per query head)"
    _paged_attn_kernel[grid](
        q, k_pool, v_pool, cu_seqlens_q, page_rows, q_limits, out,
        sinks if sinks is not None else q,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        page_rows.stride(0), page_rows.stride(1),
        T, S, P, float(scale) * LOG2E, int(window),
        GROUP=Hq // Hkv, PAGE_SIZE=page_size, HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_S=block_s,
        PREC=prec, DOT_F32=dot_f32, WIDE=needs_int64(q, k_pool, v_pool, out),
        HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None, num_warps=warps,
        num_stages=stages,
    )
    return out


__all__ = ["triton_paged_attention", "attention_tiles", "block_d"]

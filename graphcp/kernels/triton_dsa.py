"""DSA kernels in Triton, with the contracts of ``kernels/dsa_torch.py``.

``indexer_scores``: one program per (query row, block of key positions) gathers the keys' cached
indexer rows through the row's slots and computes sum over heads of weight x ReLU(scale q.k) with
one [heads x Di] @ [Di x keys] dot; positions past the row's causal limit score -inf. The top-k over
the scores stays ``torch.topk``. ``sparse_mla``: one program per (query row, block of heads) runs an
online softmax over the row's selected cache rows, latent and RoPE parts as two dots, values the
latent part. Both gather keys as [keys, width] rows (each row contiguous) and read them transposed
in the dots; offsets are int32 unless a tensor spans 2**31 elements.
bf16/fp16 dots run on the tensor cores in the input dtype (P@V in the cache dtype, as flash kernels
do); fp32 dots use IEEE precision (no TF32), so fp32 results match the torch reference to rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcp.kernels import dsa_torch
from graphcp.kernels.triton_util import LOG2E, dot_mode, needs_int64


def row_chunk(keys: int, width: int) -> int:
    """Query rows per call. The kernels gather keys a tile at a time ([BLOCK_H, BLOCK_K] scores,
    [BLOCK_N, width] rows): what a call materialises is [rows, keys] (the fp32 scores and their
    top-k, or the visibility mask), so a chunk holds CHUNK_ELEMENTS // keys rows whatever the width
    (512 rows at 32K keys, where the torch form takes 4)."""
    return max(1, dsa_torch.CHUNK_ELEMENTS // keys)


# Key counts (and strides equal to them) follow the batch: never specialized on their value.
@triton.jit(do_not_specialize=["num_keys", "stride_sb", "stride_ob"])
def _indexer_kernel(Q, W, KEYS, SLOTS, ROW_SEQ, LIMITS, OUT, heads, dim, num_keys, scale,
                    stride_qb, stride_qh, stride_wb, stride_ks, stride_sb, stride_ob,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREC: tl.constexpr, DOT_F32: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    in_keys = pos < num_keys
    row = row.to(tl.int64) if WIDE else row
    q = tl.load(Q + row * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=(h[:, None] < heads) & (d[None, :] < dim), other=0.0)
    seq = tl.load(ROW_SEQ + row)
    seq = seq.to(tl.int64) if WIDE else seq.to(tl.int32)
    slot = tl.load(SLOTS + seq * stride_sb + pos, mask=in_keys, other=0)
    slot = slot.to(tl.int64) if WIDE else slot.to(tl.int32)
    k = tl.load(KEYS + slot[:, None] * stride_ks + d[None, :],
                mask=in_keys[:, None] & (d[None, :] < dim), other=0.0)              # [K, D]
    if DOT_F32:
        q, k = q.to(tl.float32), k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale                        # [H, K]
    w = tl.load(W + row * stride_wb + h, mask=h < heads, other=0.0)
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
    limit = tl.load(LIMITS + row)
    score = tl.where(pos < limit, score, float("-inf"))
    tl.store(OUT + row * stride_ob + pos, score, mask=in_keys)


def indexer_tiles(heads: int, dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_D, BLOCK_K, num_warps): every head and the whole key width in one tile, over
    128 keys a program (the row's queries load once per 128 keys), 8 warps. fp32 dots run on the
    FMA units, whose operand layouts hold a whole key row per thread: 32 keys a program, 16 from 64
    heads (V3.2's 64 index heads spilled 236 bytes at 32 under the device's Triton 3.6)."""
    block_h = max(16, triton.next_power_of_2(heads))
    fp32_keys = 16 if block_h >= 64 else 32
    return (block_h, max(16, triton.next_power_of_2(dim)),
            fp32_keys if dtype == torch.float32 else 128, 8)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                   seq_slots: torch.Tensor, row_seq: torch.Tensor,
                   limits: torch.Tensor) -> torch.Tensor:
    """q [B, Hi, Di], weights [B, Hi] fp32, index_keys [slots, Di], seq_slots [S, K], row_seq [B],
    limits [B] -> scores [B, K] fp32 (-inf past each row's limit)."""
    rows, heads, dim = q.shape
    num_keys = seq_slots.shape[1]
    out = torch.empty(rows, num_keys, dtype=torch.float32, device=q.device)
    q, weights, slots = q.contiguous(), weights.float().contiguous(), seq_slots.contiguous()
    block_h, block_d, block_k, warps = indexer_tiles(heads, dim, q.dtype)
    grid = (rows, triton.cdiv(num_keys, block_k))
    dot_f32, prec = dot_mode(q)
    _indexer_kernel[grid](q, weights, index_keys, slots, row_seq.contiguous(), limits.contiguous(),
                          out, heads, dim,
                          num_keys, dim ** -0.5, q.stride(0), q.stride(1), weights.stride(0),
                          index_keys.stride(0), slots.stride(0), out.stride(0),
                          BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_K=block_k, PREC=prec,
                          DOT_F32=dot_f32, WIDE=needs_int64(q, index_keys, slots, out),
                          num_warps=warps)
    return out


@triton.jit(do_not_specialize=["num_sel", "stride_sb", "stride_vb"])
def _sparse_mla_kernel(Q, KV, SEL, VIS, OUT, heads, latent, rope, num_sel, head_blocks, scale,
                       stride_qb, stride_qh, stride_kvs, stride_sb, stride_vb, stride_ob, stride_oh,
                       BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
                       WIDE: tl.constexpr):
    # A row's head blocks are consecutive programs: they run together and share its rows in L2.
    row = tl.program_id(0) // head_blocks
    h = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    h_ok = h < heads
    row = row.to(tl.int64) if WIDE else row
    q_row = Q + row * stride_qb + h[:, None] * stride_qh
    q_lat = tl.load(q_row + c[None, :], mask=h_ok[:, None] & (c[None, :] < latent), other=0.0)
    q_rope = tl.load(q_row + latent + r[None, :], mask=h_ok[:, None] & (r[None, :] < rope),
                     other=0.0)
    if DOT_F32:
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for start in range(0, num_sel, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < num_sel
        slot = tl.load(SEL + row * stride_sb + n, mask=n_ok, other=0)
        slot = slot.to(tl.int64) if WIDE else slot.to(tl.int32)
        visible = tl.load(VIS + row * stride_vb + n, mask=n_ok, other=0) != 0
        base = KV + slot[:, None] * stride_kvs
        lat = tl.load(base + c[None, :], mask=n_ok[:, None] & (c[None, :] < latent), other=0.0)
        rp = tl.load(base + latent + r[None, :], mask=n_ok[:, None] & (r[None, :] < rope),
                     other=0.0)                                                     # [N, C], [N, R]
        if DOT_F32:
            lat, rp = lat.to(tl.float32), rp.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=PREC)
        s = (s + tl.dot(q_rope, tl.trans(rp), input_precision=PREC)) * scale         # [H, N], log2
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no visible key yet: nothing to add
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(KV.dtype.element_ty)        # P@V in the cache dtype, as flash kernels do
        if DOT_F32:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + row * stride_ob + h[:, None] * stride_oh + c[None, :], out,
             mask=h_ok[:, None] & (c[None, :] < latent))


def mla_tiles(heads: int, latent: int, rope: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_H, BLOCK_C, BLOCK_R, BLOCK_N, num_warps, num_stages) of the sparse MLA kernel: the
    whole latent row [BLOCK_H, latent] accumulates in registers, so heads go 16 to a program over 4
    warps, or 32 over 8 (a row's head blocks run side by side and share its selected rows in L2).
    64 heads would spill for sm_90a even over 8 warps (``profiles/kernel_report.py``)."""
    block_h = 16 if heads <= 16 else 32
    return (block_h, max(16, triton.next_power_of_2(latent)), max(16, triton.next_power_of_2(rope)),
            16, 4 if block_h == 16 else 8, 3)


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, selected_slots: torch.Tensor,
               visible: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """q [B, H, latent + rope], kv [slots, latent + rope], selected_slots / visible [B, k]
    -> [B, H, latent] (zeros on a row without a visible key)."""
    rows, heads, width = q.shape
    num_sel = selected_slots.shape[1]
    out = torch.empty(rows, heads, latent_dim, dtype=q.dtype, device=q.device)
    q, sel = q.contiguous(), selected_slots.contiguous()
    vis = visible.to(torch.int8).contiguous()
    rope = width - latent_dim
    block_h, block_c, block_r, block_n, warps, stages = mla_tiles(heads, latent_dim, rope)
    head_blocks = triton.cdiv(heads, block_h)
    dot_f32, prec = dot_mode(q)
    _sparse_mla_kernel[(rows * head_blocks,)](
        q, kv, sel, vis, out, heads, latent_dim, rope, num_sel, head_blocks,
        scale * LOG2E, q.stride(0), q.stride(1), kv.stride(0), sel.stride(0), vis.stride(0),
        out.stride(0), out.stride(1), BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_R=block_r,
        BLOCK_N=block_n, PREC=prec, DOT_F32=dot_f32, WIDE=needs_int64(q, kv, sel, out),
        num_warps=warps, num_stages=stages)
    return out

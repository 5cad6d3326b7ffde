"""The launches ``kernel_report.py`` compiles: per family, every tile configuration the kernels' own
tile-choice functions pick over the default CUDA bucket ladder and the model shapes graphcp serves,
with the arguments the launch wrappers pass at those shapes (tensors as Triton's ``MockTensor``).

Each family is a generator of ``(config, jit_function, args, options)``; ``config`` names the tiles
and the shape class it was chosen for (duplicates are dropped by the report).
"""
from __future__ import annotations

import itertools
from typing import Iterator

import torch

from graphcp.graph.runner import DEFAULT_BUCKETS
from graphcp.kernels import (
    triton_attention,
    triton_delta_rule,
    triton_dsa,
    triton_fp8_gemm,
    triton_kv_write,
    triton_mla,
    triton_moe,
    triton_rmsnorm,
    triton_rope,
)

LADDER = DEFAULT_BUCKETS["cuda"]
EAGER_ROWS = (16384, 65536)           # eager batches past the largest bucket
ROWS = LADDER + EAGER_ROWS
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (64, 128)
# head dims of the families' full attention: Phi-style 80/96, MLA's expanded 192, Qwen3-Next's 256
ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
KV_HEADS = (1, 2, 4, 8, 16)           # KV heads per rank after tensor parallelism
PAGE_SIZE, REQUESTS, CONTEXT = 16, 8, 131072      # defaults: --page-size, --max-batch-requests
I64 = torch.int64
Case = tuple[dict, object, dict, dict]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention(mock) -> Iterator[Case]:
    fn = triton_attention._paged_attn_kernel
    hq, hkv, seqs, pages = 32, 8, 2 * REQUESTS, CONTEXT // PAGE_SIZE   # zigzag: 2 blocks a request
    # sinks: gpt-oss's layers (sink logits, a 128-token window); else a full causal layer
    for dtype, d, rows, wide, sinks in itertools.product(DTYPES, ATTENTION_HEAD_DIMS, ROWS,
                                                         (False, True), (False, True)):
        t = triton_attention.attention_tiles(rows, d, dtype, windowed=sinks)
        x = mock(dtype)
        args = dict(Q=x, KP=x, VP=x, CU=mock(I64), PR=mock(I64), LIM=mock(I64), OUT=x,
                    SINKS=mock(torch.float32) if sinks else x, window=128 if sinks else 0,
                    HAS_WINDOW=sinks, HAS_SINKS=sinks,
                    stride_qt=hq * d, stride_qh=d, stride_qd=1, stride_ks=hkv * d, stride_kh=d,
                    stride_kd=1, stride_vs=hkv * d, stride_vh=d, stride_vd=1, stride_ot=hq * d,
                    stride_oh=d, stride_od=1, stride_pr=pages, stride_pp=1, T=rows, S=seqs, P=pages,
                    qk_scale=0.1, GROUP=hq // hkv, PAGE_SIZE=PAGE_SIZE, HEAD_DIM=d,
                    BLOCK_D=triton_attention.block_d(d),
                    BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_S=max(16, seqs),
                    PREC="ieee" if dtype == torch.float32 else None, DOT_F32=False, WIDE=wide)
        # wide: int64 offsets, taken where the pool or the queries span 2**31 elements
        yield ({"dtype": _name(dtype), "head_dim": d, **t._asdict(), "wide": wide, "sinks": sinks},
               fn, args,
               {"num_warps": t.num_warps, "num_stages": t.num_stages})


def kv_write(mock) -> Iterator[Case]:
    fn = triton_kv_write._kv_write_kernel
    for dtype, d, h in itertools.product((torch.bfloat16, torch.float32), HEAD_DIMS, KV_HEADS):
        t = triton_kv_write.kv_write_tiles(h, d)
        x = mock(dtype)
        args = dict(KP=x, VP=x, SLOTS=mock(I64), K=x, V=x, stride_kps=h * d, stride_kph=d,
                    stride_kpd=1, stride_vps=h * d, stride_vph=d, stride_vpd=1, stride_kn=2 * h * d,
                    stride_kh=d, stride_kd=1, stride_vn=2 * h * d, stride_vh=d, stride_vd=1, N=4096,
                    HEAD_DIM=d, NUM_HEADS=h, BLOCK_R=t.block_r, BLOCK_E=t.block_e)
        yield {"dtype": _name(dtype), **t._asdict()}, fn, args, {"num_warps": t.num_warps}


# (N, K) of the FP8 linears: a 7B-class dense layer and DeepSeek-V3's MoE-free projections.
FP8_SHAPES = ((4096, 4096), (2 * 11008, 4096), (4096, 11008), (7168, 2048), (24576, 1536))
FP8_BLOCK_KS = (64, 128, 256)         # K blocks: the real format's 128, and its neighbours


def fp8_gemm(mock) -> Iterator[Case]:
    quant, gemm = triton_fp8_gemm._act_quant_kernel, triton_fp8_gemm._fp8_gemm_kernel
    fp8, f32 = mock(torch.float8_e4m3fn), mock(torch.float32)
    for dtype, bk, (n, k), m in itertools.product((torch.bfloat16, torch.float32), FP8_BLOCK_KS,
                                                  FP8_SHAPES, ROWS):
        x = mock(dtype)
        block_m, warps = triton_fp8_gemm.quant_tiles(bk)
        args = dict(X=x, XQ=fp8, XS=f32, M=m, K=k, k_offset=0, stride_x=k, stride_xq=k, stride_xs=m,
                    fp8_max=448.0, BLOCK_M=block_m, BLOCK_K=bk)
        config = {"dtype": _name(dtype), "block_m": block_m, "block_k": bk, "num_warps": warps}
        yield config, quant, args, {"num_warps": warps}
        t = triton_fp8_gemm.gemm_tiles(m)
        for wide in (False, True):
            args = dict(XQ=fp8, XS=f32, W=fp8, WS=f32, WROWS=mock(I64), B=x, Y=x, M=m, N=n, K=k,
                        k_offset=0, num_kb=k // bk, stride_xq=k, stride_xs=m, stride_w=k,
                        stride_ws=k // bk, stride_y=n, HAS_BIAS=False, BLOCK_M=t[0], BLOCK_N=t[1],
                        BLOCK_K=bk, WIDE=wide)
            config = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), t))
            yield ({"dtype": _name(dtype), "block_k": bk, **config, "wide": wide}, gemm, args,
                   {"num_warps": t[2], "num_stages": t[3]})


# (hidden, moe_intermediate, experts, top-k): Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3.
MOE_SHAPES = ((2048, 768, 128, 8), (4096, 1536, 128, 8), (7168, 2048, 256, 8))


def moe(mock) -> Iterator[Case]:
    fn = triton_moe._grouped_gemm_kernel
    for dtype, (hidden, inter, experts, topk), rows, wide in itertools.product(
            (torch.bfloat16, torch.float32), MOE_SHAPES, ROWS, (False, True)):
        x = mock(dtype)
        block_m = triton_moe.moe_row_tile(rows * topk / experts)
        for n, k in ((2 * inter, hidden), (hidden, inter)):            # gate_up, then down
            t = triton_moe.moe_tiles(n, k)
            args = dict(A=x, ROWS=mock(I64), W=x, B=x, OUT=x, TILE_EXPERT=mock(I64), K=k, N=n,
                        stride_am=k, stride_we=n * k, stride_wn=k, stride_wk=1, stride_be=0,
                        stride_om=n, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=t[0], BLOCK_K=t[1],
                        PREC="ieee" if dtype == torch.float32 else "tf32", WIDE=wide)
            config = dict(zip(("block_n", "block_k", "num_warps", "num_stages"), t))
            yield ({"dtype": _name(dtype), "block_m": block_m, **config, "wide": wide}, fn, args,
                   {"num_warps": t[2], "num_stages": t[3]})


FP8_MOE_BLOCK = (128, 128)            # the released FP8 checkpoints' weight_block_size
EXPERT_TP = (1, 8)                    # down's K: the whole intermediate, or an 8-way slice


def moe_fp8(mock) -> Iterator[Case]:
    fn = triton_moe._fp8_grouped_gemm_kernel
    fp8, f32, bk = mock(torch.float8_e4m3fn), mock(torch.float32), FP8_MOE_BLOCK[1]
    for dtype, (hidden, inter, experts, topk), rows, etp, wide in itertools.product(
            (torch.bfloat16, torch.float32), MOE_SHAPES, ROWS, EXPERT_TP, (False, True)):
        block_m = triton_moe.moe_row_tile(rows * topk / experts)
        sliced = inter // etp
        offset = sliced % bk               # expert-TP rank 1's slice starts this far into a block
        cap = -(-(rows * topk + experts * (block_m - 1)) // block_m) * block_m   # sorted rows
        # gate_up reads the tokens, down the sorted rows' gated activations
        for proj, n, k, k_offset, a_rows in (("gate_up", 2 * sliced, hidden, 0, rows),
                                             ("down", hidden, sliced, offset, cap)):
            t = triton_moe.moe_fp8_tiles(block_m)
            kb = -(-(k + k_offset) // bk)
            args = dict(XQ=fp8, XS=f32, ROWS=mock(I64), W=fp8, WS=f32, WROWS=mock(torch.int32),
                        B=mock(dtype), OUT=mock(dtype), TILE_EXPERT=mock(I64), N=n, K=k,
                        k_offset=k_offset, num_kb=kb, stride_xq=kb * bk, stride_xs=a_rows,
                        stride_we=n * k, stride_wn=k, stride_se=-(-n // bk) * kb, stride_sr=kb,
                        stride_be=0, stride_om=n, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=t[0], BLOCK_K=bk, WIDE=wide)
            config = dict(zip(("block_n", "num_warps", "num_stages"), t))
            yield ({"dtype": _name(dtype), "proj": proj, "k_offset": k_offset,
                    "block_m": block_m, **config, "wide": wide}, fn, args,
                   {"num_warps": t[1], "num_stages": t[2]})


# -- MoE gating (issue 39): the gating launch between the projections (SiLU, V4's and gpt-oss's
# clamps) and the grouped GEMMs' per-expert bias epilogue (gpt-oss), plain and FP8.
# (hidden, moe_intermediate, experts, top-k): DeepSeek-V4-Flash, gpt-oss-120b and -20b.
GATED_MOE_SHAPES = ((4096, 2048, 256, 6), (2880, 2880, 128, 4), (2880, 2880, 32, 4))


def moe_gated(mock) -> Iterator[Case]:
    gating = triton_moe._gated_activation_kernel
    for dtype, (_, inter, _, _), etp, clamp, wide in itertools.product(
            (torch.bfloat16, torch.float32), GATED_MOE_SHAPES + MOE_SHAPES, EXPERT_TP,
            (False, True), (False, True)):
        sliced = inter // etp
        block, warps = triton_moe.activation_tiles(sliced)
        x = mock(dtype)
        args = dict(H=x, OUT=x, TILE_EXPERT=mock(I64), inter=sliced, stride_h=2 * sliced,
                    stride_o=sliced, limit=10.0, alpha=1.702, up_shift=1.0, CLAMP=clamp,
                    BLOCK_M=16, BLOCK=block, WIDE=wide)
        yield ({"dtype": _name(dtype), "block": block, "num_warps": warps, "clamp": clamp,
                "wide": wide}, gating, args, {"num_warps": warps})
    plain, fp8_fn = triton_moe._grouped_gemm_kernel, triton_moe._fp8_grouped_gemm_kernel
    fp8, f32, bk = mock(torch.float8_e4m3fn), mock(torch.float32), FP8_MOE_BLOCK[1]
    for dtype, (hidden, inter, experts, topk), rows in itertools.product(
            (torch.bfloat16, torch.float32), GATED_MOE_SHAPES, ROWS):
        x = mock(dtype)
        block_m = triton_moe.moe_row_tile(rows * topk / experts)
        for n, k in ((2 * inter, hidden), (hidden, inter)):            # gate_up, then down
            t = triton_moe.moe_tiles(n, k)
            args = dict(A=x, ROWS=mock(I64), W=x, B=x, OUT=x, TILE_EXPERT=mock(I64), K=k, N=n,
                        stride_am=k, stride_we=n * k, stride_wn=k, stride_wk=1, stride_be=n,
                        stride_om=n, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=t[0], BLOCK_K=t[1],
                        PREC="ieee" if dtype == torch.float32 else "tf32", WIDE=False)
            config = dict(zip(("block_n", "block_k", "num_warps", "num_stages"), t))
            yield ({"dtype": _name(dtype), "bias": True, "block_m": block_m, **config}, plain,
                   args, {"num_warps": t[2], "num_stages": t[3]})
            t = triton_moe.moe_fp8_tiles(block_m)
            kb = -(-k // bk)
            args = dict(XQ=fp8, XS=f32, ROWS=mock(I64), W=fp8, WS=f32, WROWS=mock(torch.int32),
                        B=x, OUT=x, TILE_EXPERT=mock(I64), N=n, K=k, k_offset=0, num_kb=kb,
                        stride_xq=kb * bk, stride_xs=rows, stride_we=n * k, stride_wn=k,
                        stride_se=-(-n // bk) * kb, stride_sr=kb, stride_be=n, stride_om=n,
                        HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=t[0], BLOCK_K=bk, WIDE=False)
            config = dict(zip(("block_n", "num_warps", "num_stages"), t))
            yield ({"dtype": _name(dtype), "bias": True, "block_m": block_m, **config}, fp8_fn,
                   args, {"num_warps": t[1], "num_stages": t[2]})


DSA_INDEX = ((32, 128), (64, 128))    # (indexer heads, index_head_dim): GLM-5, DeepSeek-V3.2
MLA_HEADS = (8, 16, 32, 64, 128)      # query heads per rank; latent 512 + rope 64 (width 576)
LATENT, ROPE, TOPK = 512, 64, 2048


def dsa_index(mock) -> Iterator[Case]:
    fn = triton_dsa._indexer_kernel
    keys = CONTEXT
    for dtype, (heads, dim), wide in itertools.product((torch.bfloat16, torch.float32), DSA_INDEX,
                                                  (False, True)):
        t = triton_dsa.indexer_tiles(heads, dim, dtype)
        args = dict(Q=mock(dtype), W=mock(torch.float32), KEYS=mock(dtype), SLOTS=mock(I64),
                    ROW_SEQ=mock(I64), LIMITS=mock(I64), OUT=mock(torch.float32), heads=heads,
                    dim=dim, num_keys=keys, scale=dim ** -0.5, stride_qb=heads * dim, stride_qh=dim,
                    stride_wb=heads, stride_ks=dim, stride_sb=keys, stride_ob=keys,
                    BLOCK_H=t[0], BLOCK_D=t[1], BLOCK_K=t[2],
                    PREC="ieee" if dtype == torch.float32 else None, DOT_F32=False, WIDE=wide)
        config = dict(zip(("block_h", "block_d", "block_k", "num_warps"), t))
        yield ({"dtype": _name(dtype), "heads": heads, **config, "wide": wide}, fn, args,
               {"num_warps": t[3]})


def dsa_mla(mock) -> Iterator[Case]:
    fn = triton_dsa._sparse_mla_kernel
    width = LATENT + ROPE
    for dtype, heads, wide in itertools.product((torch.bfloat16, torch.float32), MLA_HEADS,
                                            (False, True)):
        t = triton_dsa.mla_tiles(heads, LATENT, ROPE)
        x = mock(dtype)
        args = dict(Q=x, KV=x, SEL=mock(I64), VIS=mock(torch.int8), OUT=x, heads=heads,
                    latent=LATENT, rope=ROPE, num_sel=TOPK, head_blocks=-(-heads // t[0]),
                    scale=width ** -0.5,
                    stride_qb=heads * width, stride_qh=width, stride_kvs=width, stride_sb=TOPK,
                    stride_vb=TOPK, stride_ob=heads * LATENT, stride_oh=LATENT,
                    BLOCK_H=t[0], BLOCK_C=t[1], BLOCK_R=t[2], BLOCK_N=t[3],
                    PREC="ieee" if dtype == torch.float32 else None, DOT_F32=False, WIDE=wide)
        names = ("block_h", "block_c", "block_r", "block_n", "num_warps", "num_stages")
        config = dict(zip(names, t))
        yield ({"dtype": _name(dtype), **config, "wide": wide}, fn, args,
               {"num_warps": t[4], "num_stages": t[5]})


def mla_prefill(mock) -> Iterator[Case]:
    """Dense MLA prefill (DeepSeek-V3 / Kimi-K2) at every rank's head count: absorbed queries
    head-major [H, T, latent], their RoPE parts strided in q [T, H, nope + rope]."""
    fn = triton_mla._mla_prefill_kernel
    seqs, pages, nope = 2 * REQUESTS, CONTEXT // PAGE_SIZE, 128
    for dtype, heads, rows, wide in itertools.product((torch.bfloat16, torch.float32), MLA_HEADS,
                                                      ROWS, (False, True)):
        t = triton_mla.mla_prefill_tiles(heads, dtype)
        x = mock(dtype)
        args = dict(QL=x, QR=x, KV=x, CU=mock(I64), PR=mock(I64), LIM=mock(I64), OUT=x,
                    stride_lt=LATENT, stride_lh=rows * LATENT, stride_rt=heads * (nope + ROPE),
                    stride_rh=nope + ROPE, stride_kvs=LATENT + ROPE, stride_ot=LATENT,
                    stride_oh=rows * LATENT, stride_pr=pages, stride_pp=1, T=rows, S=seqs,
                    P=pages, heads=heads, head_blocks=-(-heads // t.block_h), qk_scale=0.1, LATENT=LATENT, ROPE=ROPE,
                    PAGE_SIZE=PAGE_SIZE, BLOCK_H=t.block_h, BLOCK_T=t.block_t, BLOCK_C=LATENT,
                    BLOCK_R=ROPE, BLOCK_N=t.block_n, BLOCK_S=max(16, seqs),
                    PREC="ieee" if dtype == torch.float32 else None, DOT_F32=False, WIDE=wide)
        yield ({"dtype": _name(dtype), **t._asdict(), "wide": wide}, fn, args,
               {"num_warps": t.num_warps, "num_stages": t.num_stages})


# Normalised widths: q/k norms (head dims), MLA's kv / q LoRA norms, hidden sizes.
NORM_WIDTHS = (64, 128, 512, 1536, 2048, 4096, 5120, 7168, 8192)


def rmsnorm(mock) -> Iterator[Case]:
    fn = triton_rmsnorm._rmsnorm_kernel
    for dtype, n, add in itertools.product((torch.bfloat16, torch.float32), NORM_WIDTHS,
                                           (False, True)):
        block, warps = triton_rmsnorm.rmsnorm_tiles(n)
        x = mock(dtype)
        args = dict(X=x, R=x, W=x, Y=x, S=x, stride_xt=n, stride_xh=n, stride_rt=n, stride_yt=n,
                    stride_yh=n, stride_st=n, N=n, eps=1e-6, BLOCK=block, ADD=add)
        config = {"dtype": _name(dtype), "block": block, "num_warps": warps, "add": add}
        yield config, fn, args, {"num_warps": warps}


ROPE_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def rope(mock) -> Iterator[Case]:
    fn = triton_rope._rope_kernel
    for dtype, d, h in itertools.product((torch.bfloat16, torch.float32), HEAD_DIMS, ROPE_HEADS):
        block_h, block_d, warps = triton_rope.rope_tiles(h, d)
        x = mock(dtype)
        args = dict(X=x, COS=x, SIN=x, Y=x, stride_xt=3 * h * d, stride_xh=d, stride_yt=h * d,
                    stride_yh=d, stride_ct=d, H=h, HALF=d // 2, BLOCK_D=block_d, BLOCK_H=block_h)
        config = {"dtype": _name(dtype), "block_h": block_h, "block_d": block_d, "num_warps": warps}
        yield config, fn, args, {"num_warps": warps}


# Gated DeltaNet (Qwen3-Next / Qwen3.5): key and value head dims 128, 64-step chunks, TF32 dots (the
# Triton rule serves 16-bit models); value width dv, or dv + dk for the CP hand-off's
# identity-augmented pass (``block_transition``). No launch argument depends on the batch.
# (dk, dv): the released models', then the tiny test checkpoints' (a GPU check's engine case).
DELTA_HEADS, DELTA_DIMS = 32, ((128, 128), (16, 16))


def delta_rule(mock) -> Iterator[Case]:
    f32, heads, chunk = mock(torch.float32), DELTA_HEADS, triton_delta_rule.CHUNK
    for dtype, (dk, dv_model), augmented in itertools.product(
            (torch.bfloat16, torch.float16), DELTA_DIMS, (False, True)):
        dv = dv_model + dk if augmented else dv_model
        t = triton_delta_rule.delta_rule_tiles(dk, dv)
        conv = 2 * heads * dk + heads * dv         # v: a column slice of the conv output's rows
        config = {"dtype": _name(dtype), "dk": dk, "dv": dv}
        yield (config | {"block_v": t.wy_block_v, "num_warps": t.wy_warps},
               triton_delta_rule._wy_kernel,
               dict(Q=f32, K=f32, V=mock(dtype), G=f32, BETA=mock(dtype), CHUNK_ROW=mock(I64),
                    CHUNK_LEN=mock(I64), W=f32, U=f32, GC=f32, AQK=f32, stride_qn=heads * dk,
                    stride_qh=dk, stride_kn=heads * dk, stride_kh=dk, stride_vn=conv,
                    stride_vh=dv, stride_gn=heads, stride_gh=1, stride_bn=heads, stride_bh=1,
                    heads=heads, scale=dk ** -0.5, BT=chunk, DK=dk, DV=dv, BV=t.wy_block_v,
                    PREC="tf32"), {"num_warps": t.wy_warps})
        sizes = dict(BT=chunk, DK=dk, BV=t.block_v, PREC="tf32")
        config |= {"block_v": t.block_v, "num_warps": t.num_warps, "num_stages": t.num_stages}
        yield (config, triton_delta_rule._state_kernel,
               dict(Q=f32, K=f32, W=f32, U=f32, GC=f32, AQK=f32, STARTS=mock(I64),
                    LENS=mock(I64), S0=f32, OUT=f32, SN=f32, stride_qn=heads * dk, stride_qh=dk,
                    stride_kn=heads * dk, stride_kh=dk, stride_on=heads * dv, stride_oh=dv,
                    stride_ss=heads * dk * dv, stride_sh=dk * dv, stride_sk=dv, heads=heads,
                    scale=dk ** -0.5, DV=dv, **sizes),
               {"num_warps": t.num_warps, "num_stages": t.num_stages})
        if not augmented:               # the CP hand-off's correction: q_eff, fp32 rows of width
            yield (config | {"dtype": "float32"}, triton_delta_rule._state_outputs_kernel,
                   dict(QE=f32, S0=f32, CHUNK_ROW=mock(I64), CHUNK_LEN=mock(I64),  # dv + dk
                        CHUNK_SEQ=mock(I64), OUT=f32, stride_qn=heads * (dv + dk),
                        stride_qh=dv + dk, stride_ss=heads * dk * dv, stride_sh=dk * dv,
                        stride_sk=dv, stride_on=heads * dv, stride_oh=dv, **sizes),
                   {"num_warps": t.num_warps})

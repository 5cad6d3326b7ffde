"""The MoE experts on CUDA: rows sorted by expert, then one grouped-GEMM launch per projection for
all experts, instead of a Python loop over experts (the torch forms in ``moe_torch.py``, which are
these kernels' oracles). Plain weights run ``grouped_gemm``; FP8 experts as loaded run
``fp8_grouped_gemm`` (block-scaled, activations quantized per token and K group).

Every step is a device tensor op whose shape is fixed by the row count, so the whole path can be
captured in a CUDA graph: each expert's rows are padded to a multiple of the row tile BLOCK_M
(capacity ``pairs + experts x (BLOCK_M - 1)``; BLOCK_M follows the pairs per expert, a shape), so
every tile belongs to one expert; tiles past the last expert (all padding) write zeros and return
before reading a weight. Between the projections one launch applies the experts' gating
(``moe_torch.GatedActivation``: SiLU, V4's and gpt-oss's clamped SwiGLU), and per-expert biases
(gpt-oss) are added in the GEMMs' epilogue, so every family's experts compute only their routed
(row, expert) pairs.

Integer arguments that follow the batch (row counts, and strides equal to them) are not specialized
(``do_not_specialize``): a new batch size never compiles a kernel. Widths fixed by the model (N, K)
keep Triton's divisibility hints, which vectorize the K loads; they compile once, at warmup.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from graphcp.kernels.fp8_types import Fp8Experts
from graphcp.kernels.moe_torch import NO_BIASES, SILU, Biases, GatedActivation
from graphcp.kernels.triton_fp8_gemm import quantize_activations_triton
from graphcp.kernels.triton_util import needs_int64


@triton.jit
def _grouped_gemm_kernel(A, ROWS, W, B, OUT, TILE_EXPERT, K, N, stride_am, stride_we, stride_wn,
                         stride_wk, stride_be, stride_om, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PREC: tl.constexpr, WIDE: tl.constexpr):
    """OUT[r] = A[ROWS[r]] @ W[e].T (+ B[e]) for the rows r of tile t, e = TILE_EXPERT[t]; rows
    with ROWS < 0 write zeros (or the bias); a padding tile (e < 0) writes zeros at once, reading
    no weight. Row offsets are int32 unless A or OUT spans 2**31 elements (WIDE); the expert's base
    offset is int64 (all experts together may pass 2**31)."""
    tile = tl.program_id(0)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_out = offs_m.to(tl.int64) if WIDE else offs_m
    out = OUT + offs_out[:, None] * stride_om + offs_n[None, :]
    expert = tl.load(TILE_EXPERT + tile)
    if expert < 0:
        tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=OUT.dtype.element_ty), mask=n_ok[None, :])
        return
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.load(ROWS + offs_m)
    live = rows >= 0
    rows = tl.maximum(rows, 0)
    rows = rows.to(tl.int64) if WIDE else rows.to(tl.int32)
    a_ptr = A + rows[:, None] * stride_am + offs_k[None, :]
    # the expert's [N, K] weight as [BLOCK_N, BLOCK_K] tiles (K contiguous), transposed for the dot
    w_ptr = (W + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
             + offs_k[None, :] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:        # the accumulator starts at the bias: nothing extra stays live in the loop
        bias = tl.load(B + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptr, mask=live[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=PREC)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K * stride_wk
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=n_ok[None, :])


def moe_row_tile(rows_per_expert: float) -> int:
    """BLOCK_M: each expert's rows are padded to whole tiles, so the row tile is the largest of 16,
    32, 64 that is at most a quarter of the rows an expert gets on average (padding ~1/8 of the
    work): few tokens per expert keep 16-row tiles, long prompts share each weight tile over 64."""
    return max([b for b in (16, 32, 64) if b <= rows_per_expert / 4], default=16)


def moe_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMM [rows, k] @ [k, n]."""
    return (min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k))),
            4, 3)


def grouped_gemm(a: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, tile_expert: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [R, K], rows [cap] (a row of ``a`` or -1), w [E, N, K], tile_expert [cap / BLOCK_M],
    bias [E, N] or None -> [cap, N]; the row tile BLOCK_M is the one ``sort_by_expert`` padded
    to."""
    a, cap, n, k = a.contiguous(), rows.shape[0], w.shape[1], w.shape[2]
    block_m = cap // tile_expert.shape[0]
    out = a.new_empty((cap, n))
    block_n, block_k, warps, stages = moe_tiles(n, k)
    prec = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (cap // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, rows, w, out if bias is None else bias, out, tile_expert, k, n,
                               a.stride(0), w.stride(0), w.stride(1), w.stride(2),
                               0 if bias is None else bias.stride(0), out.stride(0),
                               HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k, PREC=prec, WIDE=needs_int64(a, out),
                               num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _round_bf16(v):
    """v (fp32) rounded to the nearest bfloat16 value (ties to even), still fp32: the cast that
    follows is then exact, where Triton's interpreter would truncate (CUDA rounds to nearest)."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    return ((bits + 0x7FFF + lsb) & -65536).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["stride_xs"])
def _fp8_grouped_gemm_kernel(XQ, XS, ROWS, W, WS, WROWS, B, OUT, TILE_EXPERT, N, K, k_offset,
                             num_kb, stride_xq, stride_xs, stride_we, stride_wn, stride_se,
                             stride_sr, stride_be, stride_om, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             WIDE: tl.constexpr):
    """OUT[r] = dequant(XQ[ROWS[r]]) @ dequant(W[e]).T (+ B[e]) for the rows r of tile t,
    e = TILE_EXPERT[t]: one FP8 dot per weight K block, scaled by the row's group scale (XS [K
    blocks, rows]; its stride is the row count, a batch size) and the block's scale (WS [E, row
    blocks, K blocks], row block WROWS[n]), summed in fp32. Rows with ROWS < 0 write zeros (or the
    bias); a padding tile (e < 0) writes zeros at once, reading no weight."""
    tile = tl.program_id(0)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    offs_out = offs_m.to(tl.int64) if WIDE else offs_m
    out = OUT + offs_out[:, None] * stride_om + rn[None, :]
    expert = tl.load(TILE_EXPERT + tile)
    if expert < 0:
        tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=OUT.dtype.element_ty), mask=n_ok[None, :])
        return
    rk = tl.arange(0, BLOCK_K)
    rows = tl.load(ROWS + offs_m)
    live = rows >= 0
    rows = tl.maximum(rows, 0)
    rows = rows.to(tl.int64) if WIDE else rows.to(tl.int32)
    rn_o = rn.to(tl.int64) if WIDE else rn
    w_rows = tl.load(WROWS + rn, mask=n_ok, other=0)
    w_rows = w_rows.to(tl.int64) if WIDE else w_rows.to(tl.int32)
    x_ptr = XQ + rows[:, None] * stride_xq + rk[None, :]                       # [BLOCK_M, BLOCK_K]
    xs_ptr = XS + rows
    # the expert's base offset in int64: all experts together may pass 2**31 elements
    w_ptr = (W + expert.to(tl.int64) * stride_we + rn_o[:, None] * stride_wn
             + (rk - k_offset)[None, :])                                        # [BLOCK_N, BLOCK_K]
    ws_ptr = WS + expert.to(tl.int64) * stride_se + w_rows * stride_sr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:        # the accumulator starts at the bias: nothing extra stays live in the loop
        bias = tl.load(B + expert.to(tl.int64) * stride_be + rn, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    for kb in range(num_kb):
        cols = kb * BLOCK_K - k_offset + rk
        w_ok = n_ok[:, None] & ((cols >= 0) & (cols < K))[None, :]
        x = tl.load(x_ptr, mask=live[:, None], other=0.0)
        w = tl.load(w_ptr, mask=w_ok, other=0.0)
        x_scale = tl.load(xs_ptr, mask=live, other=0.0)
        w_scale = tl.load(ws_ptr, mask=n_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w)) * x_scale[:, None] * w_scale[None, :]
        x_ptr += BLOCK_K
        xs_ptr += stride_xs
        w_ptr += BLOCK_K
        ws_ptr += 1
    if OUT.dtype.element_ty == tl.bfloat16:
        acc = _round_bf16(acc)
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=n_ok[None, :])


def moe_fp8_tiles(block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the FP8 grouped GEMM over ``block_m``-row tiles (BLOCK_K
    is the weight's K block). Few rows per expert read each weight tile about once whatever the
    tile: 64 columns over 4 warps (more programs). 64-row tiles (long prompts) take 128 columns on
    two warpgroups, halving the activation reads per weight read: 168 registers for sm_90a, where
    one warpgroup needs 240 (the per-block scaling keeps a second accumulator live)."""
    return (128, 8, 3) if block_m >= 64 else (64, 4, 3)


def fp8_grouped_gemm(a: torch.Tensor, rows: torch.Tensor, w: Fp8Experts, tile_expert: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_gemm``'s contract over FP8 experts: a [R, K] (bf16/fp16/fp32) is quantized per row
    and K group on the weight's grid; [cap, N] in a's dtype."""
    weight, scale = w.weight, w.scale
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("FP8 experts need K-contiguous weights and scales")
    cap, (n, k), block_k = rows.shape[0], weight.shape[1:], w.block[1]
    a = a if a.stride(-1) == 1 else a.contiguous()
    xq, xs = quantize_activations_triton(a, block_k, w.k_offset)
    out = a.new_empty((cap, n))
    block_m = cap // tile_expert.shape[0]
    block_n, warps, stages = moe_fp8_tiles(block_m)
    grid = (cap // block_m, triton.cdiv(n, block_n))
    _fp8_grouped_gemm_kernel[grid](
        xq, xs, rows, weight, scale, w.scale_rows, out if bias is None else bias, out,
        tile_expert, n, k, w.k_offset, xs.shape[0], xq.stride(0), xs.stride(0), weight.stride(0),
        weight.stride(1), scale.stride(0), scale.stride(1), 0 if bias is None else bias.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, WIDE=needs_int64(xq, out, weight[0]), num_warps=warps,
        num_stages=stages)
    return out


def sort_by_expert(ids: torch.Tensor, first: int, num_local: int,
                   block_m: int) -> tuple[torch.Tensor, ...]:
    """Pairs sorted by local expert, each expert padded to whole tiles: (row_pair [cap], the flat
    (row, k) pair index at each sorted row or -1; tile_expert [cap / block_m], each tile's local
    expert or -1). Pairs routed to other ranks' experts are dropped; tiles of ``block_m`` rows."""
    dev, pairs = ids.device, ids.numel()
    local = ids.reshape(-1) - first
    other = torch.full_like(local, num_local)
    local = torch.where((local >= 0) & (local < num_local), local, other)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev)
    counts = counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    sorted_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(local, stable=True)
    expert_of = local[order]
    rank_in_expert = torch.arange(pairs, device=dev) - sorted_start[expert_of]
    cap = -(-(pairs + num_local * (block_m - 1)) // block_m) * block_m
    start = pad_start[expert_of.clamp(max=num_local - 1)]
    trash = torch.full_like(expert_of, cap)         # other ranks' pairs land past the end
    dest = torch.where(expert_of < num_local, start + rank_in_expert, trash)
    row_pair = torch.full((cap + 1,), -1, dtype=torch.long, device=dev)
    row_pair = row_pair.scatter_(0, dest, order)[:cap]
    tile_expert = torch.searchsorted(pad_end, torch.arange(0, cap, block_m, device=dev), right=True)
    none = torch.full_like(tile_expert, -1)
    tile_expert = torch.where(tile_expert < num_local, tile_expert, none)
    return row_pair, tile_expert


@triton.jit
def _gated_activation_kernel(H, OUT, TILE_EXPERT, inter, stride_h, stride_o, limit, alpha,
                             up_shift, CLAMP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """OUT[r, :inter] = the gating of H[r, :inter] (gate) and H[r, inter:] (up), in fp32 and rounded
    once: g * sigmoid(alpha g) * (u + up_shift), g and u clamped to ``limit`` when CLAMP
    (``moe_torch.GatedActivation``). Rows of a padding tile (TILE_EXPERT[r / BLOCK_M] < 0) are
    left unwritten: the down projection's padding tiles never read them (under EP most tiles)."""
    row = tl.program_id(0)
    if tl.load(TILE_EXPERT + row // BLOCK_M) < 0:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    row = row.to(tl.int64) if WIDE else row
    h = H + row * stride_h + cols
    gate = tl.load(h, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h + inter, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate * alpha) * (up + up_shift)
    if OUT.dtype.element_ty == tl.bfloat16:
        act = _round_bf16(act)
    tl.store(OUT + row * stride_o + cols, act.to(OUT.dtype.element_ty), mask=ok)


def activation_tiles(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the gating: up to 1024 of a row's columns a program."""
    block = min(1024, max(16, triton.next_power_of_2(inter)))
    return block, 4 if block <= 512 else 8


def gated_activation(h: torch.Tensor, activation: GatedActivation,
                     tile_expert: torch.Tensor) -> torch.Tensor:
    """h [cap, 2 I] (gate columns, then up), tile_expert [cap / BLOCK_M] -> [cap, I] in h's dtype,
    rows of padding tiles unwritten."""
    cap, inter = h.shape[0], h.shape[1] // 2
    out = h.new_empty((cap, inter))
    block, warps = activation_tiles(inter)
    limit = activation.limit
    if cap and inter:
        _gated_activation_kernel[(cap, triton.cdiv(inter, block))](
            h, out, tile_expert, inter, h.stride(0), out.stride(0), float(limit or 0.0),
            float(activation.alpha), float(activation.up_shift), CLAMP=limit is not None,
            BLOCK_M=cap // tile_expert.shape[0], BLOCK=block, WIDE=needs_int64(h, out),
            num_warps=warps)
    return out


def triton_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, first: int, block_m: int | None = None,
                   activation: GatedActivation = SILU, biases: Biases = NO_BIASES) -> torch.Tensor:
    """The torch form's contract (``moe_torch.dense_experts_torch``): x [N, H], ids/weights [N, k]
    -> [N, H], the local experts' sum. ``block_m`` overrides the row tile (16, 32 or 64)."""
    return run_experts(grouped_gemm, x, ids, weights, gate_up, down, first, gate_up.shape[0],
                       block_m, activation, biases)


def run_experts(gemm: Callable, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                gate_up: object, down: object, first: int, num_local: int, block_m: int | None,
                activation: GatedActivation, biases: Biases) -> torch.Tensor:
    """Sort the pairs by expert, ``gemm`` (``grouped_gemm``'s contract) over gate_up, the gating,
    ``gemm`` over down, then each row's weighted sum of its local experts: only routed pairs are
    computed."""
    k = ids.shape[1]
    # rows per local expert if routing spreads evenly (an upper bound under expert parallelism)
    block_m = block_m or moe_row_tile(ids.numel() / num_local)
    row_pair, tile_expert = sort_by_expert(ids, first, num_local, block_m)
    live = row_pair >= 0
    pair = row_pair.clamp(min=0)
    rows = torch.where(live, pair // k, row_pair)
    gate_up_bias, down_bias = biases
    h = gemm(x, rows, gate_up, tile_expert, gate_up_bias)
    act = gated_activation(h, activation, tile_expert)
    same = torch.where(live, torch.arange(rows.shape[0], device=x.device), row_pair)
    y = gemm(act, same, down, tile_expert, down_bias)
    scale = weights.reshape(-1).index_select(0, pair) * live.to(weights.dtype)
    return torch.zeros_like(x).index_add_(0, rows.clamp(min=0), y * scale[:, None])


def triton_experts_fp8(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       gate_up: Fp8Experts, down: Fp8Experts, first: int,
                       block_m: int | None = None, activation: GatedActivation = SILU,
                       biases: Biases = NO_BIASES) -> torch.Tensor:
    """``triton_experts`` over FP8 experts as loaded (gate rows then up rows in ``gate_up``; down's
    K the rank's slice of the intermediate dim), activations quantized per token and K group."""
    return run_experts(fp8_grouped_gemm, x, ids, weights, gate_up, down, first,
                       gate_up.weight.shape[0], block_m, activation, biases)

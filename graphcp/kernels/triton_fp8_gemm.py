"""Block-scaled FP8 GEMM in Triton (CUDA; Triton's interpreter in the tests): y = x @ dequant(w).T.

Two launches: activations are quantized per token and group of ``block_k`` columns (1 x 128 in the
real format, scale = amax / 448) on the weight's K-block grid, once per element; the GEMM then
multiplies FP8 tiles on the tensor cores, one K tile per weight block, and scales each tile's fp32
partial sum by the token-group scale and the weight-block scale before accumulating in fp32 (as
DeepSeek's kernels do). Output in the activation dtype. Matches ``fp8_torch.fp8_linear_torch`` up
to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcp.kernels.fp8_types import FP8, FP8_MAX, Fp8Weight
from graphcp.kernels.triton_util import needs_int64


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest float8_e4m3fn value (ties to even), still fp32.
    The cast that follows is then exact: Triton's interpreter rounds fp32 -> fp8 wrongly when the
    mantissa carries."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(
        tl.float32, bitcast=True
    )  # keep 3 mantissa bits
    y = tl.abs(v) * 512.0  # subnormals: multiples of 2^-9
    whole = tl.floor(y)
    frac = y - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    sub = tl.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole) * 0.001953125
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


# Row counts (and the scales' stride, which is one) follow the batch: never specialized on their
# value, so a new batch size compiles nothing.
@triton.jit(do_not_specialize=["M", "stride_xs"])
def _act_quant_kernel(
    X,
    XQ,
    XS,
    M,
    K,
    k_offset,
    stride_x,
    stride_xq,
    stride_xs,
    fp8_max,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    cols = kb * BLOCK_K - k_offset + rk  # the group's columns of x (grid shifted by k_offset)
    row_ok = rows < M
    ok = row_ok[:, None] & ((cols >= 0) & (cols < K))[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / fp8_max
    q = _round_e4m3(x / scale[:, None])
    tl.store(
        XQ + rows64[:, None] * stride_xq + (kb * BLOCK_K + rk)[None, :],
        q.to(XQ.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(XS + kb * stride_xs + rows, scale, mask=row_ok)


@triton.jit(do_not_specialize=["M", "stride_xs"])
def _fp8_gemm_kernel(
    XQ,
    XS,
    W,
    WS,
    WROWS,
    B,
    Y,
    M,
    N,
    K,
    k_offset,
    num_kb,
    stride_xq,
    stride_xs,
    stride_w,
    stride_ws,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    # int32 offsets unless an operand spans 2**31 elements (WIDE): fewer address registers
    rm_o, rn_o = (rm.to(tl.int64), rn.to(tl.int64)) if WIDE else (rm, rn)
    w_rows = tl.load(WROWS + rn, mask=n_ok, other=0)
    w_rows = w_rows.to(tl.int64) if WIDE else w_rows.to(tl.int32)
    x_ptr = XQ + rm_o[:, None] * stride_xq + rk[None, :]                 # [BLOCK_M, BLOCK_K]
    w_ptr = W + rn_o[:, None] * stride_w + (rk - k_offset)[None, :]      # [BLOCK_N, BLOCK_K]
    xs_ptr = XS + rm
    ws_ptr = WS + w_rows * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(num_kb):
        cols = kb * BLOCK_K - k_offset + rk
        w_ok = n_ok[:, None] & ((cols >= 0) & (cols < K))[None, :]
        x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr, mask=w_ok, other=0.0)
        x_scale = tl.load(xs_ptr, mask=m_ok, other=0.0)
        w_scale = tl.load(ws_ptr, mask=n_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w)) * x_scale[:, None] * w_scale[None, :]
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
        xs_ptr += stride_xs
        ws_ptr += 1
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + rm_o[:, None] * stride_y + rn[None, :],
        acc.to(Y.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def quant_tiles(block_k: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps) of the activation quantizer: one K group of BLOCK_M rows per program."""
    return (16 if block_k >= 128 else 32), 4


def gemm_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the GEMM for ``m`` activation rows (the batch's
    real rows eagerly, the bucket in a graph). Few rows read the weight once whatever the tile, so
    the row tile follows m (16, 32, 64: no idle MMA rows) with 64-column tiles (more programs
    streaming the weight); from 65 rows, 128 x 64 over 8 warps. 128 x 128 tiles need 254 registers
    for sm_90a (the per-block scaling keeps a second accumulator live): on the edge of spilling."""
    if m <= 64:
        return max(16, triton.next_power_of_2(m)), 64, 4, 3
    return 128, 64, 8, 3


def quantize_activations_triton(
    x: torch.Tensor, block_k: int, k_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton form of ``fp8_torch.quantize_activations``; scales come back [K blocks, M] (the
    GEMM reads a column of M rows per tile)."""
    m, k = x.shape
    blocks = triton.cdiv(k + k_offset, block_k)
    xq = torch.empty(m, blocks * block_k, dtype=FP8, device=x.device)
    xs = torch.empty(blocks, m, dtype=torch.float32, device=x.device)
    if m:
        block_m, warps = quant_tiles(block_k)
        _act_quant_kernel[(triton.cdiv(m, block_m), blocks)](
            x,
            xq,
            xs,
            m,
            k,
            k_offset,
            x.stride(0),
            xq.stride(0),
            xs.stride(0),
            FP8_MAX,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            num_warps=warps,
        )
    return xq, xs


def triton_fp8_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ the FP8 weight [N, K] with its block scales -> [..., N] in x's
    dtype."""
    n, k = w.weight.shape
    block_k = w.block[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        xq, xs = quantize_activations_triton(x2, block_k, w.k_offset)
        block_m, block_n, warps, stages = gemm_tiles(m)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        _fp8_gemm_kernel[grid](
            xq,
            xs,
            w.weight,
            w.scale,
            w.scale_rows,
            bias if bias is not None else y,
            y,
            m,
            n,
            k,
            w.k_offset,
            xs.shape[0],
            xq.stride(0),
            xs.stride(0),
            w.weight.stride(0),
            w.scale.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            WIDE=needs_int64(xq, w.weight, y),
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*x.shape[:-1], n)


__all__ = ["triton_fp8_linear", "quantize_activations_triton", "quant_tiles", "gemm_tiles"]

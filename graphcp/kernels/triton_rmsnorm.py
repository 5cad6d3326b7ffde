"""RMSNorm as one Triton launch (CUDA), instead of the eight aten ops of the torch form; optionally fused with
the residual add that precedes it (one launch instead of nine).

Same rounding points as the torch form and the HF reference: the residual sum rounded to the input dtype,
statistics in fp32, the normalized row cast to the input dtype, then multiplied by the weight and rounded once
more. Takes [T, N] or [T, H, N] with any row and head strides (q/k norms read column slices of the fused qkv
output without a copy).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, S, stride_xt, stride_xh, stride_rt, stride_yt, stride_yh, stride_st, N, eps,
                    BLOCK: tl.constexpr, ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + t * stride_xt + h * stride_xh + cols, mask=ok, other=0.0)
    if ADD:   # the residual stream: x + residual in the input dtype, kept for the next add
        r = tl.load(R + t * stride_rt + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(S + t * stride_st + cols, x, mask=ok)
    x = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * inv).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + t * stride_yt + h * stride_yh + cols, (w * normed).to(Y.dtype.element_ty), mask=ok)


def rmsnorm_tiles(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps): one program per row (and head), the whole row in one tile."""
    block = triton.next_power_of_2(width)
    return block, max(1, min(8, block // 256))


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x); with ``residual`` ([T, N] only): (norm(x + residual), x + residual)."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.shape == (x.shape[-1],)
    assert weight.dtype == x.dtype, "the torch form multiplies in the input dtype; keep weight and input alike"
    add = residual is not None
    if add:
        assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if add else out
    r = residual if add else out
    T, H, N = x3.shape
    if T and H:
        block, warps = rmsnorm_tiles(N)
        _rmsnorm_kernel[(T, H)](x3, r, weight, out, total, x3.stride(0), x3.stride(1), r.stride(0), out.stride(0),
                                out.stride(1), total.stride(0), N, float(eps), BLOCK=block, ADD=add,
                                num_warps=warps)
    out = out if x.dim() == 3 else out.squeeze(1)
    return (out, total) if add else out


__all__ = ["triton_rms_norm", "rmsnorm_tiles"]

"""RMSNorm as one Triton launch (CUDA), instead of the eight aten ops of the torch form.

Same rounding points as the torch form and the HF reference: statistics in fp32, the normalized row cast
to the input dtype, then multiplied by the weight and rounded once more. Takes [T, N] or [T, H, N] with
any row and head strides (q/k norms read column slices of the fused qkv output without a copy).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_xt, stride_xh, stride_yt, stride_yh, N, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + t * stride_xt + h * stride_xh + cols, mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * inv).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + t * stride_yt + h * stride_yh + cols, (w * normed).to(Y.dtype.element_ty), mask=ok)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.shape == (x.shape[-1],)
    assert weight.dtype == x.dtype, "the torch form multiplies in the input dtype; keep weight and input alike"
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    T, H, N = x3.shape
    if T and H:
        block = triton.next_power_of_2(N)
        _rmsnorm_kernel[(T, H)](x3, weight, out, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), N,
                                float(eps), BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return out if x.dim() == 3 else out.squeeze(1)


__all__ = ["triton_rms_norm"]

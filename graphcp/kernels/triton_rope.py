"""Rotary embedding as one Triton launch per tensor (CUDA), instead of seven aten ops.

Rounds where the torch form ``x * cos + rotate_half(x) * sin`` rounds in the model dtype: each product,
then the sum. Takes [T, H, D] with any token and head strides (q/k may be column slices of the fused qkv
output) and writes a contiguous result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, COS, SIN, Y, stride_xt, stride_xh, stride_yt, stride_yh, stride_ct, H,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    ok = (h < H)[:, None] & d_ok[None, :]
    cos1 = tl.load(COS + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + t * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + t * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    x_row = X + t * stride_xt + h[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = Y.dtype.element_ty
    # rotate_half(x) = [-x2, x1]
    y1 = (x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)
    y2 = (x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)
    y_row = Y + t * stride_yt + h[:, None].to(tl.int64) * stride_yh + d[None, :]
    tl.store(y_row, y1.to(dt), mask=ok)
    tl.store(y_row + HALF, y2.to(dt), mask=ok)


def rope_tiles(heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, num_warps): one program per token and block of heads (>= 2 heads: no
    size-1 aranges)."""
    return max(2, min(16, triton.next_power_of_2(heads))), triton.next_power_of_2(head_dim // 2), 4


def triton_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] (rows of the position's table, in x's dtype, last dim contiguous)."""
    T, H, D = x.shape
    assert D % 2 == 0 and x.stride(-1) == 1 and cos.shape == sin.shape == (T, D)
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T and H:
        block_h, block_d, warps = rope_tiles(H, D)
        _rope_kernel[(T, triton.cdiv(H, block_h))](
            x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), H,
            HALF=D // 2, BLOCK_D=block_d, BLOCK_H=block_h, num_warps=warps)
    return out


__all__ = ["triton_rope", "rope_tiles"]

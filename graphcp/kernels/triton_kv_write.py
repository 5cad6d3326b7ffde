"""Scatter of new K/V rows into their paged-cache slots, in Triton.

Capturable: the grid depends on the row count N (a shape) only; the slots are read in the kernel.
Padding rows all point at the dummy slot 0, which ends up holding any one of them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])     # the token count follows the batch
def _kv_write_kernel(
    KP, VP, SLOTS, K, V,
    stride_kps, stride_kph, stride_kpd,
    stride_vps, stride_vph, stride_vpd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    N, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < N
    slot = tl.load(SLOTS + r, mask=r_ok, other=0).to(tl.int64)
    rr = r.to(tl.int64)
    e = tl.arange(0, BLOCK_E)                       # flattened (head, dim)
    e_ok = e < NUM_HEADS * HEAD_DIM
    h = e // HEAD_DIM
    d = e % HEAD_DIM
    mask = r_ok[:, None] & e_ok[None, :]
    k = tl.load(K + rr[:, None] * stride_kn + h[None, :] * stride_kh + d[None, :] * stride_kd, mask=mask)
    tl.store(KP + slot[:, None] * stride_kps + h[None, :] * stride_kph + d[None, :] * stride_kpd,
             k.to(KP.dtype.element_ty), mask=mask)
    v = tl.load(V + rr[:, None] * stride_vn + h[None, :] * stride_vh + d[None, :] * stride_vd, mask=mask)
    tl.store(VP + slot[:, None] * stride_vps + h[None, :] * stride_vph + d[None, :] * stride_vpd,
             v.to(VP.dtype.element_ty), mask=mask)


class KVWriteTiles(NamedTuple):
    block_r: int
    block_e: int
    num_warps: int


def kv_write_tiles(heads: int, head_dim: int) -> KVWriteTiles:
    """Rows per program and the flattened (head, dim) width: ~4K elements per tile."""
    block_e = triton.next_power_of_2(heads * head_dim)
    block_r = max(1, min(16, 4096 // block_e))
    return KVWriteTiles(block_r, block_e, 4 if block_r * block_e >= 2048 else 2)


def triton_kv_write(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """k_pool[slots[i]] = k[i] and v_pool[slots[i]] = v[i] for i < N; pools [num_slots, Hkv, D], k/v [N, Hkv, D]."""
    N, H, D = k.shape
    assert v.shape == k.shape and k_pool.shape[1:] == (H, D) and v_pool.shape[1:] == (H, D)
    assert slots.shape == (N,)
    if N == 0:
        return
    block_r, block_e, warps = kv_write_tiles(H, D)
    grid = (triton.cdiv(N, block_r),)
    _kv_write_kernel[grid](
        k_pool, v_pool, slots, k, v,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        N, HEAD_DIM=D, NUM_HEADS=H, BLOCK_R=block_r, BLOCK_E=block_e,
        num_warps=warps,
    )


__all__ = ["triton_kv_write", "kv_write_tiles"]

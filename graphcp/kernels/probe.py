"""One small call of an attention kernel at engine start, checked against the torch kernel.

Kernels that compile on first use (Triton, flashinfer's JIT or downloaded cubins) can fail on a machine they
were never tried on; probing at start turns that into a fallback (``auto``) or a ConfigError (an explicit
choice) instead of a failed first batch.
"""
from __future__ import annotations

from typing import Callable

import torch

from graphcp.kernels.torch_ref import torch_paged_attention


def probe_kernel(kernel: Callable[..., torch.Tensor], device: torch.device, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int) -> str | None:
    """None when ``kernel`` serves a small batch shaped like the model's (two rows, one extending a cached
    prefix, padding rows after them) as the torch kernel does; else why not."""
    gen = torch.Generator().manual_seed(0)
    q_lens, kv_lens = [19, 7], [19, 7 + 2 * page_size + 3]
    pages = max(-(-kv // page_size) for kv in kv_lens)
    page_rows = torch.arange(1, 1 + 2 * pages).view(2, pages)
    shape = ((1 + 2 * pages) * page_size, num_kv_heads, head_dim)
    k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(sum(q_lens) + 5, num_heads, head_dim, generator=gen)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)])
    limits = torch.tensor([kv - n + i + 1 for n, kv in zip(q_lens, kv_lens) for i in range(n)] + [0] * 5)
    scale = head_dim ** -0.5
    ref = torch_paged_attention(q, k_pool, v_pool, cu, page_rows, limits, page_size, scale, max(q_lens),
                                max(kv_lens), torch.empty_like(q))
    try:
        dev = [t.to(device) for t in (cu, page_rows, limits)]
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
        kernel(q.to(device, dtype), k_pool.to(device, dtype), v_pool.to(device, dtype), *dev, page_size, scale,
               max(q_lens), max(kv_lens), out)
        err = float((out.float().cpu() - ref).abs().max())
    except Exception as e:  # noqa: BLE001 - any failure means this kernel cannot serve here
        return f"failed its first call ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    if not err <= (1e-4 if dtype == torch.float32 else 5e-2):
        return f"disagrees with the torch kernel on a probe batch (max abs error {err:.3g})"
    return None


__all__ = ["probe_kernel"]

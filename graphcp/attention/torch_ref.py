"""Reference paged variable-length attention in torch: the oracle for the other kernels.

Contract shared by every kernel: queries ``q`` [T, Hq, D] grouped into sequences by ``cu_seqlens_q``; each
sequence reads keys of its page-table row; query i of a sequence sees keys [0, q_limits[i]), which for a
plain sequence is bottom-right causal (kv_len - q_len + i + 1). GQA: query head h reads kv head h // (Hq/Hkv).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostLengths:
    """Host-side maxima of the live batch, refreshed before every forward or replay (break arguments)."""
    max_q: int = 0
    max_kv: int = 0
    early_rows: int = 0     # zigzag: local rows held by early blocks (the flashattention path splits there)


def torch_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          page_rows: torch.Tensor, q_limits: torch.Tensor, page_size: int, scale: float,
                          max_q: int, max_kv: int, out: torch.Tensor) -> torch.Tensor:
    dev = q.device
    out.zero_()
    if max_q == 0 or max_kv == 0:
        return out
    # Graph buffers carry padding requests (empty sequences): drop them before the padded batch is formed.
    nonempty = torch.nonzero(cu_seqlens_q[1:] > cu_seqlens_q[:-1]).squeeze(1)
    starts, ends = cu_seqlens_q[:-1][nonempty], cu_seqlens_q[1:][nonempty]
    page_rows = page_rows[nonempty]
    # Queries padded per sequence: [S, max_q]
    q_idx = starts[:, None] + torch.arange(max_q, device=dev)[None, :]
    q_valid = q_idx < ends[:, None]
    q_idx = torch.where(q_valid, q_idx, torch.zeros_like(q_idx))
    key_pos = torch.arange(max_kv, device=dev)
    pages = page_rows[:, torch.div(key_pos, page_size, rounding_mode="floor")]
    slots = pages * page_size + torch.remainder(key_pos, page_size)                     # [S, max_kv]
    keys, values = k_pool[slots], v_pool[slots]                                        # [S, max_kv, Hkv, D]
    limits = torch.where(q_valid, q_limits[q_idx], torch.ones_like(q_idx))
    mask = key_pos[None, None, :] < limits[:, :, None]                                 # [S, max_q, max_kv]
    queries = q[q_idx].transpose(1, 2)                                                 # [S, Hq, max_q, D]
    o = torch.nn.functional.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
        enable_gqa=True)
    o = o.transpose(1, 2)                                                              # [S, max_q, Hq, D]
    out[q_idx[q_valid]] = o[q_valid].to(out.dtype)
    return out

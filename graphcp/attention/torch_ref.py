"""Reference paged variable-length attention in torch: the oracle for the other kernels.

Contract shared by every kernel: queries ``q`` [T, Hq, D] grouped into sequences by ``cu_seqlens_q``; each
sequence reads keys of its page-table row; query i of a sequence sees keys [0, q_limits[i]), which for a
plain sequence is bottom-right causal (kv_len - q_len + i + 1). GQA: query head h reads kv head h // (Hq/Hkv).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HostLengths:
    """Host-side maxima of the live batch, refreshed before every forward or replay (break arguments)."""
    max_q: int = 0
    max_kv: int = 0
    early_rows: int = 0     # zigzag: local rows held by early blocks (the flashattention path splits there)
    workspace: dict = field(default_factory=dict)   # per-forward scratch kernels share across layers


def _sequence_layout(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor, page_size: int,
                     max_q: int, max_kv: int) -> tuple:
    """Layer-independent gather indices: padded query rows, KV slots and the causal mask."""
    dev = cu_seqlens_q.device
    # Graph buffers carry padding requests (empty sequences): drop them before the padded batch is formed.
    nonempty = torch.nonzero(cu_seqlens_q[1:] > cu_seqlens_q[:-1]).squeeze(1)
    starts, ends = cu_seqlens_q[:-1][nonempty], cu_seqlens_q[1:][nonempty]
    q_idx = starts[:, None] + torch.arange(max_q, device=dev)[None, :]                 # [S, max_q]
    q_valid = q_idx < ends[:, None]
    q_idx = torch.where(q_valid, q_idx, torch.zeros_like(q_idx))
    key_pos = torch.arange(max_kv, device=dev)
    pages = page_rows[nonempty][:, torch.div(key_pos, page_size, rounding_mode="floor")]
    slots = pages * page_size + torch.remainder(key_pos, page_size)                     # [S, max_kv]
    limits = torch.where(q_valid, q_limits[q_idx], torch.ones_like(q_idx))
    mask = (key_pos[None, None, :] < limits[:, :, None])[:, None]                      # [S, 1, max_q, max_kv]
    return q_idx, q_valid, q_idx[q_valid], slots, mask


def torch_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          page_rows: torch.Tensor, q_limits: torch.Tensor, page_size: int, scale: float,
                          max_q: int, max_kv: int, out: torch.Tensor, *, workspace: dict | None = None) -> torch.Tensor:
    out.zero_()
    if max_q == 0 or max_kv == 0:
        return out
    inputs = (cu_seqlens_q, page_rows, q_limits)
    key = ("torch", *(id(t) for t in inputs), page_size, max_q, max_kv)
    cached = workspace.get(key) if workspace is not None else None
    if cached is None or any(a is not b for a, b in zip(cached[0], inputs)):
        # The entry keeps its inputs alive, so their ids cannot be reused within the forward.
        cached = (inputs, _sequence_layout(cu_seqlens_q, page_rows, q_limits, page_size, max_q, max_kv))
        if workspace is not None:
            workspace[key] = cached
    q_idx, q_valid, rows, slots, mask = cached[1]
    keys, values = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)         # [S, Hkv, max_kv, D]
    o = torch.nn.functional.scaled_dot_product_attention(q[q_idx].transpose(1, 2), keys, values, attn_mask=mask,
                                                         scale=scale, enable_gqa=True)
    out[rows] = o.transpose(1, 2)[q_valid].to(out.dtype)                                # [S, max_q, Hq, D] rows
    return out

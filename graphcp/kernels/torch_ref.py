"""Reference paged variable-length attention in torch: the oracle for the other kernels.

Contract shared by every kernel: queries ``q`` [T, Hq, D] grouped into sequences by ``cu_seqlens_q``; each
sequence reads keys of its page-table row; query i of a sequence sees keys [0, q_limits[i]), which for a
plain sequence is bottom-right causal (kv_len - q_len + i + 1); limits never decrease within a sequence.
GQA: query head h reads kv head h // (Hq/Hkv). Rows past the last sequence are written as zeros.
Two keyword options: ``window`` W > 0 narrows query i to keys [q_limits[i] - W, q_limits[i]) (a key's
index is its position, so a query at position p sees p - W < j <= p, as transformers' sliding
window); ``sinks`` [Hq] adds one logit per head to every row's softmax denominator (gpt-oss's
attention sinks), which attends no value.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch

_MASK_ELEMENTS = 1 << 24          # masks up to this size are made once per forward and kept for every layer
_SCORE_BYTES = 512 << 20          # at most this much fp32 attention scores per SDPA call (the masked path
                                  # materialises them): a fallback on CUDA at 8k-token buckets stays bounded


def per_forward(workspace: dict | None, name: str, inputs: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, cached in the per-forward workspace under the identity of the metadata tensors: every layer
    of a forward passes the same ones, so kernels derive their arguments once (once per capture, too). The
    entry keeps its inputs alive, so their ids cannot be reused within the forward."""
    if workspace is None:
        return make()
    key = (name, *(id(t) for t in inputs))
    entry = workspace.get(key)
    if entry is None or any(a is not b for a, b in zip(entry[0], inputs)):
        entry = workspace[key] = (inputs, make())
    return entry[1]


def _group_sequences(q_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Split the non-empty sequences, sorted by KV length, into at most two groups padded separately:
    the split with the least padded work (zigzag's short early blocks and long late blocks part), when
    it saves enough work to pay for the extra launches."""
    order = sorted((s for s, (q, kv) in enumerate(zip(q_lens, kv_lens)) if q and kv), key=lambda s: kv_lens[s])
    if len(order) <= 1:
        return [order] if order else []

    def cost(group: list[int]) -> int:
        return len(group) * max(q_lens[s] for s in group) * kv_lens[group[-1]] if group else 0

    split = min(range(1, len(order) + 1), key=lambda k: cost(order[:k]) + cost(order[k:]))
    # A second call costs ~10 more launches (tens of microseconds); take it only when the padding it
    # saves is worth far more (32k scores per head is about a millisecond of CPU work).
    if cost(order) - cost(order[:split]) - cost(order[split:]) < 32768:
        return [order]
    return [order[:split], order[split:]]


def _host_groups(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                 page_size: int, window: int) -> Iterator[tuple]:
    """Per group of sequences, in numpy: padded query rows [G, max_q], their validity, KV slots
    [G, max_kv], the causal mask when small (else None), the limits and the key positions. Index
    arithmetic on the host (a few us an op where a torch op costs ~10)."""
    host = cu_seqlens_q.device.type == "cpu"            # then read in place
    cu, table, lim = (t.numpy() if host else t.cpu().numpy() for t in (cu_seqlens_q, page_rows, q_limits))
    q_lens = np.diff(cu)
    # Limits never decrease inside a sequence (bottom-right causal), so its last query sees the most keys.
    kv_lens = np.where(q_lens > 0, lim[np.maximum(cu[1:] - 1, 0)], 0)
    for group in _group_sequences(q_lens.tolist(), kv_lens.tolist()):
        seqs = np.asarray(group)
        max_q, max_kv = int(q_lens[seqs].max()), int(kv_lens[seqs].max())
        q_idx = cu[seqs][:, None] + np.arange(max_q)[None, :]                             # [G, max_q]
        q_valid = q_idx < cu[seqs + 1][:, None]
        q_idx = np.where(q_valid, q_idx, 0)
        key_pos = np.arange(max_kv)
        slots = table[seqs][:, key_pos // page_size] * page_size + key_pos % page_size     # [G, max_kv]
        limits = np.where(q_valid, lim[q_idx], 1)
        # The mask is kept for every layer when small; a long prompt's is made chunk by chunk.
        small = q_idx.size * max_kv <= _MASK_ELEMENTS
        mask = _visible(key_pos, limits, window)[:, None] if small else None     # [G, 1, max_q, max_kv]
        yield q_idx, q_valid, slots, mask, limits, key_pos


def _moved(parts: tuple, device: torch.device) -> tuple:
    if device.type == "cpu":                 # handed back as they are: no op dispatched
        return tuple(None if a is None else torch.from_numpy(a) for a in parts)
    return tuple(None if a is None else torch.from_numpy(a).to(device) for a in parts)


def sequence_layout(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                    page_size: int) -> list[tuple]:
    """Layer-independent gather indices per group of sequences: (padded query rows, their validity,
    the real rows, KV slots, mask, limits, key positions), on the metadata's device."""
    return [_moved((q_idx, q_valid, q_idx[q_valid], slots, mask, limits, key_pos), cu_seqlens_q.device)
            for q_idx, q_valid, slots, mask, limits, key_pos
            in _host_groups(cu_seqlens_q, page_rows, q_limits, page_size, 0)]


def head_major_layout(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                      page_size: int, q_heads: int, kv_heads: int, window: int = 0) -> list[tuple]:
    """``sequence_layout`` shaped so that each gather yields the [G, H, len, D] layout SDPA takes
    (no transposes per layer): per group, KV slots [G, 1, max_kv] and head indices [1, Hkv, 1],
    then its query chunks (one where the mask is small), each with its query rows [G, 1, n] and
    heads [1, Hq, 1], the (sequence, row) pairs of its real queries, their rows in ``q``, and its
    mask, or the limits and key positions to make it from."""
    dev = cu_seqlens_q.device
    hq, hkv = np.arange(q_heads)[None, :, None], np.arange(kv_heads)[None, :, None]
    layout = []
    for q_idx, q_valid, slots, mask, limits, key_pos in _host_groups(cu_seqlens_q, page_rows, q_limits,
                                                                       page_size, window):
        g, max_q = q_idx.shape
        step = max_q if mask is not None else max(1, _SCORE_BYTES // (4 * g * q_heads * slots.shape[1]))
        chunks = []
        for c in range(0, max_q, step):
            qi, qv = q_idx[:, c:c + step], q_valid[:, c:c + step]
            made = (mask, None, None) if mask is not None else (None, limits[:, c:c + step], key_pos)
            chunks.append(_moved((qi[:, None], hq, *np.nonzero(qv), qi[qv], *made), dev))
        layout.append((*_moved((slots[:, None], hkv), dev), chunks))
    return layout


def _visible(key_pos, limits, window: int):
    """[G, max_q, max_kv] keys each query sees (numpy or torch alike): below its limit, and within
    the window where there is one."""
    seen = key_pos[None, None, :] < limits[:, :, None]
    if window:
        seen = seen & (key_pos[None, None, :] >= limits[:, :, None] - window)
    return seen


def torch_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          page_rows: torch.Tensor, q_limits: torch.Tensor, page_size: int, scale: float,
                          max_q: int, max_kv: int, out: torch.Tensor, *, workspace: dict | None = None,
                          window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """At most two padded SDPA calls (more for long prompts: queries in chunks, so the masked path never
    materialises more than ``_SCORE_BYTES`` of scores); ``max_q``/``max_kv`` only tell an empty batch apart.
    With ``sinks`` the softmax is written out (SDPA takes no extra logit)."""
    out.zero_()
    if max_q == 0 or max_kv == 0:
        return out
    hq, hkv = q.shape[1], k_pool.shape[1]
    layout = per_forward(workspace, f"torch{page_size}/{hq}/{hkv}/{window}", (cu_seqlens_q, page_rows, q_limits),
                         lambda: head_major_layout(cu_seqlens_q, page_rows, q_limits, page_size, hq, hkv, window))
    for slots, kv_heads, chunks in layout:
        k, v = k_pool[slots, kv_heads], v_pool[slots, kv_heads]                 # [G, Hkv, max_kv, D]
        for q_idx, q_heads, seq, row, rows, mask, limits, key_pos in chunks:
            if mask is None:                 # a long prompt's mask, made chunk by chunk
                mask = _visible(key_pos, limits, window)[:, None]
            _sdpa(q, k, v, (q_idx, q_heads), (seq, row), rows, mask, scale, out, sinks)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: tuple, valid: tuple,
          rows: torch.Tensor, mask: torch.Tensor, scale: float, out: torch.Tensor,
          sinks: torch.Tensor | None) -> None:
    """``q_index``: (rows [G, 1, max_q], heads [1, Hq, 1]); ``valid``: (sequence, row) of each real
    query, in the order of ``rows`` (its row in ``q`` and ``out``)."""
    if sinks is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q_index], k, v, attn_mask=mask, scale=scale, enable_gqa=True)      # [G, Hq, max_q, D]
    else:
        o = _softmax_with_sinks(q[q_index], k, v, mask, scale, sinks)
    o = o[valid[0], :, valid[1]]                                                 # [real queries, Hq, D]
    out[rows] = o if o.dtype == out.dtype else o.to(out.dtype)


def _softmax_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention written out: each row's softmax in fp32 over its visible keys' logits and the
    head's sink logit, whose probability is dropped (it attends nothing)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).float()             # [G, Hq, max_q, max_kv]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)

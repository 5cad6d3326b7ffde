"""A plain-torch model of the two flashinfer entry points graphcp calls, written from flashinfer's documented
argument semantics (0.7 API reference), so CPU tests can check graphcp's translation of its page tables and
lengths into flashinfer's arguments. It is a test double for the *arguments*, not a stand-in for the library:
the real kernels are checked against the torch reference by ``profiles/gpu_check.py`` on a GPU with
flashinfer installed.

Documented semantics modelled here:
- ``trtllm_batch_context_with_kv_cache``: query [T, Hq, D]; kv_cache a (K, V) tuple, NHD pages
  [num_pages, page_size, Hkv, D]; block_tables [B, max_pages]; seq_lens = kv length per row;
  cum_seq_lens_q / cum_seq_lens_kv [B + 1]; causal rows aligned bottom-right; bmm1_scale is the softmax scale,
  bmm2_scale multiplies the output; max_q_len / max_kv_len bound the rows.
- ``BatchPrefillWithPagedKVCacheWrapper.plan``: qo_indptr [B + 1]; paged_kv_indptr [B + 1] into
  paged_kv_indices; paged_kv_last_page_len in [1, page_size], so kv_len = (pages - 1) * page_size + last.
  ``run(q, (K, V), out=...)`` computes causal (bottom-right) attention for the planned rows.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

import torch


def _attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [kv, Hkv, D]; bottom-right causal; fp32 math."""
    n, kv = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = torch.arange(kv)[None, :] <= (kv - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _gather(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    return cache[pages.long()].reshape(-1, *cache.shape[2:])[:kv_len]


class CallLog:
    trtllm_calls: list[dict] = []
    plans: list[dict] = []


def trtllm_batch_context_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len,
                                       max_kv_len, bmm1_scale, bmm2_scale, batch_size, cum_seq_lens_q,
                                       cum_seq_lens_kv, out=None, kv_layout="HND", **_):
    assert kv_layout == "NHD" and isinstance(kv_cache, tuple)
    assert workspace_buffer.dtype == torch.uint8 and not workspace_buffer.any()
    for t in (block_tables, seq_lens, cum_seq_lens_q, cum_seq_lens_kv):
        assert t.dtype == torch.int32
    k_cache, v_cache = kv_cache
    page_size = k_cache.shape[1]
    assert block_tables.shape[0] == batch_size == seq_lens.shape[0] == cum_seq_lens_q.shape[0] - 1
    out = torch.empty_like(query) if out is None else out
    CallLog.trtllm_calls.append(dict(max_q_len=max_q_len, max_kv_len=max_kv_len, batch_size=batch_size))
    for b in range(batch_size):
        q0, q1 = int(cum_seq_lens_q[b]), int(cum_seq_lens_q[b + 1])
        kv = int(seq_lens[b])
        assert int(cum_seq_lens_kv[b + 1] - cum_seq_lens_kv[b]) == kv
        assert q1 - q0 <= max_q_len and kv <= max_kv_len and q1 - q0 <= kv
        if q1 == q0:
            continue
        pages = block_tables[b, :-(-kv // page_size)]
        o = _attend_row(query[q0:q1], _gather(k_cache, pages, kv), _gather(v_cache, pages, kv), bmm1_scale)
        out[q0:q1] = (o * bmm2_scale).to(out.dtype)
    return out


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", **_):
        assert kv_layout == "NHD"
        self._plan = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None, **_):
        assert causal
        last = paged_kv_last_page_len.cpu()
        assert bool(((last >= 1) & (last <= page_size)).all()), "last_page_len must lie in [1, page_size]"
        assert paged_kv_indptr.shape[0] == qo_indptr.shape[0] == last.shape[0] + 1
        assert int(paged_kv_indptr[-1]) == paged_kv_indices.shape[0]
        self._plan = (qo_indptr.cpu(), paged_kv_indptr.cpu(), paged_kv_indices.cpu(), last, page_size,
                      sm_scale if sm_scale is not None else head_dim_qk ** -0.5, num_qo_heads, num_kv_heads)
        CallLog.plans.append(dict(rows=last.shape[0]))

    def run(self, q, paged_kv_cache, out=None):
        qo, kv_indptr, indices, last, page_size, scale, hq, hkv = self._plan
        k_cache, v_cache = paged_kv_cache
        assert q.shape[0] == int(qo[-1]) and q.shape[1] == hq and k_cache.shape[2] == hkv
        out = torch.empty_like(q) if out is None else out
        for b in range(last.shape[0]):
            pages = indices[kv_indptr[b]:kv_indptr[b + 1]]
            kv = (pages.shape[0] - 1) * page_size + int(last[b])
            q0, q1 = int(qo[b]), int(qo[b + 1])
            o = _attend_row(q[q0:q1], _gather(k_cache, pages, kv), _gather(v_cache, pages, kv), scale)
            out[q0:q1] = o.to(out.dtype)
        return out


def install(monkeypatch) -> None:
    """Make ``import flashinfer.prefill`` resolve to this model for one test."""
    package = types.ModuleType("flashinfer")
    package.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.__spec__ = importlib.machinery.ModuleSpec("flashinfer.prefill", None)
    prefill.trtllm_batch_context_with_kv_cache = trtllm_batch_context_with_kv_cache
    prefill.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    package.prefill = prefill
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", prefill)
    CallLog.trtllm_calls, CallLog.plans = [], []

"""Sliding windows and attention sinks in every attention kernel: the torch reference, the fused
CPU kernel and the Triton kernel (Triton's interpreter, small shapes) against a per-query loop
written here from transformers' definitions (a query at position p sees keys p - W < j <= p, as
masking_utils.sliding_window_overlay; sinks as gpt-oss's eager_attention_forward: one logit per
head joins the softmax and is dropped), on the CP layouts' real metadata (zigzag blocks,
interleave's strided limits, cached prefixes, padding rows)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported anywhere

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.cp.metadata import interleave_metadata, zigzag_metadata
from graphcp.cp.strategy import make_strategy
from graphcp.kernels import torch_sdpa
from graphcp.kernels.flashinfer_attention import flashinfer_paged_attention, unsupported_reason
from graphcp.kernels.torch_ref import torch_paged_attention
from graphcp.kernels.torch_sdpa import torch_sdpa_attention

HQ = 4


def per_query(q, k_pool, v_pool, cu, page_rows, limits, page_size, scale, window, sinks):
    """Each query's visible keys (through the page table) in HF's eager softmax, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = HQ // k_pool.shape[1]
    for seq in range(len(cu) - 1):
        rows = torch.arange(int(cu[seq]), int(cu[seq + 1]))
        if not len(rows) or int(limits[rows].max()) == 0:
            continue
        lim = limits[rows][:, None]
        pos = torch.arange(int(lim.max()))
        seen = (pos < lim) & ((pos > lim - 1 - window) if window else True)      # [n, keys]
        slots = page_rows[seq][pos // page_size] * page_size + pos % page_size
        k = k_pool[slots].double().repeat_interleave(group, 1)                   # [keys, Hq, D]
        v = v_pool[slots].double().repeat_interleave(group, 1)
        logits = torch.einsum("nhd,khd->hnk", q[rows].double(), k) * scale
        logits = logits.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, len(rows), 1)
            logits = torch.cat([logits, sink], -1)
        probs = torch.softmax(logits, -1)[..., :len(pos)]
        out[rows] = torch.einsum("hnk,khd->nhd", probs, v)
    return out


def _layout(gen, strategy, cp, rank, extend, prefix, page_size, hkv, d, pad):
    extend_t, prefix_t = torch.tensor(extend), torch.tensor(prefix)
    kv = (extend_t + prefix_t).tolist()
    pages = max(1, max(-(-n // page_size) for n in kv))
    num_pages = 1 + len(kv) * pages + 2
    table = (torch.randperm(num_pages - 1, generator=gen)[:len(kv) * pages] + 1).view(len(kv), pages)
    shape = (num_pages * page_size, hkv, d)
    pools = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    local_cap = max(make_strategy(strategy, cp).per_rank_tokens(extend)) + pad
    make = zigzag_metadata if strategy == "zigzag" else interleave_metadata
    meta = make(extend_t, prefix_t, table, cp, rank, local_cap, page_size)
    q = torch.randn(local_cap, HQ, d, generator=gen)
    return q, pools, (meta.cu_seqlens_q, meta.page_rows, meta.q_limits)


def _run(kernel, q, pools, meta, page_size, window, sinks, workspace=None):
    cu, rows, limits = meta
    n = int(cu[-1])
    max_q, max_kv = int((cu[1:] - cu[:-1]).max()), int(limits[:n].max()) if n else 0
    out = torch.full_like(q, float("nan"))              # every row must be written, padding too
    kernel(q, *pools, cu, rows, limits, page_size, q.shape[-1] ** -0.5, max_q, max_kv, out,
           workspace=workspace, window=window, sinks=sinks)
    assert not torch.isnan(out).any() and torch.equal(out[n:], torch.zeros_like(out[n:]))
    return out


def _err(out, want) -> float:
    return float((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), strategy=st.sampled_from(["zigzag", "interleave"]),
       cp=st.sampled_from([1, 2, 3]), page_size=st.sampled_from([1, 4, 16]),
       extend=st.lists(st.integers(1, 150), min_size=1, max_size=3),
       prefix=st.lists(st.integers(0, 60), min_size=3, max_size=3),
       window=st.sampled_from([0, 1, 5, 16, 40]), sinks=st.booleans(), hkv=st.sampled_from([1, 4]))
def test_torch_kernels_match_per_query_attention(seed, strategy, cp, page_size, extend, prefix,
                                                 window, sinks, hkv):
    """The reference and the fused CPU kernel (its windowed row bands, its merged causal and
    residue parts with one sink each) on every rank's rows; some requests longer than the short
    batch cut-off, so both of the fused kernel's paths run."""
    gen = torch.Generator().manual_seed(seed)
    rank = seed % cp
    q, pools, meta = _layout(gen, strategy, cp, rank, extend, prefix[:len(extend)], page_size, hkv,
                             16, 2)
    sink = torch.randn(HQ, generator=gen) * 2 if sinks else None
    want = per_query(q, *pools, *meta, page_size, 0.25, window, sink)
    assert _err(_run(torch_paged_attention, q, pools, meta, page_size, window, sink), want) < 1e-5
    workspace: dict = {}
    for _ in range(2):          # a second layer reuses the plans in the workspace
        out = _run(torch_sdpa_attention, q, pools, meta, page_size, window, sink, workspace)
        assert _err(out, want) < 1e-5


def test_fused_kernel_reads_only_the_window(monkeypatch):
    """A 600-token request with a 32-token window: the fused kernel's calls together read at most
    (rows per block + W) keys per block of rows, not the whole causal triangle."""
    monkeypatch.setattr(torch_sdpa, "_SHORT_KV", 0)
    gen = torch.Generator().manual_seed(1)
    q, pools, meta = _layout(gen, "zigzag", 1, 0, [600], [0], 16, 2, 16, 0)
    keys, flash = [], torch_sdpa._flash
    monkeypatch.setattr(torch_sdpa, "_flash",
                        lambda *a, **k: keys.append(a[1].shape[2] * a[0].shape[2]) or flash(*a, **k))
    out = _run(torch_sdpa_attention, q, pools, meta, 16, 32, None)
    rows = torch_sdpa._MASKED_BLOCK_ROWS
    assert sum(keys) <= 600 * (rows + 32) and sum(keys) < 600 * 601 // 4
    assert _err(out, per_query(q, *pools, *meta, 16, 0.25, 32, None)) < 1e-5


@pytest.mark.parametrize("strategy,cp,window,sinks,dtype", [
    ("zigzag", 1, 0, True, torch.float32),
    ("zigzag", 2, 20, False, torch.float32),
    ("interleave", 2, 9, True, torch.float32),
    ("zigzag", 1, 21, True, torch.bfloat16),
])
def test_triton_kernel_matches_per_query_attention(strategy, cp, window, sinks, dtype):
    """The Triton kernel in the interpreter: windows smaller and larger than its 16-key blocks, a
    cached prefix, sinks in fp32 beside bf16 queries."""
    pytest.importorskip("triton")
    from graphcp.kernels.triton_attention import triton_paged_attention
    gen = torch.Generator().manual_seed(window)
    q, pools, meta = _layout(gen, strategy, cp, cp - 1, [37, 11], [19, 0], 4, 2, 64, 3)
    sink = torch.randn(HQ, generator=gen) if sinks else None
    want = per_query(q, *pools, *meta, 4, 0.125, window, sink)
    q, pools = q.to(dtype), tuple(p.to(dtype) for p in pools)
    out = _run(triton_paged_attention, q, pools, meta, 4, window, sink)
    assert _err(out, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_flashinfer_refuses_windows_and_sinks(monkeypatch):
    """graphcp's flashinfer glue is given neither: the registry says so (attention.build then
    picks another kernel for those layers) and a call with either raises instead of ignoring it."""
    from graphcp.kernels import flashinfer_attention
    monkeypatch.setattr(flashinfer_attention, "flashinfer_installed", lambda: True)
    cuda = torch.device("cuda")
    assert unsupported_reason(cuda, torch.bfloat16, 64, True) is None
    why = unsupported_reason(cuda, torch.bfloat16, 64, True, window_or_sinks=True)
    assert "sliding windows or attention sinks" in why
    q = torch.zeros(2, HQ, 64)
    with pytest.raises(ValueError, match="sliding window or attention sinks"):
        flashinfer_paged_attention(q, q, q, torch.tensor([0, 2]), torch.zeros(1, 1), torch.tensor([1, 2]),
                                   16, 0.1, 2, 2, q, window=4)

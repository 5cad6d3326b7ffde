"""The fused-SDPA CPU kernel against the torch oracle on random paged batches: cached prefixes,
zigzag's early and late blocks, interleave's strided limits, GQA, empty sequences, padding rows."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.engines import cp_kwargs
from testkit.parity import Session, random_ids

from graphcp.cp.metadata import interleave_metadata, zigzag_metadata
from graphcp.cp.strategy import make_strategy
from graphcp.kernels import torch_sdpa
from graphcp.kernels.registry import kernel_fn
from graphcp.kernels.torch_ref import torch_paged_attention
from graphcp.kernels.torch_sdpa import torch_sdpa_attention

HQ, D = 4, 32
VOCAB = 211                 # the suite checkpoint's (tests/testkit/hf_reference.py)
SCALE = D ** -0.5


@pytest.fixture
def fused_path_always(monkeypatch):
    """Kernel tests' batches are short: send them through the fused path, not the short-batch
    fallback (engine tests use requests past it instead: rank processes do not see a patch)."""
    monkeypatch.setattr(torch_sdpa, "_SHORT_KV", 0)


pytestmark = pytest.mark.usefixtures("fused_path_always")


def _pools(gen: torch.Generator, kv_lens: list[int], rows: int, page_size: int, hkv: int):
    """Shuffled distinct pages per row (page 0 stays the dummy) and random K/V pools."""
    pages = max(1, max(-(-kv // page_size) for kv in kv_lens))
    num_pages = 1 + rows * pages + 2
    table = (torch.randperm(num_pages - 1, generator=gen)[: rows * pages] + 1).view(rows, pages)
    shape = (num_pages * page_size, hkv, D)
    return table, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _run(kernel, q, pools, cu, page_rows, limits, page_size,
         out=None, workspace=None):
    n = int(cu[-1])
    max_q, max_kv = int((cu[1:] - cu[:-1]).max()), int(limits[:n].max()) if n else 0
    out = torch.empty_like(q) if out is None else out
    return kernel(q, *pools, cu, page_rows, limits, page_size, SCALE, max_q, max_kv, out,
                  workspace=workspace)


def _check(q, pools, cu, page_rows, limits, page_size, workspace=None) -> float:
    n = int(cu[-1])
    ref = _run(torch_paged_attention, q, pools, cu, page_rows, limits, page_size)
    out = torch.full_like(q, float("nan"))          # every row must be written, padding included
    res = _run(torch_sdpa_attention, q, pools, cu, page_rows, limits, page_size, out, workspace)
    assert res is out and not torch.isnan(out).any()
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zero"
    err = (out - ref).abs().max().item()
    assert err <= 2e-6 * max(1.0, ref.abs().max().item()), f"max abs error {err}"
    return err


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), strategy=st.sampled_from(["zigzag", "interleave"]),
       cp=st.sampled_from([1, 2, 3, 4]), group=st.sampled_from([1, 2, 4]),
       page_size=st.sampled_from([1, 4, 16]),
       extend=st.lists(st.integers(0, 90), min_size=1, max_size=5),
       prefix=st.lists(st.integers(0, 70), min_size=5, max_size=5), pad=st.integers(0, 5))
def test_cp_layouts_match_reference(seed, strategy, cp, group, page_size, extend, prefix, pad):
    """Every rank's batch as the CP metadata lays it out: zigzag's 2R sequences (empty ones too) and
    interleave's per-request strided limits, with cached prefixes and padding rows at the end."""
    gen = torch.Generator().manual_seed(seed)
    extend_t = torch.tensor(extend)
    if int(extend_t.sum()) == 0:
        extend_t[0] = 1
    prefix_t = torch.tensor(prefix[: len(extend)]) * (extend_t > 0)
    kv = (extend_t + prefix_t).tolist()
    table, *pools = _pools(gen, kv, len(kv), page_size, HQ // group)
    # the fullest rank's rows (zigzag's remainders can put several more on one rank), one padding row
    local_cap = max(make_strategy(strategy, cp).per_rank_tokens(extend_t.tolist())) + 1 + pad
    make = zigzag_metadata if strategy == "zigzag" else interleave_metadata
    for rank in range(cp):
        meta = make(extend_t, prefix_t, table, cp, rank, local_cap, page_size)
        q = torch.randn(local_cap, HQ, D, generator=gen)
        _check(q, pools, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), q_lens=st.lists(st.integers(0, 300), min_size=1, max_size=4),
       group=st.sampled_from([1, 2]), page_size=st.sampled_from([1, 16]), pad=st.integers(0, 4))
def test_any_nondecreasing_limits_match_reference(seed, q_lens, group, page_size, pad):
    """The contract's general case: any limits that never decrease within a sequence (runs of
    causal steps, jumps, repeats), long enough to span several masked row blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = []
    for n in q_lens:
        steps = torch.randint(0, 4, (n,), generator=gen) * (torch.rand(n, generator=gen) < 0.5)
        first = torch.randint(1, 40, (1,), generator=gen)
        per_seq.append((first + torch.cumsum(steps, 0)).tolist())
    kv = [max(lim, default=0) for lim in per_seq]
    table, *pools = _pools(gen, kv, len(kv), page_size, HQ // group)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist())
    if int(cu[-1]) == 0:
        return
    q = torch.randn(int(cu[-1]) + pad, HQ, D, generator=gen)
    limits = torch.tensor([x for lim in per_seq for x in lim] + [0] * pad)
    _check(q, pools, cu, table, limits, page_size)


def test_same_shape_sequences_share_calls_and_workspace(monkeypatch):
    """Equal requests (the bench's NxL batches) run as one batched call per part, and a second
    layer of the same forward reuses the plan from the workspace."""
    gen = torch.Generator().manual_seed(0)
    q_lens, prefix, page_size = [64, 64, 64, 40], [0, 0, 0, 24], 16
    kv = [p + n for p, n in zip(prefix, q_lens)]
    table, *pools = _pools(gen, kv, 4, page_size, 2)
    cu = torch.tensor([0, 64, 128, 192, 232])
    limits = torch.tensor([k - n + i + 1 for n, k in zip(q_lens, kv) for i in range(n)] + [0] * 3)
    q = torch.randn(235, HQ, D, generator=gen)
    calls, plans, flash, plan = [], [], torch_sdpa._flash, torch_sdpa._plan
    monkeypatch.setattr(torch_sdpa, "_flash",
                        lambda *a, **k: calls.append(a[0].shape) or flash(*a, **k))
    monkeypatch.setattr(torch_sdpa, "_plan", lambda *a: plans.append(1) or plan(*a))
    workspace: dict = {}
    for _ in range(2):
        _check(q, pools, cu, table, limits, page_size, workspace)
    # per layer: the 3 equal sequences in one causal call; the prefixed one causal + prefix
    assert sorted(tuple(s) for s in calls[:3]) == [(1, HQ, 40, D), (1, HQ, 40, D), (3, HQ, 64, D)]
    assert len(calls) == 6 and len(plans) == 1


@pytest.mark.parametrize("prefix", [0, 37])
def test_cp1_zigzag_blocks_join_into_one_causal_call(monkeypatch, prefix):
    """At CP 1 zigzag splits a request into an early and a late block; on one page-table row, limits
    stepping on by one, they are one sequence: one causal call (and one over a cached prefix),
    reading consecutive pages as a view of the pool."""
    gen = torch.Generator().manual_seed(3)
    extend, page_size = 201, 16
    pages = -(-(extend + prefix) // page_size)
    table = torch.arange(1, 1 + pages)[None]                      # consecutive pages
    shape = ((2 + pages) * page_size, 2, D)
    pools = [torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)]
    meta = zigzag_metadata(torch.tensor([extend]), torch.tensor([prefix]), table, 1, 0, extend + 3,
                           page_size)
    assert meta.cu_seqlens_q.tolist() == [0, 101, 201]
    calls, flash = [], torch_sdpa._flash
    monkeypatch.setattr(torch_sdpa, "_flash", lambda *a, **k: calls.append(1) or flash(*a, **k))
    q = torch.randn(extend + 3, HQ, D, generator=gen)
    _check(q, pools, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size)
    assert len(calls) == (2 if prefix else 1)
    _, _, groups = torch_sdpa._plan(meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size)
    assert groups[0].slots == slice(page_size, page_size + extend + prefix)


@pytest.mark.parametrize("pages,extend,read", [
    ("shuffled", 96, "indexed"), ("in order", 96, "one slice"), ("in order", 90, "a slice each"),
    ("rows swapped", 96, "a slice each")])
def test_cp1_requests_join_across_rows_into_one_batched_call(monkeypatch, pages, extend, read):
    """Two equal requests at CP 1: rows hold both early blocks, then both late blocks; each
    request's two blocks join (rows apart) and the two requests share one causal call. Their K/V
    are gathered from shuffled pages; read in place as one slice from pages allocated in order;
    and as a slice per request where only each request's pages are in order, or where the first
    request's last page is partly filled (90 keys on pages of 16), which puts its slots and the
    next one's apart."""
    gen = torch.Generator().manual_seed(5)
    page_size, half = 16, extend // 2
    table, *pools = _pools(gen, [extend, extend], 2, page_size, 2)
    if pages != "shuffled":
        table = torch.arange(1, 1 + table.numel()).view(table.shape)
    if pages == "rows swapped":
        table = table.flip(0)
    meta = zigzag_metadata(torch.tensor([extend, extend]), torch.tensor([0, 0]), table, 1, 0,
                           2 * extend + 2, page_size)
    assert meta.cu_seqlens_q.tolist() == [0, half, 2 * half, 3 * half, 4 * half]
    calls, flash = [], torch_sdpa._flash
    monkeypatch.setattr(torch_sdpa, "_flash",
                        lambda *a, **k: calls.append(tuple(a[0].shape)) or flash(*a, **k))
    q = torch.randn(2 * extend + 2, HQ, D, generator=gen)
    _check(q, pools, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size)
    assert calls == [(2, HQ, extend, D)]
    _, _, groups = torch_sdpa._plan(meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size)
    slots = groups[0].slots
    form = ("one slice" if isinstance(slots, slice) else
            "a slice each" if isinstance(slots, list) else "indexed")
    assert form == read and groups[0].seqs == 2


@pytest.mark.parametrize("stride", [2, 4])
def test_strided_limits_and_blind_rows(stride):
    """Limits stepping by one stride (interleave's) take the residue-class call; the same with one
    jump takes masked row blocks (more rows than one block); a sequence whose queries see no key
    (limit 0) gets zero rows, as do the padding rows, and no call gets an empty key range (the CPU
    flash kernel dies on one)."""
    gen = torch.Generator().manual_seed(stride)
    n, page_size = 3 * torch_sdpa._MASKED_BLOCK_ROWS + 5, 16
    even = (torch.arange(n) * stride + 7).tolist()
    jump = [x + 5 * (i >= n // 2) for i, x in enumerate(even)]
    table, *pools = _pools(gen, [jump[-1], jump[-1], 1], 3, page_size, 2)
    cu = torch.tensor([0, n, 2 * n, 2 * n + 3])
    limits = torch.tensor(even + jump + [0, 0, 0, 0, 0])
    q = torch.randn(2 * n + 5, HQ, D, generator=gen)
    _, blind, groups = torch_sdpa._plan(cu, table, limits, page_size)
    assert blind and [b.stride for b in groups[0].blocks] == [stride]
    assert len(groups[1].blocks) == 4 and all(b.limits is not None for b in groups[1].blocks)
    out = torch.full_like(q, float("nan"))
    _run(torch_sdpa_attention, q, pools, cu, table, limits, page_size, out)
    assert torch.equal(out[2 * n:], torch.zeros_like(out[2 * n:]))
    ref = _run(torch_paged_attention, q[:2 * n], pools, cu[:3], table[:2], limits[:2 * n],
               page_size)
    assert (out[:2 * n] - ref).abs().max().item() <= 2e-6


def test_bfloat16_matches_fp32_reference():
    gen = torch.Generator().manual_seed(2)
    kv, q_len, page_size = 300, 120, 16
    table, *pools = _pools(gen, [kv], 1, page_size, 2)
    q = torch.randn(q_len, HQ, D, generator=gen)
    cu, limits = torch.tensor([0, q_len]), torch.arange(kv - q_len + 1, kv + 1)
    ref = _run(torch_paged_attention, q, pools, cu, table, limits, page_size)
    low = [p.to(torch.bfloat16) for p in pools]
    out = _run(torch_sdpa_attention, q.to(torch.bfloat16), low, cu, table, limits, page_size)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max().item() <= 3e-2


def test_short_batches_take_one_padded_reference_call(monkeypatch):
    """Below the crossover the reference kernel's padded call serves (fewer host ops than a fused
    call per shape); above it, the fused kernel."""
    monkeypatch.setattr(torch_sdpa, "_SHORT_KV", 128)
    gen = torch.Generator().manual_seed(4)
    calls, flash = [], torch_sdpa._flash
    monkeypatch.setattr(torch_sdpa, "_flash", lambda *a, **k: calls.append(1) or flash(*a, **k))
    for kv, fused in ((128, False), (129, True)):
        table, *pools = _pools(gen, [kv, 50], 2, 16, 2)
        q_lens = [kv - 7, 50]
        cu = torch.tensor([0, q_lens[0], sum(q_lens)])
        limits = torch.tensor([k - n + i + 1 for n, k in zip(q_lens, [kv, 50]) for i in range(n)])
        q = torch.randn(sum(q_lens), HQ, D, generator=gen)
        calls.clear()
        _check(q, pools, cu, table, limits, 16)
        assert bool(calls) == fused


@pytest.mark.parametrize("cp,strategy", [(2, "zigzag"), (2, "interleave")])
def test_engine_long_requests_match_hf(checkpoint, engines, oracle, cp, strategy):
    """Requests past the short-batch cut through the engine's ranks (zigzag's two blocks per rank,
    interleave's strided limits), fresh and then extending their cached prefixes, against HF."""
    extra = {} if strategy == "zigzag" else {"attention_backend": "auto"}
    engine = engines.get(checkpoint, **cp_kwargs(cp, strategy, **extra))
    assert engine.stats()["attention_kernel"] == "torch"
    s = Session(engine, oracle, checkpoint)
    s.run([("long", random_ids(230, VOCAB, 1)), ("mid", random_ids(140, VOCAB, 2)),
           ("short", random_ids(9, VOCAB, 3))])
    out = s.run([("long", random_ids(70, VOCAB, 4)), ("mid", random_ids(31, VOCAB, 5))])
    assert out.cp_applied is True
    s.release_all()


def test_registry_serves_it_as_the_torch_kernel():
    assert kernel_fn("torch", torch.device("cpu")) == (torch_sdpa_attention, False)

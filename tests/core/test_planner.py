"""The planner on its own, without processes: page accounting, DP assignment, graph-or-eager decisions,
and transactions that leave no trace when rolled back."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp import Request, RequestError
from graphcp.cp.strategy import make_strategy
from graphcp.planner import Planner

VOCAB = 100


def planner(cp: int = 1, dp: int = 1, pages: int = 17, page_size: int = 4, context: int = 40,
            strategy: str = "zigzag", max_requests: int = 4) -> Planner:
    return Planner(make_strategy(strategy, cp), cp, dp, 0, VOCAB, pages, page_size, context, max_requests)


def reqs(*lens: int, prefix: str = "r") -> list[Request]:
    return [Request(f"{prefix}{i}", [i % VOCAB] * n) for i, n in enumerate(lens)]


def snapshot(p: Planner) -> list:
    return [(t.free_pages, {rid: (st.pages.tolist(), st.cached_len) for rid, st in t.requests.items()})
            for t in p.dp_pages]


def test_pages_allocate_commit_extend_release():
    p = planner()
    assert p.tokens_total == 16 * 4 and p.tokens_free == 64
    plan = p.plan(reqs(5, 3))
    p.commit(p.allocate(plan))
    assert p.pages.requests["r0"].pages.tolist() == [1, 2] and p.pages.requests["r1"].pages.tolist() == [3]
    assert p.pages.prefix_len("r0") == 5 and p.tokens_free == 64 - 12
    plan = p.plan([Request("r0", [1, 2, 3, 4])])          # extends r0: 9 tokens need a third page
    assert plan.prefix_lens == [5] and plan.extend_lens == [4]
    p.commit(p.allocate(plan))
    assert p.pages.requests["r0"].pages.tolist() == [1, 2, 4] and p.pages.prefix_len("r0") == 9
    assert p.slots("r0").tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16]
    p.release("r0")
    p.release("r1")
    assert p.tokens_free == 64 and not p.pages.requests
    with pytest.raises(RequestError, match="unknown"):
        p.release("r0")


def test_rollback_restores_every_table_exactly():
    p = planner(dp=2)
    p.commit(p.allocate(p.plan(reqs(6, 7, prefix="old"))))
    before = snapshot(p)
    txn = p.allocate(p.plan(reqs(9, 2, 5) + [Request("old0", [1] * 3)]))
    assert snapshot(p) != before
    p.rollback(txn)
    assert snapshot(p) == before


def test_refused_batch_changes_nothing():
    p = planner(context=40)
    p.commit(p.allocate(p.plan(reqs(30))))
    before = snapshot(p)
    with pytest.raises(RequestError, match="context limit"):
        p.plan([Request("r0", [1] * 11)])                   # 30 + 11 > 40
    with pytest.raises(RequestError, match="only .* are free"):
        p.plan(reqs(40, prefix="big"))                      # 10 pages, 8 free
    with pytest.raises(RequestError, match="twice"):
        p.plan([Request("x", [1]), Request("x", [2])])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        p.plan([Request("y", [VOCAB])])
    # the serving path's tensors: an empty one, a 2-D one, a float one (caught per request)
    for bad, why in ((torch.zeros(0, dtype=torch.long), "empty"),
                     (torch.zeros(1, 2, dtype=torch.long), "flat"),
                     (torch.zeros(2), "flat")):
        with pytest.raises(RequestError, match=f"'t1'.*{why}"):
            p.plan([Request("t0", torch.ones(3, dtype=torch.long)), Request("t1", bad)])
    assert snapshot(p) == before


def test_dp_assignment_balances_new_tokens_and_keeps_owners():
    p = planner(dp=2)
    assert p.assign_dp(["a", "b", "c", "d", "e"], [10, 3, 4, 5, 2]) == [0, 1, 1, 1, 0]
    plan = p.plan(reqs(10, 3, 4, 5, 2))
    assert plan.dp_groups == [0, 1, 1, 1, 0] and plan.indices == [0, 4] and plan.rids == ["r0", "r4"]
    p.commit(p.allocate(plan))
    assert set(p.dp_pages[1].requests) == {"r1", "r2", "r3"}   # the mirror of the other group's table
    assert p.owner("r2") == 1 and p.slots("r2") is None      # held by the other group
    # A request extends in the group that holds its KV, whatever the load says.
    assert p.assign_dp(["r2", "new"], [50, 1]) == [1, 0]


def test_graph_decisions():
    p = planner(cp=2, context=200, pages=101)
    buckets = [8, 16, 32]
    plan = p.plan(reqs(20, 12), buckets=buckets)
    assert plan.cp_applied and plan.per_rank_tokens == [16, 16] and plan.bucket == 16
    plan = p.plan(reqs(20, 3), buckets=buckets)             # 3 < 2C: the batch runs unsharded
    assert not plan.cp_applied and plan.bucket is None and "zigzag needs" in plan.eager_reason
    assert plan.per_rank_tokens == [23, 23] and plan.local_cap == 23
    plan = p.plan(reqs(8, 8, 8, 8, 8), buckets=buckets)
    assert plan.bucket is None and "capacity of 4" in plan.eager_reason
    plan = p.plan(reqs(20), buckets=buckets, failures={16: "boom"})
    assert plan.bucket is None and "failed to capture: boom" in plan.eager_reason
    plan = p.plan(reqs(20), buckets=buckets, force_eager=True)
    assert plan.bucket is None and "force_eager" in plan.eager_reason
    plan = p.plan(reqs(20), buckets=buckets, graph_reason="pp_size > 1")
    assert plan.eager_reason == "pp_size > 1"


def test_interleave_pads_to_the_widest_rank():
    p = planner(cp=4, strategy="interleave", context=200, pages=101)
    plan = p.plan(reqs(5, 3))
    assert plan.cp_applied and plan.per_rank_tokens == [2, 2, 2, 2] and plan.local_cap == 4
    plan = p.plan(reqs(5, 4))
    assert plan.per_rank_tokens == [3, 2, 2, 2] and plan.local_cap == 4


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_dummy_batches_fill_their_bucket(strategy, cp):
    s = make_strategy(strategy, cp)
    for bucket in (8, 16, 64, 256):
        bucket = s.aligned(bucket)
        for seed in range(5):
            ext, prefix = s.dummy_batch(bucket, 8, 512, seed)
            assert len(ext) <= 8 and min(ext) >= s.min_request_len and max(ext) <= 512
            assert s.layout(ext, prefix, 0).local_cap <= bucket and all(0 <= p <= 64 for p in prefix)
    assert s.dummy_batch(s.aligned(4096), 2, 64, 0) is None   # two 64-token requests cannot fill it


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(1, 70), st.integers(0, 30)), min_size=1, max_size=6))
def test_zigzag_counts_and_maxima_match_the_blocks(cp, batch):
    """The serving path's one-pass counts and host maxima, against each request's 2C blocks."""
    ext, pre = [e for e, _ in batch], [p for _, p in batch]
    if min(ext) < 2 * cp and cp > 1:
        ext = [e + 2 * cp for e in ext]
    strategy = make_strategy("zigzag", cp)
    blocks = [[n // (2 * cp) + (b < n % (2 * cp)) for b in range(2 * cp)] for n in ext]
    for rank in range(cp):
        counts, host = strategy.counts_and_maxima(ext, pre, rank)
        assert counts == [sum(k[r] + k[2 * cp - 1 - r] for k in blocks) for r in range(cp)]
        assert host.early_rows == sum(k[rank] for k in blocks)
        assert host.max_q == max(max(k) for k in blocks)
        assert host.max_kv == max(p + n for p, n in zip(pre, ext))
        plan = strategy.layout(ext, pre, rank)
        assert plan.per_rank_tokens == counts and plan.host == host


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=5), st.integers(0, 3), st.booleans())
def test_page_check_fresh_and_cached_paths_agree(lens, spare, cached):
    """Fresh requests only (checked by C-level maps) or with a cached one (checked per request): a
    batch fits exactly when its pages are free, and the prefixes come back."""
    page_size, need = 4, sum(-(-n // 4) for n in lens)
    p = planner(pages=need + spare + 1 + (2 if cached else 0), page_size=page_size, context=40)
    batch = reqs(*lens)
    if cached:                          # 5 tokens in 2 pages; 3 more fit them without a new page
        p.commit(p.allocate(p.plan([Request("old", [1] * 5)])))
        batch.append(Request("old", [2] * 3))
    plan = p.plan(batch)
    assert plan.prefix_lens == [0] * len(lens) + ([5] if cached else [])
    p.rollback(p.allocate(plan))
    before = snapshot(p)
    with pytest.raises(RequestError, match="KV tokens"):
        p.plan(batch + [Request("extra", [1] * (page_size * (spare + 1)))])
    with pytest.raises(RequestError, match="'long': 41 tokens exceed the context limit of 40"):
        p.plan(batch + [Request("long", [1] * 41)])
    assert snapshot(p) == before

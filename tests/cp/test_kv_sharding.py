"""KV sequence sharding (``--enable-kv-cache-sharding``): the ownership arithmetic (a bijection
onto the ranks' pools, balanced within one page), and engines over real gloo ranks equal to HF
(logits and the gathered cache) at CP 2 and 4 in both layouts, in chunked prefill over a sharded
prefix, zigzag in graphs, with the group's capacity C x one rank's pool serving a request longer
than one rank's pool; release and a refused batch leave every rank's pages as they should."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from testkit.engines import cp_kwargs
from testkit.parity import Session, random_ids

from graphcp import ConfigError, EngineArgs, RequestError
from graphcp.kv.pages import PageTable
from graphcp.kv.sharding import PrefixPlan, group_pages, local_page, owned_slots, page_owner

VOCAB = 211
POOL = 256            # --max-total-tokens: one rank's pool (16 pages of 16)
PAGE = 16


# -- ownership arithmetic --------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_pages_map_one_to_one_onto_the_ranks_pools(cp):
    local = 7                                     # each rank: 6 pages + its dummy page
    pages = np.arange(1, group_pages(local, cp))
    assert len(pages) == cp * (local - 1)
    homes = set(zip(page_owner(pages, cp).tolist(), local_page(pages, cp).tolist()))
    assert homes == {(c, p) for c in range(cp) for p in range(1, local)}   # each stored once
    for start in range(1, len(pages)):            # any run of consecutive pages: within one page
        for n in range(1, len(pages) - start + 2):
            counts = np.bincount(page_owner(np.arange(start, start + n), cp), minlength=cp)
            assert counts.max() - counts.min() <= 1


def test_allocation_rotates_so_every_rank_holds_within_one_page():
    """Requests of odd page counts from the page table: each request's pages and the group's totals
    stay balanced within one page; releasing one hands the same pages out again."""
    cp, rng = 4, np.random.default_rng(0)
    table = PageTable(group_pages(65, cp), PAGE, 64 * cp * PAGE)
    total = np.zeros(cp, dtype=int)
    for i in range(20):
        n = int(rng.integers(1, 8)) * PAGE - int(rng.integers(0, PAGE))
        (added,) = table.allocate([f"r{i}"], [n])
        table.commit([f"r{i}"], [n])
        counts = np.bincount(page_owner(added, cp), minlength=cp)
        total += counts
        assert counts.max() - counts.min() <= 1 and total.max() - total.min() <= 1
    table.release("r3")
    (again,) = table.allocate(["s"], [len(table.requests["r4"].pages) * PAGE])
    assert len(again)


def test_owned_slots_send_other_ranks_rows_to_the_dummy_slot():
    cp, ps = 2, 4
    slots = torch.tensor([0, 4, 7, 8, 11, 12, 21])        # dummy, pages 1, 1, 2, 2, 3, 5
    for rank in range(cp):
        local, owned = owned_slots(slots, ps, cp, rank)
        page = slots // ps
        want = [bool(p) and (p - 1) % cp == rank for p in page.tolist()]
        assert owned.tolist() == want
        for s, mine, o in zip(slots.tolist(), local.tolist(), want):
            assert mine == (((s // ps - 1) // cp + 1) * ps + s % ps if o else 0)


def test_prefix_plan_moves_each_cached_page_from_its_owner():
    """Request 0 has 5 cached tokens (pages 9 and 3), request 1 none, request 2 4 (page 6)."""
    rows = [np.array([9, 3, 4]), np.array([5]), np.array([6, 8])]
    plans = [PrefixPlan(rows, [5, 0, 4], 4, 2, r, torch.device("cpu")) for r in range(2)]
    assert plans[0].per_rank == [2, 1] and plans[0].width == 2
    assert plans[0].dest.tolist() == [9, 3, 6, 0]          # rank 0 owns 9 and 3, rank 1 page 6
    assert plans[0].send.tolist() == [5, 2]                 # their pages in rank 0's pool
    assert plans[1].send.tolist() == [3, 0]                 # page 6 on rank 1, padded


def test_flag_refuses_what_it_does_not_shard(checkpoint):
    base = dict(model_path=checkpoint, enable_kv_cache_sharding=True)
    with pytest.raises(ConfigError, match="--enable-kv-cache-sharding"):
        EngineArgs(**base)                                   # no CP group
    for extra in (dict(pp_size=2), dict(enable_adaptive_cp=True)):
        with pytest.raises(ConfigError, match="--enable-kv-cache-sharding"):
            EngineArgs(**base, **cp_kwargs(2), **extra)
    # SGLang's PD protocol serves it (tests/pd/test_sglang_pd.py)
    EngineArgs(**base, **cp_kwargs(2), disaggregation_mode="prefill",
               disaggregation_bootstrap_port=8998)
    args = EngineArgs.from_cli(["--model-path", checkpoint, "--tp", "2", "--attn-cp-size", "2",
                                "--enable-prefill-cp", "--cp-strategy", "zigzag",
                                "--enable-kv-cache-sharding"])
    assert args.enable_kv_cache_sharding
    from graphcp.checkpoint.config import check_sharded_kinds
    with pytest.raises(ConfigError, match="--enable-kv-cache-sharding.*gated_deltanet"):
        check_sharded_kinds(types.SimpleNamespace(attention_kinds=["gqa", "gated_deltanet"]))


# -- engines ---------------------------------------------------------------------------------------
def sharded(cp: int, strategy: str, **extra) -> dict:
    return cp_kwargs(cp, strategy, enable_kv_cache_sharding=True, max_total_tokens=POOL,
                     page_size=PAGE, **extra)


CASES = [(2, "zigzag"), (2, "interleave"), (4, "zigzag"), (4, "interleave")]


@pytest.mark.parametrize("cp,strategy", CASES, ids=[f"cp{c}-{s}" for c, s in CASES])
def test_sharded_cache_matches_hf(checkpoint, engines, oracle, cp, strategy):
    graphs = strategy == "zigzag"
    engine = engines.get(checkpoint, **sharded(cp, strategy, cuda_graph_buckets=[64, 128]))
    stats = engine.stats()
    assert stats["kv_tokens_total"] == cp * POOL == stats["kv_tokens_free"]   # the group's capacity
    assert stats["kv_pages_used_per_rank"] == [0] * cp
    s = Session(engine, oracle, checkpoint)
    out = s.run([("a", random_ids(150, VOCAB, 1)), ("b", random_ids(45, VOCAB, 2))])
    assert out.cp_applied and out.mode == ("graph" if graphs else "eager"), out.eager_reason
    # Chunked prefill over the sharded prefix: "a" grows past one rank's pool (256 tokens).
    out = s.run([("a", random_ids(130, VOCAB, 3)), ("c", random_ids(33, VOCAB, 4))])
    assert out.cp_applied and out.mode == ("graph" if graphs else "eager"), out.eager_reason
    s.run([("b", random_ids(9, VOCAB, 5))])                     # a short chunk over a prefix
    used = engine.stats()["kv_pages_used_per_rank"]
    assert sum(used) == 18 + 4 + 3 and max(used) - min(used) <= len(s.history)   # a 280, b 54, c 33
    assert engine.stats()["kv_prefix_gathered_bytes"] > 0
    # A batch the group cannot hold is refused whole: nothing allocated on any rank.
    with pytest.raises(RequestError, match="'big'"):
        engine.prefill([_request("d", 40), _request("big", cp * POOL)])
    assert engine.stats()["kv_pages_used_per_rank"] == used
    s.release_all()
    after = engine.stats()
    assert after["kv_pages_used_per_rank"] == [0] * cp and after["kv_tokens_free"] == cp * POOL
    print(f"cp{cp} {strategy}: worst rel err {s.worst:.2e}")


def test_sharded_with_attention_tp2_matches_hf(checkpoint, engines, oracle):
    """--tp 4 --attn-cp-size 2: each CP group of one attention-TP rank shards its heads' pages."""
    flags = sharded(2, "zigzag", cuda_graph_buckets=[64, 128]) | dict(tp_size=4)
    engine = engines.get(checkpoint, **flags)
    s = Session(engine, oracle, checkpoint)
    out = s.run([("a", random_ids(150, VOCAB, 1)), ("b", random_ids(45, VOCAB, 2))])
    out = s.run([("a", random_ids(130, VOCAB, 3))])
    assert out.cp_applied and out.mode == "graph", out.eager_reason
    s.release_all()
    assert engine.stats()["kv_pages_used_per_rank"] == [0] * 4


def _request(rid: str, n: int):
    from graphcp import Request
    return Request(rid, random_ids(n, VOCAB, 99))


def test_capacity_is_cp_times_one_ranks_pool(checkpoint, engines):
    one = engines.get(checkpoint, max_total_tokens=POOL, page_size=PAGE)      # in-process, one rank
    group = engines.get(checkpoint, **sharded(2, "zigzag", cuda_graph_buckets=[64, 128]))
    assert group.stats()["kv_tokens_total"] == 2 * one.stats()["kv_tokens_total"]
    with pytest.raises(RequestError):                          # one rank cannot hold 300 tokens
        one.prefill([_request("long", 300)])
    out = group.prefill([_request("long", 300)])
    assert out.logits.shape[0] == 1
    group.release("long")


def test_memory_plan_shows_the_group_capacity(checkpoint, engines):
    """``graphcp memory`` from config.json: the pool per rank (its KV bytes per token include the
    scratch layer), the group's C x as many tokens; a real sharded engine sizes itself the same."""
    from graphcp.memory import memory_report
    from graphcp.tools.memory import format_report
    flags = dict(gpu_memory_gib=0.003, mem_fraction_static=0.5, cuda_graph_buckets=[64, 128])
    plain = memory_report(EngineArgs(model_path=checkpoint, **cp_kwargs(2), **flags), "cpu", 0.003)
    derived = sharded(2, "zigzag", **flags) | dict(max_total_tokens=None)
    args = EngineArgs(model_path=checkpoint, **derived)
    report = memory_report(args, "cpu", 0.003)
    rank, one = report.ranks[0], plain.ranks[0]
    layer_bytes = one.kv_bytes_per_token // 2                  # 2 layers alike
    assert rank.kv_bytes_per_token == one.kv_bytes_per_token + 2 * layer_bytes
    assert rank.group_kv_tokens == 2 * rank.max_total_tokens == rank.max_context
    assert rank.max_total_tokens < one.max_total_tokens      # 2 layers: the scratch is a whole pool
    assert f"the group holds {rank.group_kv_tokens} tokens" in format_report(report)
    engine = engines.get(checkpoint, **derived)
    pages = -(-rank.max_total_tokens // PAGE)
    assert engine.stats()["kv_tokens_total"] == 2 * pages * PAGE
    # graphcp bench --kv-sharding counts the prefix bytes the engine moves (a fresh engine's pages)
    from graphcp.tools.shard_bench import gathered_per_layer, layer_bytes, report
    before = engine.stats()["kv_prefix_gathered_bytes"]
    engine.prefill([_request("p", 100)])
    engine.prefill([_request("p", 40)])
    moved = (engine.stats()["kv_prefix_gathered_bytes"] - before) // 2          # per layer
    # 7 prefix pages: 4 from the busier owner, from each rank, 512 B/token a layer
    assert moved == gathered_per_layer(args, 100, 40, layer_bytes(args))["prefix"]
    assert moved == 2 * 4 * PAGE * 512
    engine.release("p")
    bench = report(args, [4096, 65536], 2048, 0.003)
    assert bench["capacity"]["sharded"]["group_tokens"] == rank.group_kv_tokens
    assert [r["sharded_bytes"] > r["unsharded_bytes"] for r in bench["rows"]] == [True, True]


def test_rollback_gives_every_rank_its_pages_back():
    """A failed batch's pages return to the stack in order: every rank's count is as before, and the
    next batch gets the same pages (the same owners)."""
    cp = 2
    table = PageTable(group_pages(17, cp), PAGE, 16 * cp * PAGE)
    table.allocate(["a"], [3 * PAGE])
    table.commit(["a"], [3 * PAGE])
    before = table.tokens_free
    added = table.allocate(["a", "b"], [2 * PAGE, 5 * PAGE])
    table.rollback(["a", "b"], added)
    assert table.tokens_free == before and "b" not in table.requests
    assert len(table.requests["a"].pages) == 3
    again = table.allocate(["a", "b"], [2 * PAGE, 5 * PAGE])
    assert [x.tolist() for x in again] == [x.tolist() for x in added]

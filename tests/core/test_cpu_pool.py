"""The CPU replay's static arena (graph/cpu_pool.py): out= overloads found by schema, intermediates
placed by liveness, views of fixed memory made once, copies that look like views replayed, and
CUDA's semantics: a replay allocates no planned intermediate and leaves the last replay's garbage."""
from __future__ import annotations

import torch

from graphcp.graph.cpu import CpuCapture
from graphcp.graph.cpu_pool import CpuPool, out_variant
from graphcp.graph.protocol import graph_break

aten = torch.ops.aten


def test_out_variants_match_by_schema():
    assert out_variant(aten.mm.default) == (aten.mm.out, ["out"])
    assert out_variant(aten.mul.Tensor) == (aten.mul.out, ["out"])
    assert out_variant(aten.mul.Scalar) == (aten.mul.Scalar_out, ["out"])
    assert out_variant(aten.sort.default)[1] == ["values", "indices"]
    assert out_variant(aten.add_.Tensor) is None          # mutates
    assert out_variant(aten.view.default) is None         # a view
    assert out_variant(aten.empty.memory_format) is None  # dtype/device arguments the out= form lacks


def _capture(fn, static, pool=None):
    with torch.inference_mode(), CpuCapture(pool=pool) as cap:   # as the engine runs its forwards
        fn()
    return cap.finish(static)


def test_replay_through_the_arena_equals_eager():
    """Views of intermediates, a reshape that copies (non-contiguous input), a to() that converts and one
    that does not, a multi-output op, a break writing into an intermediate, an intermediate read long
    after same-sized ones were made: new inputs, same results."""
    x, out, idx_out = torch.randn(6, 8), torch.zeros(6, 8), torch.zeros(6, 8, dtype=torch.long)

    @graph_break()
    def host_scale(t, dst):
        return dst.copy_(t * 3)

    def fwd(x=x):
        skip = x.sin()                      # [6, 8], read again at the end: its slot must stay
        a = x @ x.t()                       # [6, 6]
        b = a[:, :4].t().reshape(24)        # a copy: reshape of a non-contiguous view
        c = b.view(6, 4).to(torch.float32)  # no-op to()
        d = torch.cat([c, c], 1).sigmoid()  # [6, 8]
        e = torch.empty_like(d)
        host_scale(d, e)
        values, indices = torch.sort(e + x.cos(), 1)
        out.copy_(values.to(torch.float64).to(torch.float32) + skip)
        idx_out.copy_(indices)

    graph = _capture(fwd, [x, out, idx_out])
    assert graph.pool_bytes > 0
    for seed in range(3):
        x.copy_(torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        got, got_idx = out.clone(), idx_out.clone()
        with torch.inference_mode():
            fwd()
        torch.testing.assert_close(got, out, rtol=0, atol=0)
        assert torch.equal(got_idx, idx_out)


def test_liveness_reuses_slots_and_buckets_share_one_pool():
    """A chain of 12 same-sized steps needs about two live slots, not 12; a second graph fits in the
    first one's arena."""
    x, out = torch.randn(1024), torch.zeros(1024)

    def chain(x=x):
        y = x
        for _ in range(12):
            y = torch.sin(y) * 1.5
        out.copy_(y)

    pool = CpuPool()
    big = _capture(chain, [x, out], pool)
    assert big.pool_bytes <= 3 * 4096, big.pool_bytes
    arena = pool.arena
    small_x, small_out = torch.randn(256), torch.zeros(256)

    def small():
        small_out.copy_(torch.cos(small_x) + 1)

    _capture(small, [small_x, small_out], pool)
    assert pool.arena is arena                  # no second arena
    x.copy_(torch.randn(1024))
    big.replay()
    expect = x
    for _ in range(12):
        expect = torch.sin(expect) * 1.5
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


def test_intermediates_hold_the_last_replays_values():
    """As on CUDA, an intermediate's memory is fixed: a break that keeps a view of one sees it change
    with the next replay, and the replay allocates no planned output."""
    x, out = torch.randn(16), torch.zeros(16)
    seen = []

    @graph_break()
    def keep(t, dst):
        seen.append(t)
        return dst.copy_(t)

    def fwd():
        keep(x * 2, out)

    graph = _capture(fwd, [x, out])
    seen.clear()
    x.fill_(1.0)
    graph.replay()
    x.fill_(5.0)
    graph.replay()
    assert seen[0].data_ptr() == seen[1].data_ptr()
    assert seen[0].eq(10.0).all() and out.eq(10.0).all()


def test_engine_reports_its_replay_arena(checkpoint, engines):
    """An engine's CPU graphs share one arena, reported in stats; a graph replay of a batch equals eager."""
    from graphcp import Request
    engine = engines.get(checkpoint)
    stats = engine.stats()
    assert stats["graph_buckets"] and stats["graph_pool_bytes"] > 0
    assert stats["graph_pool_bytes_per_rank"] == [stats["graph_pool_bytes"]]
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(3))
    graph = engine.prefill([Request("pool-g", ids)])
    engine.release("pool-g")
    eager = engine.prefill([Request("pool-e", ids)], force_eager=True)
    engine.release("pool-e")
    assert graph.mode == "graph"
    torch.testing.assert_close(graph.logits, eager.logits, rtol=1e-6, atol=1e-6)

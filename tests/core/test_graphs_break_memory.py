"""Graph breaks do not keep their arguments per bucket: what a graph's breaks hold alive (besides
the shared pool, the static inputs and the weights) stays the same however many buckets are
captured, and the graphs still replay like eager."""
from __future__ import annotations

import torch
from testkit.hf_reference import rel_err
from testkit.parity import random_ids

from graphcp import Engine, EngineArgs, Request
from graphcp.graph.protocol import Break, BreakableGraph, borrow_break_args, borrowed, held_storages

VOCAB = 211


def _held(engine: Engine) -> dict[int, int]:
    held: dict[int, int] = {}
    for graph in engine._runner.graphs.graphs.values():
        held.update(held_storages(graph))
    return held


def test_break_arguments_do_not_grow_with_buckets(checkpoint):
    """One engine with one bucket, one with four of which it is the largest: the storages their
    breaks own are the same (weights, KV pool, static inputs, the shared arena), none per bucket."""
    held, logits = {}, {}
    batch = [Request("a", random_ids(40, VOCAB, 1))]
    for buckets in ((64,), (8, 16, 32, 64)):
        with Engine(EngineArgs(model_path=checkpoint, max_total_tokens=2048,
                               cuda_graph_buckets=buckets)) as engine:
            runner = engine._runner
            assert runner.graphs.buckets == list(buckets)
            assert all(g.num_breaks for g in runner.graphs.graphs.values())
            held[buckets] = sum(_held(engine).values())
            graph = engine.prefill(batch)
            engine.release("a")
            eager = engine.prefill(batch, force_eager=True)
            engine.release("a")
            assert graph.mode == "graph" and graph.graph_bucket == 64
            assert rel_err(graph.logits, eager.logits) <= 1e-5
            logits[buckets] = graph.logits
    assert held[(8, 16, 32, 64)] == held[(64,)], held
    assert rel_err(logits[(64,)], logits[(8, 16, 32, 64)]) <= 1e-5


def test_borrowed_view_owns_nothing():
    """A CUDA graph's breaks keep borrowed views: the same address, shape, strides and offset, and
    the owner's storage is not held by them (its use count does not move)."""
    base = torch.arange(24.0)
    t = base[4:].view(4, 5).t()
    uses = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    view = borrowed(t)
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) == uses
    assert view.data_ptr() == t.data_ptr() and view.shape == t.shape and view.stride() == t.stride()
    assert torch.equal(view, t)
    t.add_(1)                      # the graph writes the address; the break reads it there
    assert torch.equal(view, t)
    graph = BreakableGraph(items=[Break(lambda x: x, (view,), {})])
    assert held_storages(graph) == {}
    owned = BreakableGraph(items=[Break(lambda x: x, (t,), {})])
    assert held_storages(owned) == {t.untyped_storage().data_ptr(): 24 * 4}
    borrow_break_args(owned)       # host tensors stay owned: only device memory is the pool's
    assert owned.items[0].args[0] is t

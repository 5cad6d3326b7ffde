"""Rank-level faults the first GPU run would hit, shown on CPU: pool sizes that differ across ranks, a
runner that outlives ``close``, a break that returns fresh memory, a rank whose eager warmup fails (the
last runs in tests/core/test_cuda_semantics.py, with the capture failure, in one torchrun)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphcp.graph.cpu import CpuCapture
from graphcp.graph.protocol import BreakLog, GraphCaptureError, PeerFailed, graph_break


# -- 5: every rank gets the least pool any rank can hold -------------------------------------------------
def _pool_rank(rank: int, port: int, out: dict) -> None:
    from graphcp.errors import ConfigError
    from graphcp.kv import sizing
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        def agree_min(n: int) -> int:
            t = torch.tensor([n])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return int(t.item())

        # Two ranks that read free memory at different moments, or hold different layer counts
        # (pipeline stages): their computed token counts differ.
        free = (21 << 30, 30 << 30)[rank]
        per_token = (1 << 20, 3 << 19)[rank]
        budget = sizing.PoolBudget(40 << 30, free, 0.9)
        count = lambda: sizing.pool_tokens(budget, per_token, None, 1 << 30, 1, 16)  # noqa: E731
        out[rank] = (count(), sizing.agreed_tokens(count, agree_min))
        # A rank whose budget fails makes its peer fail too (no peer waits in a collective).
        broke = sizing.PoolBudget(40 << 30, (1 << 30, 30 << 30)[rank], 0.9)
        try:
            sizing.agreed_tokens(lambda: sizing.pool_tokens(broke, per_token, None, 1 << 30, 1, 16),
                                 agree_min)
            out[f"fail{rank}"] = None
        except ConfigError as e:
            out[f"fail{rank}"] = str(e)
    finally:
        dist.destroy_process_group()


def test_pool_size_is_the_minimum_over_ranks():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_pool_rank, args=(port, out), nprocs=2, join=True)
    alone, agreed = zip(*(out[r] for r in range(2)))
    assert alone[0] != alone[1], "the injected budgets differ"
    assert agreed[0] == agreed[1] == min(alone), "every rank holds the same number of pages"
    assert "not enough memory for a KV pool" in out["fail0"]
    assert "another rank cannot fit its KV pool" in out["fail1"]


def test_the_runner_uses_the_agreed_size():
    """The runner sizes the pool through ``agreed_tokens`` with the rank group's minimum (kv/__init__.py)."""
    import inspect

    from graphcp import kv
    assert "agree_min=par.min_over_world" in inspect.getsource(kv.make_pool)


# -- 6: closing an in-process engine frees the runner at once (no reference cycle) ---------------------
def test_close_frees_the_runner(checkpoint):
    from graphcp import Engine, EngineArgs, Request
    engine = Engine(EngineArgs(model_path=checkpoint, max_total_tokens=2048, cuda_graph_buckets=(16, 32)))
    engine.prefill([Request("a", list(range(3, 30)))])
    assert engine.stats()["graph_buckets"] == [16, 32]
    runner = weakref.ref(engine._runner)
    graphs = weakref.ref(engine._runner.graphs)
    gc.disable()                  # freed by reference counts alone: nothing waits for a collection
    try:
        engine.close()
        assert runner() is None and graphs() is None
    finally:
        gc.enable()


# -- 7: a break must write into its arguments, never return fresh memory -------------------------------
def test_capture_refuses_a_break_returning_fresh_memory():
    @graph_break
    def fresh(x: torch.Tensor) -> torch.Tensor:
        return x * 2                          # a new tensor: freed memory at a CUDA replay

    @graph_break
    def in_place(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, 2, out=out)[1:]   # a view of an argument: fine

    x, out = torch.ones(4), torch.zeros(4)
    with CpuCapture():
        in_place(x + 1, out)
    assert out.tolist() == [4.0] * 4
    with pytest.raises(GraphCaptureError, match="not \\(a view of\\) one of its arguments"):
        with CpuCapture():
            fresh(x + 1)


# -- 8: a rank whose eager warmup fails tells its peers at their next collective ------------------------
def test_warmup_agreement_stops_peers_at_the_next_collective():
    """Rank A fails between its first and second collective; rank B meets A's one ``agree(False)`` at its
    second collective's agreement and stops: both made the same number of agreement calls."""
    calls = {"a": [], "b": []}
    flags: list[list[bool]] = [[], []]      # what each rank contributed to each agreement

    def agree_for(rank: str, slot: int):
        def agree(ok: bool) -> bool:
            calls[rank].append(ok)
            flags[slot].append(ok)
            n = len(calls[rank])
            other = flags[1 - slot]
            return ok and (len(other) < n or other[n - 1])
        return agree

    @graph_break(collective=True)
    def collective() -> None:
        pass

    a, b = BreakLog(agree_for("a", 0)), BreakLog(agree_for("b", 1))
    with pytest.raises(RuntimeError, match="oom"):
        with a:
            collective()
            raise RuntimeError("oom")      # the failure; the runner then calls agree(False) once
    a.agree(False)
    with pytest.raises(PeerFailed):
        with b:
            collective()
            collective()                   # meets rank A's agree(False)
    assert len(calls["a"]) == len(calls["b"]) == 2

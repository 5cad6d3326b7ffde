"""A one-rank warmup or capture failure under NCCL's collective order, shown on CPU with gloo.

Under NCCL the forward's collectives are not graph breaks: a warmup issues them eagerly and a
capture records them, to run only when a segment is replayed (before a break, and at serving). Here two
processes stand in for that: torch.cuda's graph is replaced by one that defers each step of the
forward to its replay, as a CUDA capture does, and the collectives are gloo's. Rank 1 fails the
warmup of bucket 32 and the capture of bucket 16; without agreements, rank 0 would wait in the next
collective while rank 1 sits in the bucket's agreement (a hang, or mismatched collectives). Both
ranks must end start-up quickly with the same error, serve the failed buckets eagerly, replay the
other bucket like eager, and capture a failed bucket again once nothing fails.
"""
from __future__ import annotations

import contextlib
import socket
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS = 3
FAILS = {32: "SyncCheckedWarmup", 16: "CudaCapture"}      # bucket -> the phase rank 1 fails in


class _DeferringGraph:
    """torch.cuda.CUDAGraph as CUDA runs it: steps issued while capturing run only at replay."""
    current: "_DeferringGraph | None" = None

    def capture_begin(self, pool=None) -> None:
        self.steps, _DeferringGraph.current = [], self

    def capture_end(self) -> None:
        _DeferringGraph.current = None

    def replay(self) -> None:
        for step in self.steps:
            step()


def _step(fn) -> None:
    """One kernel of the forward: recorded while a graph captures, else run."""
    if _DeferringGraph.current is not None:
        _DeferringGraph.current.steps.append(fn)
    else:
        fn()


def _fake_cuda() -> None:
    import graphcp.graph.runner as graph_runner
    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    torch.cuda.CUDAGraph = _DeferringGraph
    torch.cuda.graph_pool_handle = lambda: object()
    torch.cuda.Stream = lambda *a: stream
    torch.cuda.current_stream = lambda *a: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.get_sync_debug_mode = lambda: 0
    torch.cuda.set_sync_debug_mode = lambda mode: None
    graph_runner.process_memory = lambda device: 0


def _rank(rank: int, port: int, out: dict) -> None:
    from graphcp.forward_batch import ForwardBatch
    from graphcp.graph import protocol
    from graphcp.graph.runner import GraphRunner, gather_errors
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    _fake_cuda()
    inject = {"on": rank == 1}
    x = torch.arange(64, dtype=torch.float32)
    hidden, logits = torch.zeros(64), torch.zeros(1)

    def all_reduce(t: torch.Tensor) -> None:          # an NCCL collective of the forward
        protocol.collective_point()
        _step(lambda: dist.all_reduce(t))

    @protocol.graph_break
    def attend(h: torch.Tensor, layer: int) -> torch.Tensor:   # reads what the segment computed
        return h.add_(float(h.sum()) * 1e-3 + layer)

    def forward(batch: ForwardBatch) -> torch.Tensor:
        n = batch.layout
        h = hidden[:n]
        _step(lambda: h.copy_(x[:n] * (rank + 1)))
        for layer in range(LAYERS):
            _step(lambda layer=layer: h.mul_(0.5).add_(layer))
            all_reduce(h)
            attend(h, layer)
            phase = type(protocol._active).__name__
            if inject["on"] and layer == 1 and FAILS.get(n) == phase:
                raise RuntimeError(f"injected {phase} failure at bucket {n}")
        _step(lambda: logits.copy_(h.sum()[None]))
        return logits

    def agree(ok: bool) -> bool:                      # MAX of a failure flag over the ranks
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) == 0

    inputs = types.SimpleNamespace(set_batch=lambda batch: None, static=None, aux=None,
                                   logits=logits, tensors=lambda: [])
    runner = GraphRunner(forward, inputs, torch.device("cuda"), agree, collective_breaks=False,
                         share_errors=gather_errors(dist.group.WORLD))
    capture_batch = lambda bucket, seed: (None, bucket)               # noqa: E731
    eager = lambda n: float(forward(ForwardBatch(None, n, None)))     # noqa: E731
    try:
        runner.capture_all([8, 16, 32], capture_batch)
        result = {"buckets": runner.buckets, "failures": runner.failures,
                  "replay8": float(runner.replay(8, None, None)), "eager8": eager(8),
                  "eager16": eager(16), "eager32": eager(32)}
        inject["on"] = False                          # a later capture of the failed bucket
        rec = runner.capture(16, capture_batch)
        result.update(recaptured=rec.error, buckets_after=runner.buckets,
                      replay16=float(runner.replay(16, None, None)), eager16_after=eager(16))
        out[rank] = result
    finally:
        dist.destroy_process_group()


def test_one_rank_failure_is_agreed_without_a_hang():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    ctx = mp.start_processes(_rank, args=(port, out), nprocs=2, join=False, start_method="spawn")
    for proc in ctx.processes:
        proc.join(120)
    alive = [p.pid for p in ctx.processes if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert not alive, "a rank hung in a collective"
    assert all(p.exitcode == 0 for p in ctx.processes), [p.exitcode for p in ctx.processes]
    r0, r1 = out[0], out[1]
    assert r0["failures"] == r1["failures"], "every rank reads the same error"
    assert sorted(r0["failures"]) == [16, 32] and r0["buckets"] == r1["buckets"] == [8]
    assert r0["failures"][32] == ("rank 1 of 2: the eager warmup failed: RuntimeError: injected "
                                  "SyncCheckedWarmup failure at bucket 32")
    assert r0["failures"][16] == ("rank 1 of 2: CUDA graph capture failed: injected CudaCapture "
                                  "failure at bucket 16")
    for r in (r0, r1):
        assert r["replay8"] == r["eager8"] and r["recaptured"] is None
        assert r["buckets_after"] == [8, 16] and r["replay16"] == r["eager16"] == r["eager16_after"]
    assert r0["eager32"] == r1["eager32"] and r0["eager8"] == r1["eager8"]


def test_nccl_collectives_meet_the_warmup_agreement(monkeypatch):
    """comm.py's NCCL path calls ``collective_point`` before each collective: a warmup agrees
    there (and stops with PeerFailed when a peer failed); inside a break, and outside a warmup,
    nothing."""
    import pytest

    from graphcp.distributed import comm
    from graphcp.graph.protocol import BreakLog, PeerFailed, graph_break
    votes: list = []
    issued: list = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t, group=None: issued.append(t))
    monkeypatch.setattr(comm, "_nccl", lambda group: True)
    with BreakLog(lambda ok: votes.append(ok) or True):
        comm.all_reduce(torch.zeros(2), None)                  # an NCCL collective in the forward
        graph_break(lambda t: comm._all_reduce(t, None))(torch.zeros(1))     # inside a break
    assert votes == [True] and len(issued) == 2
    comm.all_reduce(torch.zeros(2), None)                      # serving: no agreement
    assert votes == [True] and len(issued) == 3
    with pytest.raises(PeerFailed), BreakLog(lambda ok: False):
        comm.all_reduce(torch.zeros(2), None)
    assert len(issued) == 3, "a rank that learned of a failure issues no collective"

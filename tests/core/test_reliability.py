"""Reliability: a dead or hung rank fails prefill within the timeout and leaves no process; determinism;
a short soak (chunked prefill, releases, graph mode) without page leaks or re-capture."""
from __future__ import annotations

import os
import signal
import time

import pytest
from testkit.engines import cp_kwargs
from testkit.parity import random_ids

from graphcp import Engine, EngineArgs, EngineDeadError, Request

VOCAB = 211


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_rank_fault_fails_fast_and_cleans_up(checkpoint, fault):
    engine = Engine(EngineArgs(model_path=checkpoint, max_total_tokens=1024, rank_timeout_s=5,
                               **cp_kwargs(2, cuda_graph_buckets=[16])))
    pids = [proc.popen.pid for proc, _ in engine._workers]
    engine.prefill([Request("a", random_ids(20, VOCAB, 1))])
    os.kill(pids[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="unusable"):
        engine.prefill([Request("b", random_ids(20, VOCAB, 2))])
    assert time.monotonic() - t0 < 5 + 10
    with pytest.raises(EngineDeadError):
        engine.stats()
    for pid in pids:
        for _ in range(50):
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid), f"rank process {pid} outlived the engine"


@pytest.mark.parametrize("force_eager", [False, True], ids=["graph", "eager"])
def test_same_batch_twice_is_bitwise_identical(checkpoint, engines, force_eager):
    engine = engines.get(checkpoint, **cp_kwargs(2))
    batch = [Request("d0", random_ids(33, VOCAB, 1)), Request("d1", random_ids(70, VOCAB, 2))]
    outs = []
    for _ in range(2):
        outs.append(engine.prefill(batch, force_eager=force_eager))
        for r in batch:
            engine.release(r.rid)
    assert outs[0].mode == ("eager" if force_eager else "graph")
    assert outs[0].logits.equal(outs[1].logits)


def test_short_soak(checkpoint):
    from graphcp.tools.soak import soak
    report = soak(EngineArgs(model_path=checkpoint, max_total_tokens=4096, cuda_graph_buckets=[16, 32, 64, 128],
                             **cp_kwargs(2)), batches=60, sample_every=10, seed=3)
    assert report["leaked_tokens"] == 0 and report["recaptured"] is False
    assert report["graph_batches"] > 30 and report["sampled"] >= 5 and report["max_graph_vs_eager"] <= 1e-6


def test_clean_shutdown_leaves_no_process(checkpoint):
    engine = Engine(EngineArgs(model_path=checkpoint, max_total_tokens=1024, **cp_kwargs(2, cuda_graph_buckets=[16])))
    pids = [proc.popen.pid for proc, _ in engine._workers]
    assert all(_alive(p) for p in pids)
    engine.prefill([Request("a", random_ids(20, VOCAB, 1))])
    engine.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(EngineDeadError, match="closed"):
        engine.prefill([Request("b", random_ids(20, VOCAB, 2))])


def test_calls_from_several_threads_are_serialized(checkpoint, engines):
    """A serving loop may call from several threads: each call is answered whole, results are exact."""
    import threading

    import torch
    engine = engines.get(checkpoint, **cp_kwargs(2))
    batches = {t: [Request(f"t{t}_{i}", random_ids(20 + 7 * i + t, 211, 100 * t + i)) for i in range(3)]
               for t in range(3)}
    expected = {}
    for t, batch in batches.items():
        expected[t] = engine.prefill(batch).logits
        for r in batch:
            engine.release(r.rid)
    got, errors = {}, []

    def serve(t: int) -> None:
        try:
            for _ in range(3):
                out = engine.prefill(batches[t])
                got.setdefault(t, []).append(out.logits)
                for r in batches[t]:
                    engine.release(r.rid)
                engine.stats()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(t,)) for t in batches]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    for t, outs in got.items():
        assert len(outs) == 3 and all(torch.equal(o, expected[t]) for o in outs)
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]

"""The CUDA path, checked on CPU where it can be: the capture protocol under CUDA's semantics (a segment
computes nothing until replayed), failures injected into the CUDA capture backend, and the rank, device
and memory maps. None of these need a GPU; ``profiles/gpu_check.py`` checks the rest on one."""
from __future__ import annotations

import gc
import types

import pytest
import torch
from testkit.paths import SCRIPTS

from graphcp.attention.op import _attend_break
from graphcp.cp.metadata import HostMaxima
from graphcp.graph import cuda as cuda_backend
from graphcp.graph.cpu import CpuCapture
from graphcp.graph.protocol import capture_active, graph_break
from graphcp.kernels.registry import KERNELS, KernelArgs


# -- 1: breaks at capture see what the graph computes ------------------------------------------------
def _paged_forward(lens: torch.Tensor, q: torch.Tensor, pool: torch.Tensor, out: torch.Tensor) -> None:
    """Metadata computed in a segment, then the torch kernel in a break (it reads lengths on the host)."""
    cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    limits = _limits(lens)
    rows = torch.zeros(2, 1, dtype=torch.long) + torch.arange(2)[:, None]
    args = KernelArgs(q, pool, pool, cu, rows, limits, out, page_size=8, scale=0.5)
    _attend_break(KERNELS["torch"], args, HostMaxima(max_q=5, max_kv=5), 0)


def _limits(lens: torch.Tensor) -> torch.Tensor:
    """Bottom-right causal limits of two sequences of lens 3 and 5 (8 rows), by tensor ops."""
    row = torch.arange(8)
    first = (row < lens[0]).long()
    return first * (row + 1) + (1 - first) * (row - lens[0] + 1)


def test_break_at_capture_sees_replayed_segment():
    """A captured segment's tensors hold garbage until replayed (CUDA capture runs nothing). Without the
    protocol's replay before a break, the torch kernel reads garbage lengths: the emulation catches the
    defect (an index out of bounds, as on a GPU); with it, capture, replay and eager agree."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 5])
    q, pool = torch.randn(8, 2, 4, generator=gen), torch.randn(16, 1, 4, generator=gen)
    eager = torch.zeros(8, 2, 4)
    _paged_forward(lens, q, pool, eager)
    with pytest.raises((IndexError, RuntimeError)):
        with CpuCapture(replay_before_break=False):
            _paged_forward(lens, q, pool, torch.zeros(8, 2, 4))
    out = torch.zeros(8, 2, 4)
    with CpuCapture() as cap:
        _paged_forward(lens, q, pool, out)
    assert torch.equal(out, eager)
    graph = cap.finish([lens, q, pool, out])
    out.zero_()
    graph.replay()
    assert torch.equal(out, eager)


def test_segment_tensors_are_garbage_after_capture():
    x = torch.arange(4.0)
    seen = {}

    @graph_break
    def look(t: torch.Tensor) -> None:
        seen["t"] = t.clone()

    with CpuCapture(replay_before_break=False) as cap:
        y = x * 2
        look(y)
    assert torch.isnan(seen["t"]).all() and torch.isnan(y).all()
    assert cap.graph.num_breaks == 1


# -- 2 and 3: failures injected into the CUDA capture backend ----------------------------------------
class _Ctx:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def __enter__(self) -> "_Ctx":
        self.log.append(f"enter {self.name}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append(f"exit {self.name}")


def _fake_cuda(monkeypatch, log: list, fail_begin_at: int | None = None) -> None:
    """torch.cuda stand-ins recording what the backend does; capture_begin fails on its Nth call."""
    begins = []

    class Graph:
        def capture_begin(self, pool=None) -> None:
            begins.append(pool)
            if fail_begin_at is not None and len(begins) == fail_begin_at:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        def capture_end(self) -> None:
            log.append("capture_end")

        def replay(self) -> None:
            log.append("replay")

    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Ctx(log, "stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)


def test_failed_capture_begin_releases_everything(monkeypatch):
    log: list = []
    _fake_cuda(monkeypatch, log, fail_begin_at=1)
    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    with pytest.raises(RuntimeError, match="not permitted"):
        with cuda_backend.CudaCapture(pool=None, stream=stream):
            pass
    assert gc.get_freeze_count() == 0, "gc stays frozen after a failed capture_begin"
    assert not capture_active(), "later breaks would be sent to a dead capture"
    assert log == ["enter stream", "exit stream"]
    calls = []
    graph_break(lambda: calls.append(1))()            # a break now runs eagerly
    assert calls == [1]


def test_break_replays_its_segment_before_running(monkeypatch):
    log: list = []
    _fake_cuda(monkeypatch, log)
    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    with cuda_backend.CudaCapture(pool=None, stream=stream) as cap:
        graph_break(lambda: log.append("break"))()
    assert log == ["enter stream", "capture_end", "replay", "break", "capture_end", "exit stream"]
    assert cap.graph.num_segments == 2 and cap.graph.num_breaks == 1


def test_failed_capture_continues_with_a_fresh_pool(monkeypatch):
    """After a bucket fails capture, later buckets capture into a new pool; one side stream serves all."""
    from graphcp.graph.runner import GraphRunner
    log: list = []
    _fake_cuda(monkeypatch, log, fail_begin_at=1)
    pools = iter(["pool0", "pool1", "pool2"])
    streams = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a: streams.append(1) or types.SimpleNamespace(
        wait_stream=lambda s: None))
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append(m))

    inputs = types.SimpleNamespace(set_batch=lambda batch: None, static=None, aux=None, logits=torch.zeros(1),
                                   tensors=lambda: [])
    runner = GraphRunner(lambda batch: torch.zeros(1), inputs, torch.device("cuda"), agree=lambda ok: ok,
                         collective_breaks=False)
    monkeypatch.setattr("graphcp.graph.runner.process_memory", lambda device: 0)
    runner.capture_all([16, 32], lambda bucket, seed: (None, None))
    assert runner.buckets == [16] and "not permitted" in runner.failures[32]
    assert runner.pool == "pool1" and len(streams) == 1
    assert modes == ["error", 0, "error", 0], "warmups run with host syncs as errors"


def test_warmup_allows_syncs_inside_breaks(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append(m))
    with cuda_backend.SyncCheckedWarmup():
        graph_break(lambda: modes.append("break"))()
    assert modes == ["error", 0, "break", "error", 0]


# -- 5, 8, 10: device, memory and backend maps --------------------------------------------------------
def test_kv_budget_is_shared_by_ranks_on_one_gpu(monkeypatch):
    """Ranks sharing a GPU each size from their share of it; the pool is SGLang's rule:
    available - capacity x (1 - mem fraction static), the default fraction SGLang's for the
    device's size; --gpu-memory-gib assumes another device size with today's usage."""
    from graphcp.distributed.parallel import ranks_per_device
    from graphcp.kv.sizing import default_mem_fraction, measured_budget, pool_tokens
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 140 << 30))
    cuda = torch.device("cuda", 0)
    assert ranks_per_device(cuda, 2) == 2 and ranks_per_device(cuda, 1) == 1

    def tokens(ranks: int, gib: float | None = None, fraction: float | None = None) -> int:
        budget = measured_budget(cuda, ranks, 0, 0, fraction, gib, 8, 1, 7, False)
        return pool_tokens(budget, 1 << 20, None, 1 << 30, 1 << 20, 16)

    frac = default_mem_fraction(140 << 30, 8, 1, 7, False)
    assert 0.88 < frac < 0.93          # H200-class: a 10-15 GiB reserve
    alone = tokens(1)
    assert alone == int((100 << 30) - (140 << 30) * (1 - frac)) >> 20
    shared = tokens(ranks_per_device(cuda, 2))
    assert shared == int((50 << 30) - (70 << 30) * (1 - default_mem_fraction(70 << 30, 8, 1, 7,
                                                                              False))) >> 20
    assert tokens(1, fraction=0.8) == ((100 << 30) - int((140 << 30) * 0.2)) >> 20
    # a 80 GiB device with the 40 GiB in use now: 40 GiB available
    assert tokens(1, gib=80, fraction=0.9) == ((40 << 30) - int((80 << 30) * 0.1)) >> 20
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ranks_per_device(cuda, 2) == 1


def test_multi_node_ranks_map_by_local_rank(monkeypatch):
    from graphcp.worker import process_group_backend, rank_device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    args = types.SimpleNamespace(resolved_device=lambda: "cuda", world_size=16)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert rank_device(args, 11) == torch.device("cuda", 3)      # node 1, local rank 3
    assert process_group_backend(args) == "nccl"                  # 8 GPUs for 8 local ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert process_group_backend(args) == "gloo"                  # ranks would share GPUs
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert rank_device(args, 11) == torch.device("cuda", 3)       # spawned on one host: rank % GPUs


def test_cuda_device_gets_its_index(monkeypatch):
    from graphcp.runner import _normalize
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _normalize(torch.device("cuda")) == torch.device("cuda:0")
    assert _normalize(torch.device("cpu")) == torch.device("cpu")


# -- 4: one rank's capture fails, its peer's does not -------------------------------------------------
def test_one_rank_capture_failure_keeps_collectives_matched(checkpoint, oracle, tmp_path):
    """Rank 1 fails mid-capture while rank 0 waits in the next layer's all-gather: rank 1 still issues the
    collectives rank 0 meets, both agree the bucket serves eagerly, and start-up does not hang."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from testkit.hf_reference import rel_err
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(SCRIPTS, "spmd_capture_fail.py")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(port), script, checkpoint, str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    for r in (r0, r1):
        assert r["buckets"] == [16] and "32" in r["failures"] and "64" in r["failures"]
        assert r["mode"] == "eager" and "bucket 32 failed to capture" in r["reason"]
        assert "bucket 64 failed to capture" in r["larger_reason"]
        assert r["small_mode"] == "graph" and r["small_bucket"] == 16
    assert r0["failures"] == r1["failures"], "every rank reads the failing rank's own error"
    assert r0["failures"]["32"] == "rank 1 of 2: injected: capture failed on rank 1 only"
    assert r0["failures"]["64"] == ("rank 1 of 2: the eager warmup failed: RuntimeError: "
                                    "injected: CUDA out of memory on rank 1 only")
    for i, ids in enumerate([list(range(3, 40)), [(7 * i) % 200 for i in range(1, 25)]]):
        ref, _ = oracle(checkpoint, ids)
        assert rel_err(torch.tensor(r0["logits"][i]), ref) <= 1e-4
    ref, _ = oracle(checkpoint, list(range(1, 101)))
    assert rel_err(torch.tensor(r0["larger_logits"][0]), ref) <= 1e-4


# -- 9: the torch kernel bounds its score memory on long prompts ---------------------------------------
def test_torch_kernel_chunks_long_prompts(monkeypatch):
    """A long prompt's queries run in chunks so no SDPA call materialises more than the score budget;
    the result equals the unchunked call."""
    from graphcp.kernels import torch_ref
    gen = torch.Generator().manual_seed(0)
    q_lens, prefix, ps = [300, 170], [40, 0], 16
    kv = [p + n for p, n in zip(prefix, q_lens)]
    pages = max(-(-k // ps) for k in kv)
    rows = torch.arange(1, 1 + 2 * pages).view(2, pages)
    k_pool = torch.randn((1 + 2 * pages) * ps, 2, 64, generator=gen)
    v_pool = torch.randn((1 + 2 * pages) * ps, 2, 64, generator=gen)
    q = torch.randn(sum(q_lens), 4, 64, generator=gen)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)])
    limits = torch.tensor([k - n + i + 1 for n, k in zip(q_lens, kv) for i in range(n)])
    whole = torch_ref.torch_paged_attention(q, k_pool, v_pool, cu, rows, limits, ps, 0.125, 300, 340,
                                            torch.empty_like(q))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(qq, *a, **k):
        calls.append(qq.shape[2] * a[0].shape[2] * qq.shape[0] * qq.shape[1] * 4)
        return sdpa(qq, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    monkeypatch.setattr(torch_ref, "_MASK_ELEMENTS", 1000)
    monkeypatch.setattr(torch_ref, "_SCORE_BYTES", 1 << 20)
    chunked = torch_ref.torch_paged_attention(q, k_pool, v_pool, cu, rows, limits, ps, 0.125, 300, 340,
                                              torch.empty_like(q))
    assert len(calls) > 2 and max(calls) <= 1 << 20
    assert (chunked - whole).abs().max() <= 1e-5

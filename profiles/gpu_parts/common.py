"""Helpers the parts share: timing, error metrics, the test checkpoint, engine arguments, prefills.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from .report import Report

TRITON_MODULES = ("graphcp.kernels.triton_attention", "graphcp.kernels.triton_kv_write",
                  "graphcp.kernels.triton_rmsnorm", "graphcp.kernels.triton_rope")


class SkipPart(Exception):
    """A part that cannot run here for an expected reason: reported INCOMPLETE, not FAILED."""


def cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def triton_ready() -> str | None:
    """None when graphcp's Triton kernels can be imported here, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    for mod in TRITON_MODULES:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} does not exist in this build"
    return None


def device_of(rep: Report) -> str:
    return "cpu" if rep.dry_run else "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: one number per tensor, robust to the scale of logits."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def cuda_ms(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# -- the model parts' checkpoint, engines and batches -------------------------------------------
def checkpoint(rep: Report, workdir: str) -> str:
    """The demo-size Qwen3 on a dry run, else a ~1B random Llama (bf16); written once per workdir.
    """
    import torch

    from graphcp.checkpoint.random import DEMO_QWEN3, LLAMA_1B, make_random_checkpoint
    if rep.dry_run:
        return make_random_checkpoint(os.path.join(workdir, "demo-qwen3"), DEMO_QWEN3, seed=0)
    t = time.monotonic()
    path = make_random_checkpoint(os.path.join(workdir, "llama-1b-random"), LLAMA_1B, seed=0,
                                  dtype=torch.bfloat16)
    rep.info["checkpoint_s"] = round(time.monotonic() - t, 1)
    return path


def engine_args(rep: Report, path: str, buckets: tuple[int, ...], **kw: Any) -> Any:
    """On the GPU the Triton attention kernel is asked for by name: a probe failure is then an
    error, not a silent fall back to the torch kernel (which would void the graph checks' point)."""
    from graphcp import EngineArgs
    if rep.dry_run:
        return EngineArgs(model_path=path, device="cpu", max_total_tokens=4096,
                          cuda_graph_buckets=buckets, **kw)
    kw.setdefault("attention_kernel", "triton")
    return EngineArgs(model_path=path, device="cuda", max_total_tokens=65536,
                      cuda_graph_buckets=buckets, **kw)


def random_batch(vocab: int, n: int, length: int, tag: str,
                 seed: int) -> list[tuple[str, list[int]]]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    return [(f"{tag}_{i}", torch.randint(0, vocab, (length,), generator=gen).tolist())
            for i in range(n)]


def prefill(engine: Any, batch: list[tuple[str, list[int]]], force_eager: bool = False,
            release: bool = True) -> Any:
    from graphcp import Request
    out = engine.prefill([Request(rid, ids) for rid, ids in batch], force_eager=force_eager)
    if release:
        for rid, _ in batch:
            engine.release(rid)
    return out


def time_prefill(engine: Any, batch: list[tuple[str, list[int]]], force_eager: bool,
                 reps: int) -> float:
    """Median wall milliseconds of a prefill (after one warm call: kernel specializations,
    allocator)."""
    prefill(engine, batch, force_eager)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        prefill(engine, batch, force_eager)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def require_graph(rep: Report, part: str, shape: str, mode: str, reason: str | None) -> None:
    """A check of graphs is void unless the batch replayed as one."""
    rep.check(part, f"replayed as a graph {shape}", "not graph (1) / graph (0)",
              float(mode != "graph"), 0.0, mode=mode, reason=reason)

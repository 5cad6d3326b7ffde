"""NVTX ranges (the nvtx package; free when no profiler is attached), GPU memory readings, and the
host-op counter that ``graphcp bench`` reads.

Every range is also a ``torch.profiler.record_function`` range while a torch profiler is recording, so
Nsight and ``graphcp profile`` see the same names. Outside a torch profiler that costs one flag check.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a declared dependency; keep running if a stripped install lacks it
    _nvtx = None

_torch_profiler_on = torch._C._autograd._profiler_enabled
_quiet = 0      # > 0 while a graph is captured: a capture records every op, the profiler's too


@contextlib.contextmanager
def no_profiler_ranges() -> Iterator[None]:
    """Captures run inside this: torch-profiler ranges must not become part of a segment."""
    global _quiet
    _quiet += 1
    try:
        yield
    finally:
        _quiet -= 1


def _record_function(name: str) -> contextlib.AbstractContextManager:
    if not _torch_profiler_on() or _quiet:
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    with _record_function(name):
        if _nvtx is None:
            yield
            return
        with _nvtx.annotate(name, domain="graphcp"):
            yield


def gpu_memory_used(device_index: int = 0) -> int | None:
    """Bytes in use on the GPU by pynvml, or None where no NVIDIA driver is present."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # NVMLError without a driver, ImportError without the package
        return None
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device_index)).used)
    finally:
        pynvml.nvmlShutdown()


# -- host-op counter ------------------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts aten ops launched from the host. A graph replay counts each captured segment as one."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


_counters: list[OpCounter] = []


@contextlib.contextmanager
def count_host_ops(enabled: bool = True) -> Iterator[OpCounter | None]:
    """``with count_host_ops() as c: ...; c.count``; yields None when not ``enabled``."""
    if not enabled:
        yield None
        return
    counter = OpCounter()
    _counters.append(counter)
    try:
        with counter:
            yield counter
    finally:
        _counters.pop()


def active_counter() -> OpCounter | None:
    return _counters[-1] if _counters else None


@contextlib.contextmanager
def paused(counter: OpCounter | None) -> Iterator[None]:
    """Ops run here are not counted (a replayed segment is one launch, counted by the caller)."""
    if counter is None:
        yield
        return
    before = counter.count
    try:
        yield
    finally:
        counter.count = before

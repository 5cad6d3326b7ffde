"""NVTX ranges (the nvtx package; free when no profiler is attached) and GPU memory readings.

Every range is also a ``torch.profiler.record_function`` range while a torch profiler is recording, so
Nsight and ``graphcp profile`` see the same names. Outside a torch profiler that costs one flag check.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a declared dependency; keep running if a stripped install lacks it
    _nvtx = None

_torch_profiler_on = torch._C._autograd._profiler_enabled


def _record_function(name: str) -> contextlib.AbstractContextManager:
    """A torch-profiler range, only while one records and no graph is being captured (a capture records
    or freezes every op it sees; the profiler's own ops must not become part of a segment)."""
    if not _torch_profiler_on():
        return contextlib.nullcontext()
    from graphcp.graph.capture import capture_active   # imported late: capture imports this module
    if capture_active():
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

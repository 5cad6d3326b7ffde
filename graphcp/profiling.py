"""NVTX ranges (the nvtx package; free when no profiler is attached) and GPU memory readings."""
from __future__ import annotations

import contextlib
from typing import Iterator

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is a declared dependency; keep running if a stripped install lacks it
    _nvtx = None


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
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

"""NVTX ranges (the nvtx package; free when no profiler is attached), memory readings (this
process's from torch, the whole GPU's from NVML), and the host-op counter that ``graphcp bench``
reads.

Every range is also a ``torch.profiler.record_function`` range while a torch profiler is recording,
so Nsight and ``graphcp profile`` see the same names. Outside a torch profiler that costs one flag
check.
"""
from __future__ import annotations

import contextlib
import os
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


def nvml_bus_id(device: torch.device) -> str | None:
    """The PCI bus id NVML names ``device`` by ("00000000:3B:00.0"). CUDA and NVML number devices
    differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): an index is never passed between them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    try:
        domain, bus, dev = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
    except AttributeError:          # a torch without the PCI fields: no safe mapping
        return None
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def gpu_memory_used(device: torch.device) -> int | None:
    """Bytes in use on the whole GPU behind ``device`` (every process on it: another rank sharing
    the GPU counts too), by NVML; None without pynvml, a driver, or a known bus id."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:        # no driver
        return None
    try:
        bus_id = nvml_bus_id(device)
        if bus_id is None:
            return None
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def process_memory(device: torch.device) -> int:
    """Bytes this process holds for ``device``: torch's reserved pool on CUDA (what a capture adds
    to, whatever else runs on the GPU), resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return rss_bytes()


# -- host-op counter ------------------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts aten ops launched from the host. A graph replay counts each captured segment as one."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: a rank started by fork + exec
    inherits the parent's resident size at the fork as its ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (this one by default) from /proc; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0

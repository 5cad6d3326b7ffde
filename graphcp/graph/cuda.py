"""CUDA capture: one ``torch.cuda.CUDAGraph`` per segment, one memory pool shared by every bucket.

Under NCCL the forward's collectives are captured in the segments, so a rank whose capture fails
would leave its peers waiting in them when the protocol replays a segment before a break. With
``agree`` every rank agrees that all still capture at the end of each segment, before it is
replayed (and at the end of the capture); a rank that failed says so once, at its peers' next
agreement, and every rank stops there with matched collectives (``PeerFailed`` on the peers)."""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable

import torch

from graphcp.graph.protocol import (
    Break,
    BreakableGraph,
    BreakLog,
    Capture,
    PeerFailed,
    borrow_break_args,
    check_break_outputs,
    host_slot,
    set_active,
)
from graphcp.profiling import no_profiler_ranges


# -- CUDA -------------------------------------------------------------------------------------------
class _CudaSegment:
    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph

    def replay(self, env: list) -> None:
        self.graph.replay()


class CudaCapture(Capture):
    """Capture a forward as CUDA graphs, one per segment, in a pool shared across buckets, on one side
    stream shared across buckets. Nothing runs while a segment is captured, so before a break runs at
    capture, the segment just captured is replayed: the break then reads what the graph computes."""

    def __init__(self, pool: Any, stream: "torch.cuda.Stream",
                 agree: Callable[[bool], bool] | None = None) -> None:
        self.pool, self.stream, self.agree = pool, stream, agree
        self.graph = BreakableGraph()
        self.current: Any = None
        self._entered: list[Any] = []

    def __enter__(self) -> "CudaCapture":
        torch.cuda.synchronize()
        gc.collect()
        gc.freeze()  # no Python gc (and no CUDA frees it triggers) in the middle of a capture
        self._entered.append(gc.unfreeze)
        try:
            self.stream.wait_stream(torch.cuda.current_stream())
            for ctx in (torch.cuda.stream(self.stream), no_profiler_ranges()):
                ctx.__enter__()
                self._entered.append(lambda ctx=ctx: ctx.__exit__(None, None, None))
            set_active(self)
            self._entered.append(lambda: set_active(None))
            self._begin()
        except BaseException as e:
            self._release()      # a failed capture_begin must not leave gc frozen or the stream entered
            self._tell_peers(type(e))
            raise
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is None:
                self._end()
            else:   # end the interrupted capture so the stream is usable; the original error propagates
                with contextlib.suppress(RuntimeError):
                    self._end()
                self.current = None
        finally:
            self._release()
            torch.cuda.current_stream().wait_stream(self.stream)
        if exc_type is None:
            self._meet_peers()        # the last segment's agreement
        else:
            self._tell_peers(exc_type)

    def _meet_peers(self) -> None:
        """Every rank's agreement that all are still capturing (a no-op without ``agree``)."""
        if self.agree is not None and not self.agree(True):
            self.graph.items.clear()              # release the partial graph
            raise PeerFailed("another rank's capture failed")

    def _tell_peers(self, exc_type: Any) -> None:
        """This rank's capture failed: its one ``agree(False)`` meets the peers' next agreement.
        A rank that stopped for a peer (``PeerFailed``) already met it."""
        self.graph.items.clear()
        stopped_for_peer = isinstance(exc_type, type) and issubclass(exc_type, PeerFailed)
        if self.agree is not None and not stopped_for_peer:
            self.agree(False)

    def _release(self) -> None:
        while self._entered:
            self._entered.pop()()

    def _begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def _end(self) -> "_CudaSegment | None":
        if self.current is None:
            return None
        graph, self.current = self.current, None
        graph.capture_end()
        segment = _CudaSegment(graph)
        self.graph.items.append(segment)
        return segment

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        segment = self._end()
        self._meet_peers()                    # before the replay issues the segment's collectives
        if segment is not None:
            segment.replay(None)              # compute the break's inputs: capture ran nothing
        out = fn(*args, **kwargs)
        check_break_outputs(fn, args, kwargs, out)      # the segment after it reads ``out`` where it is now
        self.graph.items.append(Break(fn, args, kwargs, host=host_slot(fn, args, kwargs)))
        self._begin()
        return out

    def finish(self, static: list[torch.Tensor]) -> BreakableGraph:
        g = self.graph
        g.static, g.static_ptrs = list(static), [t.data_ptr() for t in static]
        borrow_break_args(g)       # the pool's blocks return to it: the next bucket reuses them
        return g


class SyncCheckedWarmup(BreakLog):
    """The eager warmup before a CUDA capture, with host syncs made errors outside graph breaks: a sync
    that would break the capture fails here, in the open, with a stack pointing at it. It logs its
    breaks like any ``BreakLog``."""

    def __enter__(self) -> "SyncCheckedWarmup":
        self.previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.cuda.set_sync_debug_mode(self.previous)

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        torch.cuda.set_sync_debug_mode(self.previous)    # breaks may sync: they run eagerly at replay too
        try:
            return super().run_break(fn, args, kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def before_collective(self) -> None:
        torch.cuda.set_sync_debug_mode(self.previous)    # the agreement reads its flag on the host
        try:
            super().before_collective()
        finally:
            torch.cuda.set_sync_debug_mode("error")

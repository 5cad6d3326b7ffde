"""Graph runner: bucket selection, capture of every bucket, and replay.

It knows nothing of layouts or models. A ``GraphTarget`` (the model runner) loads a batch that fills a
bucket into its static inputs (``prepare_for_capture``), copies a live batch in (``prepare_for_replay``)
and runs the forward; batches carry a ``host`` object that a replay hands to the breaks in place of the
capture batch's. All ranks of a CP group see the same batch, so they pick the same bucket and replay the
same graph; collectives inside breaks stay matched.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from graphcp.graph.cpu import CpuCapture
from graphcp.graph.cuda import CudaCapture, SyncCheckedWarmup
from graphcp.graph.protocol import BreakableGraph, BreakLog, GraphCaptureError, check_same_ops
from graphcp.profiling import nvtx_range, process_memory

log = logging.getLogger("graphcp")

DEFAULT_BUCKETS = {"cpu": (8, 16, 32, 64, 128, 256, 512),
                   "cuda": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)}


class GraphTarget(Protocol):
    def prepare_for_capture(self, bucket: int, seed: int) -> Any:
        """Load a batch that fills ``bucket`` into the static inputs; return it."""

    def prepare_for_replay(self, batch: Any) -> None:
        """Copy a live batch into the static inputs (one host-to-device copy)."""

    def forward(self, batch: Any) -> torch.Tensor:
        """The forward a graph captures: logits [rows, vocab]."""

    def static_tensors(self) -> list[torch.Tensor]:
        """Buffers the graphs read at fixed addresses."""

    def has_collective_breaks(self) -> bool:
        """Whether the forward meets peers inside breaks (then a failed capture must still meet them)."""


def select_bucket(buckets: list[int], real_max: int, needed: int,
                  failed: dict[int, str] | None = None) -> tuple[int | None, str | None]:
    """Smallest bucket holding ``needed`` rows, unless padding would exceed 2x the real count or that
    bucket failed to capture (it then serves eagerly). Returns (bucket, None) or (None, reason)."""
    failed = failed or {}
    fitting = [b for b in sorted(set(buckets) | set(failed)) if b >= needed]
    if not fitting:
        return None, f"no captured bucket holds {needed} tokens per rank (largest: {max(buckets, default=0)})"
    if fitting[0] in failed:
        return None, f"bucket {fitting[0]} failed to capture: {failed[fitting[0]]}"
    if fitting[0] > 2 * real_max:
        return None, f"bucket {fitting[0]} would pad {real_max} tokens per rank beyond 2x"
    return fitting[0], None


@dataclass
class BucketRecord:
    tokens: int
    capture_s: float
    memory_bytes: int
    error: str | None = None


class GraphRunner:
    """Captures ``target.forward`` per bucket and replays it; logits land in one static buffer."""

    def __init__(self, target: GraphTarget, device: torch.device, logits: torch.Tensor,
                 agree: Callable[[bool], bool]) -> None:
        self.target, self.device, self.logits = target, device, logits
        self.agree = agree                # all-rank AND of a flag, so every rank keeps the same buckets
        self.graphs: dict[int, BreakableGraph] = {}
        self.capture_batches: dict[int, Any] = {}
        self.records: dict[int, BucketRecord] = {}
        self.captures = 0                 # capture attempts so far: stays constant while serving
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None   # one for every bucket

    @property
    def buckets(self) -> list[int]:
        return sorted(self.graphs)

    @property
    def failures(self) -> dict[int, str]:
        return {b: r.error for b, r in self.records.items() if r.error}

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self, buckets: list[int], progress: bool = False) -> list[BucketRecord]:
        order = sorted(set(buckets), reverse=True)          # largest first: the pool is sized once
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="capturing graphs", unit="bucket", leave=True)
        for b in order:
            rec = self.capture(b)
            if bar is not None:
                bar.set_postfix(bucket=b, s=f"{rec.capture_s:.2f}", mem=_fmt_bytes(rec.memory_bytes))
                bar.update(1)
        if bar is not None:
            bar.close()
        return [self.records[b] for b in sorted(self.records)]

    def capture(self, bucket: int) -> BucketRecord:
        self.captures += 1
        t0, m0 = time.perf_counter(), process_memory(self.device)
        error = None
        try:
            with nvtx_range(f"capture:{bucket}"):
                graph = self._capture(bucket)
        except GraphCaptureError as e:
            error, graph = str(e), None
        except RuntimeError as e:
            if self.device.type != "cuda":
                raise
            # e.g. an op that is not permitted while a CUDA stream captures: serve this bucket eagerly.
            # The pool may still be marked as recording (torch builds where capture_end can throw
            # first): later buckets capture into a fresh one.
            error, graph = f"CUDA graph capture failed: {str(e).splitlines()[0][:300]}", None
            torch.cuda.synchronize()
            self.pool = torch.cuda.graph_pool_handle()
        if not self.agree(error is None):
            error = error or "another rank failed to capture this bucket"
        grown = max(0, process_memory(self.device) - m0)        # this process's pool: not another rank's
        rec = BucketRecord(bucket, time.perf_counter() - t0, grown, error)
        self.records[bucket] = rec
        if error is None:
            self.graphs[bucket] = graph
        else:
            log.warning("graphcp: bucket %d runs eagerly: capture failed: %s", bucket, error)
        return rec

    def _capture(self, bucket: int) -> BreakableGraph:
        """CUDA: an eager warmup (lazy inits, autotuning, host syncs refused), then one capture. CPU: two
        recorded passes with different batches, whose op sequences must agree. A rank whose capture fails
        partway still issues the collectives its peers meet (logged by the eager warmup)."""
        target, cuda = self.target, self.device.type == "cuda"

        def run(batch: Any) -> None:
            self.logits.copy_(target.forward(batch))

        batch = target.prepare_for_capture(bucket, seed=bucket)
        warmup = None
        if cuda or target.has_collective_breaks():
            warmup = SyncCheckedWarmup() if cuda else BreakLog()
            with warmup:
                run(batch)
        if cuda:
            torch.cuda.synchronize()
        passes = 1 if cuda else 2
        captures = []
        for i in range(passes):
            if i:
                batch = target.prepare_for_capture(bucket, seed=bucket + i)
            cap = CudaCapture(self.pool, self.stream) if cuda else CpuCapture()
            try:
                with cap:
                    run(batch)
            except BaseException:
                if warmup is not None:
                    warmup.drain(cap.graph.num_breaks, passes - i - 1)
                raise
            captures.append(cap)
        if not cuda:
            check_same_ops(captures[0].signature, captures[1].signature, bucket)
        self.capture_batches[bucket] = batch
        return captures[-1].finish(target.static_tensors() + [self.logits])

    # -- replay ----------------------------------------------------------------------------------
    def replay(self, bucket: int, batch: Any) -> torch.Tensor:
        """Copy the live batch in, replay, and return the static logits buffer."""
        self.target.prepare_for_replay(batch)
        with nvtx_range(f"graph_replay:{bucket}"):
            self.graphs[bucket].replay(swap=(self.capture_batches[bucket].host, batch.host))
        return self.logits


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"

"""Graph runner: bucket selection, capture of every bucket, and replay.

It knows nothing of layouts or models: it owns the static inputs (``GraphInputs``), captures a forward
function per bucket on a batch it is given, and at replay writes the live batch into the static inputs
and hands the batch's host data to the breaks that name it. All ranks of a CP group see the same batch,
so they pick the same bucket and replay the same graph; collectives inside breaks stay matched.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphcp.forward_batch import BatchInputs, ForwardBatch
from graphcp.graph.buffers import GraphInputs
from graphcp.graph.cpu import CpuCapture
from graphcp.graph.cpu_pool import CpuPool
from graphcp.graph.cuda import CudaCapture, SyncCheckedWarmup
from graphcp.graph.protocol import BreakableGraph, BreakLog, GraphCaptureError, PeerFailed, check_same_ops
from graphcp.profiling import nvtx_range, process_memory

log = logging.getLogger("graphcp")

DEFAULT_BUCKETS = {"cpu": (8, 16, 32, 64, 128, 256, 512),
                   "cuda": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)}


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


Forward = Callable[[ForwardBatch], torch.Tensor]
CaptureBatch = Callable[[int, int], tuple[BatchInputs, Any]]   # (bucket, seed) -> (batch, its layout)
ShareErrors = Callable[[str | None], list[str | None]]


def gather_errors(group: Any) -> ShareErrors:
    """``share_errors`` over a process group (None: a single rank)."""
    def share(error: str | None) -> list[str | None]:
        if group is None:
            return [error]
        out: list[str | None] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, error, group=group)
        return out
    return share


class GraphRunner:
    """Captures ``forward`` per bucket and replays it; logits land in the static inputs' logits buffer.
    ``agree``: all-rank AND of a flag, so every rank keeps the same buckets. ``collective_breaks``:
    the forward meets peers inside breaks (gloo: a failed capture must still meet them); otherwise
    (NCCL) its collectives are captured and every rank agrees at each segment's end instead.
    ``share_errors``: every rank's error (an all-gather), so a failure reads the same everywhere."""

    def __init__(self, forward: Forward, inputs: GraphInputs, device: torch.device,
                 agree: Callable[[bool], bool], collective_breaks: bool,
                 share_errors: ShareErrors | None = None) -> None:
        self.forward, self.inputs, self.device = forward, inputs, device
        self.agree, self.collective_breaks = agree, collective_breaks
        self.share_errors = share_errors
        self.graphs: dict[int, BreakableGraph] = {}
        self.records: dict[int, BucketRecord] = {}
        self.captures = 0                 # capture attempts so far: stays constant while serving
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else CpuPool()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None   # one for every bucket

    @property
    def buckets(self) -> list[int]:
        return sorted(self.graphs)

    @property
    def pool_bytes(self) -> int:
        """CPU: the replay arena every bucket shares; CUDA: 0 (its pool shows in the capture records)."""
        return self.pool.nbytes if isinstance(self.pool, CpuPool) else 0

    @property
    def failures(self) -> dict[int, str]:
        return {b: r.error for b, r in self.records.items() if r.error}

    def close(self) -> None:
        """Drop every graph and the static buffers (their memory returns to the allocator)."""
        self.graphs.clear()
        self.inputs = None
        self.pool = self.stream = None

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self, buckets: list[int], capture_batch: CaptureBatch,
                    progress: bool = False) -> list[BucketRecord]:
        """Capture every bucket, largest first (the pool is sized once), each on ``capture_batch(bucket,
        seed)``: a batch that fills it, whose pages are all the dummy page."""
        order = sorted(set(buckets), reverse=True)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="capturing graphs", unit="bucket", leave=True)
        for b in order:
            rec = self.capture(b, capture_batch)
            if bar is not None:
                bar.set_postfix(bucket=b, s=f"{rec.capture_s:.2f}", mem=_fmt_bytes(rec.memory_bytes))
                bar.update(1)
        if bar is not None:
            bar.close()
        return [self.records[b] for b in sorted(self.records)]

    def capture(self, bucket: int, capture_batch: CaptureBatch) -> BucketRecord:
        self.captures += 1
        t0, m0 = time.perf_counter(), process_memory(self.device)
        error, graph, own = None, None, True
        try:
            with nvtx_range(f"capture:{bucket}"):
                graph = self._capture(bucket, capture_batch)
        except PeerFailed as e:              # this rank stopped for a peer: the peer says why
            error, own = str(e), False
        except GraphCaptureError as e:
            error = str(e)
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
            error = self._agreed_error(error if own else None)
        grown = max(0, process_memory(self.device) - m0)        # this process's pool: not another rank's
        rec = BucketRecord(bucket, time.perf_counter() - t0, grown, error)
        self.records[bucket] = rec
        if error is None:
            self.graphs[bucket] = graph
        else:
            log.warning("graphcp: bucket %d runs eagerly: capture failed: %s", bucket, error)
        return rec

    def _agreed_error(self, own: str | None) -> str:
        """One message on every rank: the first failing rank's own error."""
        errors = self.share_errors(own) if self.share_errors is not None else [own]
        for rank, error in enumerate(errors):
            if error is not None:
                where = f"rank {rank} of {len(errors)}: " if len(errors) > 1 else ""
                return f"{where}{error}"
        return "another rank failed to capture this bucket"

    def _warmup(self, run: Callable[[ForwardBatch], None], batch: ForwardBatch) -> BreakLog | None:
        """The eager warmup before capture (CUDA: lazy inits, autotuning, host syncs refused; with
        collective breaks: the log of collectives a failed capture must still issue). A rank that fails
        here tells its peers at their next collective (a collective break, or under NCCL the
        ``collective_point`` before each collective), so no rank waits in a collective its peer
        never reaches (``BreakLog.agree``); every rank then serves the bucket eagerly."""
        cuda = self.device.type == "cuda"
        if not (cuda or self.collective_breaks):
            return None
        # gloo: before each collective break; NCCL: before each captured collective too
        agree = self.agree if (self.collective_breaks or cuda) else None
        warmup = SyncCheckedWarmup(agree) if cuda else BreakLog(agree)
        try:
            with warmup:
                run(batch)
        except PeerFailed:
            raise
        except Exception as e:
            if agree is not None:
                agree(False)
            raise GraphCaptureError(f"the eager warmup failed: {type(e).__name__}: {str(e)[:200]}") from None
        if agree is not None and not agree(True):
            raise PeerFailed("another rank's eager warmup failed")
        if cuda:
            torch.cuda.synchronize()
        return warmup

    def _capture(self, bucket: int, capture_batch: CaptureBatch) -> BreakableGraph:
        """CUDA: an eager warmup, then one capture. CPU: two recorded passes with different batches, whose
        op sequences must agree. A rank whose capture fails partway still issues the collectives its peers
        meet (logged by the eager warmup)."""
        inputs, cuda = self.inputs, self.device.type == "cuda"

        def load(seed: int) -> ForwardBatch:
            batch, layout = capture_batch(bucket, seed)
            inputs.set_batch(batch)
            return ForwardBatch(inputs.static, layout, inputs.aux)

        def run(batch: ForwardBatch) -> None:
            inputs.logits.copy_(self.forward(batch))

        batch = load(bucket)
        warmup = self._warmup(run, batch)
        passes = 1 if cuda else 2
        captures = []
        for i in range(passes):
            if i:
                batch = load(bucket + i)
            if cuda:      # NCCL: segment-end agreements; gloo: the warmup's collectives drained
                agree = None if self.collective_breaks else self.agree
                cap = CudaCapture(self.pool, self.stream, agree)
            else:
                cap = CpuCapture(pool=self.pool)
            try:
                with cap:
                    run(batch)
            except PeerFailed:
                raise
            except BaseException:
                if warmup is not None and self.collective_breaks:
                    warmup.drain(cap.graph.num_breaks, passes - i - 1)
                raise
            captures.append(cap)
        if not cuda:
            check_same_ops(captures[0].signature, captures[1].signature, bucket)
        return captures[-1].finish(inputs.tensors())

    # -- replay ----------------------------------------------------------------------------------
    def replay(self, bucket: int, batch: BatchInputs, host: Any) -> torch.Tensor:
        """Copy the live batch in, replay with its host data, and return the static logits buffer."""
        self.inputs.set_batch(batch)
        with nvtx_range(f"graph_replay:{bucket}"):
            self.graphs[bucket].replay(host=host)
        return self.inputs.logits


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"

"""Graph runner: eligibility, bucket selection, capture of every bucket, and replay.

All ranks of a CP group see the same batch, so they compute the same per-rank counts, pick the same bucket
and replay the same graph; collectives inside breaks stay matched.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from graphcp.cp.strategy import ContextParallelStrategy
from graphcp.graph.buffers import Descriptors
from graphcp.graph.capture import BreakableGraph, CpuCapture, CudaCapture, GraphCaptureError, check_same_ops
from graphcp.dist.procs import rss_bytes
from graphcp.profiling import gpu_memory_used, nvtx_range

if TYPE_CHECKING:
    from graphcp.config import EngineArgs

log = logging.getLogger("graphcp")

DEFAULT_BUCKETS = {"cpu": (8, 16, 32, 64, 128, 256, 512),
                   "cuda": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)}


def config_ineligibility(args: "EngineArgs", backend: str) -> str | None:
    """The one eligibility predicate for configurations (SPEC section 5); None means graphs are used."""
    if args.disable_cuda_graph:
        return "graphs disabled by --disable-cuda-graph"
    if args.pp_size > 1:
        return "pp_size > 1"
    if args.dp_size > 1:
        return "dp_size > 1"
    if args.attn_cp_size != args.tp_size:
        return "attn_cp_size != tp_size"
    if args.cp_size > 1 and args.cp_strategy != "zigzag":
        return f"--cp-strategy {args.cp_strategy} runs eagerly (graphs need zigzag)"
    if backend != "trtllm_mha":
        return f"--attention-backend {backend} runs eagerly (graphs need trtllm_mha)"
    return None


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
    """Captures ``forward(descriptors, local_cap) -> logits`` per bucket and replays it from static buffers."""

    def __init__(self, forward: Callable[[Descriptors, int], torch.Tensor], set_host: Callable[[list, list], None],
                 strategy: ContextParallelStrategy, device: torch.device, req_cap: int, pages_cap: int,
                 vocab_size: int, max_bucket: int, max_context: int, agree: Callable[[bool], bool]) -> None:
        self.forward, self.set_host, self.strategy, self.device = forward, set_host, strategy, device
        self.req_cap, self.pages_cap, self.max_context = req_cap, pages_cap, max_context
        ids_cap = strategy.cp_size * max_bucket
        self.static = Descriptors.allocate(req_cap, pages_cap, ids_cap, device)
        self.staging = Descriptors.allocate(req_cap, pages_cap, ids_cap, "cpu", pin=device.type == "cuda")
        self.logits = torch.zeros(req_cap, vocab_size, dtype=torch.float32, device=device)
        self.vocab_size = vocab_size
        self.graphs: dict[int, BreakableGraph] = {}
        self.records: dict[int, BucketRecord] = {}
        self.captures = 0                 # capture attempts so far: stays constant while serving
        self.agree = agree            # all-rank AND of a flag, so every rank keeps the same buckets
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

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
        t0, m0 = time.perf_counter(), _memory(self.device)
        error = None
        try:
            with nvtx_range(f"capture:{bucket}"):
                graph = self._capture(bucket)
        except GraphCaptureError as e:
            error, graph = str(e), None
        except RuntimeError as e:
            if self.device.type != "cuda":
                raise
            # e.g. an op that is not permitted while a CUDA stream captures: serve this bucket eagerly
            error, graph = f"CUDA graph capture failed: {str(e).splitlines()[0][:300]}", None
            torch.cuda.synchronize()
        if not self.agree(error is None):
            error = error or "another rank failed to capture this bucket"
        rec = BucketRecord(bucket, time.perf_counter() - t0, max(0, _memory(self.device) - m0), error)
        self.records[bucket] = rec
        if error is None:
            self.graphs[bucket] = graph
        else:
            log.warning("graphcp: bucket %d runs eagerly: capture failed: %s", bucket, error)
        return rec

    def _capture(self, bucket: int) -> BreakableGraph:
        def run() -> None:
            self.logits.copy_(self.forward(self.static, bucket))

        self._load_dummy(bucket, seed=bucket)
        if self.device.type == "cuda":
            run()                                            # warmup: lazy inits and autotuning outside capture
            torch.cuda.synchronize()
            with CudaCapture(self.pool) as cap:
                run()
        else:
            with CpuCapture() as first:                      # warmup, recorded only to compare op sequences
                run()
            self._load_dummy(bucket, seed=bucket + 1)
            with CpuCapture() as cap:
                run()
            check_same_ops(first.signature, cap.signature, bucket)
        return cap.finish([self.static.packed, self.logits])

    def _load_dummy(self, bucket: int, seed: int) -> None:
        """A random batch that fills ``bucket``; its pages are all the dummy page, so no real KV is touched."""
        rng = random.Random(seed)
        cp, align, ctx = self.strategy.cp_size, self.strategy.align, self.max_context
        min_len = 2 * cp if cp > 1 else 1
        n_min = max(1, -(-(bucket * cp // 2) // ctx))
        if n_min > self.req_cap:
            raise GraphCaptureError(f"bucket {bucket}: no batch of <= {self.req_cap} requests within the "
                                    f"context limit {ctx} fills it")
        n_req = rng.randint(n_min, max(n_min, min(self.req_cap, bucket * cp // (2 * min_len))))
        hi = min(max(n_req * min_len, bucket * cp), n_req * ctx)
        for _ in range(1000):
            target = rng.randint(min(hi, max(n_req * min_len, bucket * cp // 2)), hi)
            extra = target - n_req * min_len
            cuts = sorted(rng.randint(0, extra) for _ in range(n_req - 1))
            ext = [min_len + b - a for a, b in zip([0] + cuts, cuts + [extra])]
            if max(ext) <= ctx and -(-max(self.strategy.per_rank_tokens(ext)) // align) * align <= bucket:
                break
            hi = max(n_req * min_len, target - 1)
        else:
            raise GraphCaptureError(f"bucket {bucket}: no batch of <= {self.req_cap} requests within the "
                                    f"context limit {ctx} fills it")
        prefix = [rng.randint(0, min(64, self.max_context - e)) for e in ext]
        ids = [torch.randint(0, self.vocab_size, (e,), generator=torch.Generator().manual_seed(seed)) for e in ext]
        self.staging.fill(ext, prefix, [[] for _ in ext], ids)
        self.static.packed.copy_(self.staging.packed)
        self.set_host(ext, prefix)

    # -- replay ----------------------------------------------------------------------------------
    def replay(self, bucket: int, extend_lens: list[int], prefix_lens: list[int], page_rows: list[list[int]],
               ids: list[torch.Tensor], count_host_ops: bool = False) -> tuple[torch.Tensor, int]:
        """Copy the raw descriptors in (one copy), replay, and return (logits [R, V], host launches)."""
        self.staging.fill(extend_lens, prefix_lens, page_rows, ids)
        self.static.packed.copy_(self.staging.packed, non_blocking=True)
        graph = self.graphs[bucket]
        graph.count_host_ops = count_host_ops
        with nvtx_range(f"graph_replay:{bucket}"):
            graph.replay()
        return self.logits[:len(extend_lens)], graph.host_ops + 1   # +1: the descriptor copy


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        used = gpu_memory_used(device.index or 0)
        return used if used is not None else torch.cuda.memory_reserved(device)
    return rss_bytes()


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"

"""SPMD script for torchrun: rank 1's eager warmup of bucket 64 fails after its first graph break (an
injected out-of-memory), then its capture of bucket 32 fails after its second graph break (a failure
injected into the capture backend), while rank 0's succeed. Both ranks must finish start-up (no hang in
mismatched collectives), agree that buckets 64 and 32 serve eagerly, and serve exactly.
Usage: torchrun --nproc-per-node 2 spmd_capture_fail.py CKPT OUT"""
import json
import os
import sys

from graphcp import Engine, EngineArgs, Request
from graphcp.graph.cpu import CpuCapture
from graphcp.graph.protocol import BreakLog, GraphCaptureError

ckpt, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
breaks = {"n": 0}
original = CpuCapture.run_break


def failing_run_break(self, fn, args, kwargs):
    breaks["n"] += 1
    if rank == 1 and breaks["n"] == 2:          # the first pass of the first (largest) bucket
        raise GraphCaptureError("injected: capture failed on rank 1 only")
    return original(self, fn, args, kwargs)


warmup_breaks = {"n": 0}
original_warmup = BreakLog.run_break


def failing_warmup_break(self, fn, args, kwargs):
    warmup_breaks["n"] += 1
    if rank == 1 and warmup_breaks["n"] == 2:   # the first (largest) bucket's warmup, past one break
        raise RuntimeError("injected: CUDA out of memory on rank 1 only")
    return original_warmup(self, fn, args, kwargs)


CpuCapture.run_break = failing_run_break
BreakLog.run_break = failing_warmup_break
args = EngineArgs.from_cli(["--model-path", ckpt, "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
                            "--cp-strategy", "zigzag", "--max-total-tokens", "2048",
                            "--cuda-graph-buckets", "16", "32", "64", "--rank-timeout", "30"])
ids = {"a": list(range(3, 40)), "b": [(7 * i) % 200 for i in range(1, 25)]}
with Engine(args) as engine:
    stats = engine.stats()
    big = engine.prefill([Request(rid, tokens) for rid, tokens in ids.items()])      # 31 per rank: bucket 32
    small = engine.prefill([Request("c", list(range(5, 30)))])                       # 13 per rank: bucket 16
    larger = engine.prefill([Request("d", list(range(1, 101)))])                     # 50 per rank: bucket 64
    result = {"logits": big.logits.tolist(), "mode": big.mode, "reason": big.eager_reason,
              "larger_logits": larger.logits.tolist(), "larger_reason": larger.eager_reason,
              "small_mode": small.mode, "small_bucket": small.graph_bucket, "buckets": stats["graph_buckets"],
              "failures": {str(k): v for k, v in stats["capture_failures"].items()}}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)

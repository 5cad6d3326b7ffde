"""SPMD script for torchrun: rank 1's capture of bucket 32 fails after its second graph break (a failure
injected into the capture backend) while rank 0's succeeds. Both ranks must finish start-up (no hang in
mismatched collectives), agree that bucket 32 serves eagerly, and serve exactly.
Usage: torchrun --nproc-per-node 2 spmd_capture_fail.py CKPT OUT"""
import json
import os
import sys

from graphcp import Engine, EngineArgs, Request
from graphcp.graph.cpu import CpuCapture
from graphcp.graph.protocol import GraphCaptureError

ckpt, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
breaks = {"n": 0}
original = CpuCapture.run_break


def failing_run_break(self, fn, args, kwargs):  # noqa: ANN001, ANN201
    breaks["n"] += 1
    if rank == 1 and breaks["n"] == 2:          # the first pass of the first (largest) bucket
        raise GraphCaptureError("injected: capture failed on rank 1 only")
    return original(self, fn, args, kwargs)


CpuCapture.run_break = failing_run_break
args = EngineArgs.from_cli(["--model-path", ckpt, "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
                            "--cp-strategy", "zigzag", "--max-total-tokens", "2048", "--cuda-graph-buckets", "16", "32",
                            "--rank-timeout", "30"])
ids = {"a": list(range(3, 40)), "b": [(7 * i) % 200 for i in range(1, 25)]}
with Engine(args) as engine:
    stats = engine.stats()
    big = engine.prefill([Request(rid, tokens) for rid, tokens in ids.items()])      # 31 per rank: bucket 32
    small = engine.prefill([Request("c", list(range(5, 30)))])                       # 13 per rank: bucket 16
    result = {"logits": big.logits.tolist(), "mode": big.mode, "reason": big.eager_reason,
              "small_mode": small.mode, "small_bucket": small.graph_bucket, "buckets": stats["graph_buckets"],
              "failures": {str(k): v for k, v in stats["capture_failures"].items()}}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)

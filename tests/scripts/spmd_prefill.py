"""SPMD script for torchrun: every rank builds the Engine (joining the torchrun group) and calls prefill
with the same batch; each rank writes what it got. Usage: torchrun --nproc-per-node 2 spmd_prefill.py CKPT OUT"""
import json
import os
import sys

import torch

from graphcp import Engine, EngineArgs, Request

ckpt, out_dir = sys.argv[1], sys.argv[2]
args = EngineArgs.from_cli(["--model-path", ckpt, "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
                            "--cp-strategy", "zigzag", "--max-total-tokens", "2048",
                            "--cuda-graph-buckets", "16", "32"])
ids = {"a": list(range(3, 40)), "b": [(7 * i) % 200 for i in range(1, 25)]}
with Engine(args) as engine:
    out = engine.prefill([Request(rid, tokens) for rid, tokens in ids.items()])
    kv = engine.kv_cache("a")
    result = {"logits": out.logits.tolist(), "mode": out.mode, "bucket": out.graph_bucket,
              "per_rank_tokens": out.per_rank_tokens, "kv_len": kv[0][0].shape[1], "stats": engine.stats()}
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
assert not torch.distributed.is_initialized(), "the engine ends the process group it started"

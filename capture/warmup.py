"""Capture every graph bucket of a configuration offline, check each replay against eager, write a plan.

    python capture/warmup.py --model-path CKPT --tp 2 --attn-cp-size 2 --enable-prefill-cp \\
        --cp-strategy zigzag --out plan.json
    # later: EngineArgs(..., capture_plan="plan.json")  or  --capture-plan plan.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphcp import ConfigError, Engine, EngineArgs, Request
from graphcp.capture_plan import PLAN_VERSION, plan_config
from graphcp.checkpoint.config import read_model_config
from graphcp.cp.strategy import ContextParallelStrategy, make_strategy


def batch_for_bucket(bucket: int, strategy: ContextParallelStrategy, req_cap: int, max_context: int,
                     vocab: int, seed: int) -> list[Request]:
    """Fresh requests that this bucket serves: the strategy's own rule for a batch that fills a bucket
    (the one the engine captures with), without cached prefixes."""
    dummy = strategy.dummy_batch(bucket, req_cap, max_context, seed, prefixes=False)
    if dummy is None:
        raise ValueError(f"no batch of <= {req_cap} requests within {max_context} tokens fills bucket {bucket}")
    rng = random.Random(seed)
    return [Request(f"warmup{i}", [rng.randrange(vocab) for _ in range(n)]) for i, n in enumerate(dummy[0])]


def _once(engine: Engine, batch: list[Request], force_eager: bool = False):
    out = engine.prefill(batch, force_eager=force_eager)
    for r in batch:
        engine.release(r.rid)
    return out


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def eager_spread(engine: Engine, batch: list[Request], eager_logits, strategy: ContextParallelStrategy,
                 vocab: int) -> float:
    """How much eager logits move when only the GEMM row count changes (one more request in the batch):
    the rounding noise of the dtype (bf16 GEMMs pick other tilings for other M), against which a replay
    that pads to its bucket must be judged. 0 for exact arithmetic."""
    length = max(strategy.min_request_len, 8)
    filler = Request("warmup-filler", [random.Random(0).randrange(vocab) for _ in range(length)])
    wider = _once(engine, batch + [filler], force_eager=True)
    return _rel(wider.logits[:len(batch)], eager_logits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--out", required=True, help="where to write the capture plan (JSON)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max relative |graph - eager| of the logits accepted (default: 4x the measured "
                             "eager-vs-eager spread of the bucket's batch, at least 1e-6)")
    ns = parser.parse_args(argv)
    try:
        args = EngineArgs.from_namespace(ns)
        if args.capture_plan:
            raise ConfigError("--capture-plan makes no sense for warmup: it writes the plan (--out)")
    except ConfigError as e:
        print(f"warmup: {e}", file=sys.stderr)
        return 2
    cfg = read_model_config(args.model_path)
    vocab = cfg.vocab_size
    buckets = []
    with Engine(args) as engine:
        stats = engine.stats()
        max_context = min(cfg.max_position_embeddings, stats["kv_tokens_total"])
        if stats["eager_reason"]:
            print(f"warmup: this configuration runs eagerly ({stats['eager_reason']}); nothing to capture",
                  file=sys.stderr)
            return 2
        for rec in sorted(stats["capture_records"], key=lambda r: r["tokens"]):
            entry = {"tokens": rec["tokens"], "capture_s": round(rec["capture_s"], 4),
                     "memory_bytes": rec["memory_bytes"], "replay_matches_eager": False}
            if rec["error"]:
                entry["error"] = rec["error"]
            else:
                strategy = make_strategy(args.resolved_cp_strategy, args.cp_size)
                batch = batch_for_bucket(rec["tokens"], strategy, args.max_batch_requests, max_context, vocab,
                                         rec["tokens"])
                graph = _once(engine, batch)
                eager = _once(engine, batch, force_eager=True)
                spread = eager_spread(engine, batch, eager.logits, strategy, vocab)
                tol = ns.tolerance if ns.tolerance is not None else max(4 * spread, 1e-6)
                diff = _rel(graph.logits, eager.logits)
                entry.update(replay_bucket=graph.graph_bucket, max_rel_diff=diff, eager_spread=spread,
                             tolerance=tol, replay_matches_eager=graph.graph_bucket == rec["tokens"] and diff <= tol)
            buckets.append(entry)
            if rec["error"]:
                detail = f" (capture failed: {rec['error']})"
            else:
                detail = f" (rel diff {entry['max_rel_diff']:.2e}, tolerance {entry['tolerance']:.2e})"
            print(f"  bucket {entry['tokens']:>5}: capture {entry['capture_s']:.2f} s, "
                  f"{entry['memory_bytes'] / 2**20:.1f} MiB, replay matches eager: {entry['replay_matches_eager']}"
                  + detail)
    plan = {"version": PLAN_VERSION, "config": plan_config(args), "buckets": buckets,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(ns.out, "w") as f:
        json.dump(plan, f, indent=2)
    ok = sum(b["replay_matches_eager"] for b in buckets)
    print(f"wrote {ns.out}: {ok}/{len(buckets)} buckets validated")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

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

from graphcp import ConfigError, Engine, EngineArgs, Request  # noqa: E402
from graphcp.capture_plan import PLAN_VERSION, plan_config  # noqa: E402
from graphcp.cp.strategy import make_strategy  # noqa: E402
from graphcp.models import read_model_config  # noqa: E402


def batch_for_bucket(bucket: int, cp: int, req_cap: int, vocab: int, seed: int) -> list[Request]:
    """Requests whose largest per-rank count lands in (bucket/2, bucket], so that bucket is replayed."""
    rng = random.Random(seed)
    strategy = make_strategy("zigzag", cp)
    for n_req in range(min(req_cap, 4), 0, -1):
        length = max(2 * cp, bucket * cp * 9 // (10 * n_req))
        lens = [length] * n_req
        need = max(strategy.per_rank_tokens(lens))
        if bucket // 2 < need and -(-need // strategy.align) * strategy.align <= bucket:
            return [Request(f"warmup{i}", [rng.randrange(vocab) for _ in range(n)]) for i, n in enumerate(lens)]
    raise ValueError(f"no batch fills bucket {bucket}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--out", required=True, help="where to write the capture plan (JSON)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max |graph - eager| logits accepted (default: 1e-6 fp32, 2e-2 otherwise)")
    ns = parser.parse_args(argv)
    try:
        args = EngineArgs.from_namespace(ns)
        if args.capture_plan:
            raise ConfigError("--capture-plan makes no sense for warmup: it writes the plan (--out)")
    except ConfigError as e:
        print(f"warmup: {e}", file=sys.stderr)
        return 2
    tol = ns.tolerance if ns.tolerance is not None else (1e-6 if args.resolved_device() == "cpu" and
                                                          args.dtype in ("auto", "float32") else 2e-2)
    vocab = read_model_config(args.model_path).vocab_size
    buckets = []
    with Engine(args) as engine:
        stats = engine.stats()
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
                batch = batch_for_bucket(rec["tokens"], args.cp_size, args.max_batch_requests, vocab, rec["tokens"])
                graph = engine.prefill(batch)
                for r in batch:
                    engine.release(r.rid)
                eager = engine.prefill(batch, force_eager=True)
                for r in batch:
                    engine.release(r.rid)
                diff = float((graph.logits - eager.logits).abs().max())
                entry.update(replay_bucket=graph.graph_bucket, max_abs_diff=diff,
                             replay_matches_eager=graph.graph_bucket == rec["tokens"] and diff <= tol)
            buckets.append(entry)
            print(f"  bucket {entry['tokens']:>5}: capture {entry['capture_s']:.2f} s, "
                  f"{entry['memory_bytes'] / 2**20:.1f} MiB, replay matches eager: {entry['replay_matches_eager']}"
                  + (f" (max |diff| {entry.get('max_abs_diff', float('nan')):.2e})" if not rec["error"] else
                     f" (capture failed: {rec['error']})"))
    plan = {"version": PLAN_VERSION, "config": plan_config(args), "buckets": buckets,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(ns.out, "w") as f:
        json.dump(plan, f, indent=2)
    ok = sum(b["replay_matches_eager"] for b in buckets)
    print(f"wrote {ns.out}: {ok}/{len(buckets)} buckets validated")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

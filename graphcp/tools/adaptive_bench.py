"""``graphcp adaptive-bench``: static zigzag vs adaptive CP vs unsharded, side by side, on an all-short
and a mixed batch at the given CP size.

Tokens/s is the median prefill wall time over ``--reps`` runs (graphs where the engine uses them). Rank
work is the adaptive engine's calibrated cost model summed over each rank's rows (per token, plus per
key each query attends); max/mean says how evenly a layout spreads it. Unsharded runs the whole batch on
every rank, which is what a CP=1 engine runs: that column is measured on one.
"""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time

import torch

from graphcp.batch import Request
from graphcp.config import EngineArgs
from graphcp.tools.cli import engine_args, engine_parser

CASES = {"all_short": [40, 3, 24, 2, 33, 17, 3, 10], "mixed": [384, 3, 48, 20, 2, 64]}   # some < 2C


def rank_work(strategy, extend_lens: list[int], cost) -> list[float]:  # noqa: ANN001
    """Modelled seconds of each CP rank's rows for a fresh batch (no cached prefix)."""
    layout = strategy.layout(extend_lens, [0] * len(extend_lens), 0)
    if not layout.cp_applied:     # static zigzag on short requests: every rank runs all of it
        total = sum(cost.work(n, 0) for n in extend_lens)
        return [total] * strategy.cp_size
    placed, lens, cap = layout.strategy, torch.tensor(extend_lens), layout.local_cap
    pages = torch.zeros(len(extend_lens), max(extend_lens), dtype=torch.long)
    whole_on = torch.tensor(placed.whole_on) if placed.whole_on is not None else None
    work = []
    for rank in range(strategy.cp_size):
        meta = placed.metadata(lens, torch.zeros_like(lens), pages, rank, cap, 1, whole_on)
        keys = (meta.q_limits * meta.valid).sum().item()
        work.append(cost.per_token * int(meta.valid.sum()) + cost.per_pair * keys)
    return work


def adaptive_bench(args: EngineArgs, reps: int = 3, seed: int = 0) -> dict:
    from graphcp import Engine
    from graphcp.cp.strategy import ZigzagStrategy
    from graphcp.checkpoint.config import read_model_config
    vocab = read_model_config(args.model_path).vocab_size
    rng = random.Random(seed)
    batches = {name: [[rng.randrange(vocab) for _ in range(n)] for n in lens] for name, lens in CASES.items()}
    layouts = {"static zigzag": dataclasses.replace(args, enable_adaptive_cp=False, adaptive_cp_threshold=None),
               "adaptive": dataclasses.replace(args, enable_adaptive_cp=True),
               "unsharded": dataclasses.replace(args, tp_size=1, attn_cp_size=1, enable_prefill_cp=False,
                                                enable_adaptive_cp=False, adaptive_cp_threshold=None)}
    rows, cost, threshold, strategies = [], None, None, {}
    for layout, layout_args in layouts.items():
        with Engine(layout_args) as engine:
            if layout == "adaptive":
                model = engine.stats()["adaptive_cp"]
                threshold = model["threshold"]
                from graphcp.cp.adaptive import AdaptiveZigzagStrategy, CostModel
                cost = CostModel(model["per_token_s"], model["per_pair_s"], model["per_gather_token_s"],
                                 model["fixed_s"])
                strategies[layout] = AdaptiveZigzagStrategy(args.cp_size, threshold, cost)
            for name, ids in batches.items():
                times, out = [], None
                for rep in range(reps + 1):                 # the first run warms up
                    reqs = [Request(f"{name}{i}-{rep}", t) for i, t in enumerate(ids)]
                    start = time.perf_counter()
                    out = engine.prefill(reqs)
                    if rep:
                        times.append(time.perf_counter() - start)
                    for r in reqs:
                        engine.release(r.rid)
                tokens = sum(len(t) for t in ids)
                rows.append({"batch": name, "layout": layout, "mode": out.mode, "cp_applied": out.cp_applied,
                             "per_rank_tokens": out.per_rank_tokens,
                             "tokens_per_s": tokens / statistics.median(times)})
    strategies["static zigzag"] = ZigzagStrategy(args.cp_size)
    for row in rows:
        lens = CASES[row["batch"]]
        work = (rank_work(strategies[row["layout"]], lens, cost) if row["layout"] != "unsharded"
                else [sum(cost.work(n, 0) for n in lens)] * args.cp_size)
        row["max_rank_work_ms"] = 1e3 * max(work)
        row["max_over_mean"] = max(work) / (sum(work) / len(work))
    return {"cp_size": args.cp_size, "threshold": threshold, "cost_model": dataclasses.asdict(cost),
            "reps": reps, "cases": rows}


def run(argv: list[str]) -> int:
    parser = engine_parser("graphcp adaptive-bench", "Static zigzag vs adaptive CP vs unsharded.", cp_default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the report here")
    ns = parser.parse_args(argv)
    args = engine_args(ns)
    report = adaptive_bench(args, ns.reps)
    print(f"CP {report['cp_size']}: adaptive splits requests of >= {report['threshold']} new tokens; "
          f"cost model {report['cost_model']}")
    print(f"{'batch':>10} {'layout':>14} {'mode':>6} {'tokens/s':>9} {'rank tokens':>14} "
          f"{'max rank work ms':>17} {'max/mean':>8}")
    for c in report["cases"]:
        print(f"{c['batch']:>10} {c['layout']:>14} {c['mode']:>6} {c['tokens_per_s']:>9.0f} "
              f"{c['per_rank_tokens']!s:>14} {c['max_rank_work_ms']:>17.2f} {c['max_over_mean']:>8.3f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report | {"config": args.to_dict()}, f, indent=2)
    return 0

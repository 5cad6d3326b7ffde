"""``graphcp adaptive-bench``: the calibrated adaptive placement beside both of its extremes
("split everything": every request of >= 2C tokens zigzag; "keep whole": every request whole on one
rank, placed to balance), static zigzag and unsharded, on an all-short, a mixed and a lone-request
batch.

Times are medians (and the fastest) over ``--reps`` prefills (graphs where the engine uses them).
The three adaptive layouts run side by side, their prefills interleaved, so a burst of background
load hits them alike; the ratio is the calibrated placement's time over the better extreme's (the
target: <= 1.15), and where it places a batch as an extreme does, that is said (the two then differ
by noise alone). Modelled ms is the calibrated cost model's forward time for each layout
(``CostModel.seconds``). Unsharded runs the whole batch on every rank, which is what a CP=1 engine
runs: that row is measured on one.
"""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time

from graphcp.batch import Request
from graphcp.config import EngineArgs
from graphcp.tools.cli import engine_args, engine_parser

CASES = {"all_short": [40, 3, 24, 2, 33, 17, 3, 10],      # some < 2C
         "mixed": [384, 3, 48, 20, 2, 64], "lone": [300]}
ADAPTIVE = ("adaptive", "split everything", "keep whole")
TARGET = 1.15


def _layouts(args: EngineArgs) -> dict[str, EngineArgs]:
    static = dict(enable_adaptive_cp=False, adaptive_cp_threshold=None)
    def adaptive(threshold: int | None) -> EngineArgs:
        return dataclasses.replace(args, enable_adaptive_cp=True, adaptive_cp_threshold=threshold)
    return {"adaptive": adaptive(None), "split everything": adaptive(2 * args.cp_size),
            "keep whole": adaptive(10 ** 9), "static zigzag": dataclasses.replace(args, **static),
            "unsharded": dataclasses.replace(args, tp_size=1, attn_cp_size=1,
                                             enable_prefill_cp=False, **static)}


def _time(engines: dict, batches: dict, reps: int) -> list[dict]:
    """Median and fastest prefill time per (batch, layout); the engines' prefills interleaved, rep
    by rep."""
    rows = []
    for name, ids in batches.items():
        times: dict[str, list[float]] = {layout: [] for layout in engines}
        outs = {}
        for rep in range(reps + 1):                     # the first round warms up
            for layout, engine in engines.items():
                reqs = [Request(f"{name}{i}-{rep}", t) for i, t in enumerate(ids)]
                start = time.perf_counter()
                outs[layout] = engine.prefill(reqs)
                if rep:
                    times[layout].append(time.perf_counter() - start)
                for r in reqs:
                    engine.release(r.rid)
        for layout, out in outs.items():
            median = statistics.median(times[layout])
            rows.append({"batch": name, "layout": layout, "mode": out.mode,
                         "cp_applied": out.cp_applied, "per_rank_tokens": out.per_rank_tokens,
                         "median_ms": 1e3 * median, "min_ms": 1e3 * min(times[layout]),
                         "tokens_per_s": sum(map(len, ids)) / median})
    return rows


def adaptive_bench(args: EngineArgs, reps: int = 15, seed: int = 0) -> dict:
    from graphcp import Engine
    from graphcp.checkpoint.config import read_model_config
    from graphcp.cp.adaptive import AdaptiveZigzagStrategy, CostModel
    from graphcp.cp.strategy import make_strategy
    vocab = read_model_config(args.model_path).vocab_size
    rng = random.Random(seed)
    batches = {name: [[rng.randrange(vocab) for _ in range(n)] for n in lens]
               for name, lens in CASES.items()}
    layouts, rows = _layouts(args), []
    engines = {name: Engine(layouts[name]) for name in ADAPTIVE}
    try:
        calibration = engines["adaptive"].stats()["adaptive_cp"]
        rows += _time(engines, batches, reps)
    finally:
        for engine in engines.values():
            engine.close()
    for name in ("static zigzag", "unsharded"):
        with Engine(layouts[name]) as engine:
            rows += _time({name: engine}, batches, reps)
    cost = CostModel(*(calibration[k] for k in ("per_token_s", "per_pair_s",
                                                "per_gather_token_s", "fixed_s", "per_split_s")))
    cp = args.cp_size
    strategies = {"adaptive": AdaptiveZigzagStrategy(cp, calibration["threshold"], cost),
                  "split everything": AdaptiveZigzagStrategy(cp, 2 * cp),
                  "keep whole": AdaptiveZigzagStrategy(cp, 10 ** 9),
                  "static zigzag": make_strategy("zigzag", cp),
                  "unsharded": make_strategy("zigzag", 1)}
    for row in rows:
        lens = CASES[row["batch"]]
        row["modelled_ms"] = 1e3 * cost.seconds(strategies[row["layout"]], lens, [0] * len(lens))
    verdicts = []
    for name, lens in CASES.items():
        ms = {r["layout"]: r for r in rows if r["batch"] == name}
        placed = {layout: strategies[layout].layout(lens, [0] * len(lens), 0).whole_on
                  for layout in ADAPTIVE}
        same = [layout for layout in ADAPTIVE[1:] if placed[layout] == placed["adaptive"]]
        verdict = {"batch": name, "adaptive_places_as": same}
        for stat in ("median_ms", "min_ms", "modelled_ms"):
            best = min(ms["split everything"][stat], ms["keep whole"][stat])
            verdict |= {f"{layout} {stat}": ms[layout][stat] for layout in ADAPTIVE}
            verdict[f"ratio {stat}"] = ms["adaptive"][stat] / best
        verdicts.append(verdict)
    return {"cp_size": cp, "calibration": calibration, "reps": reps, "cases": rows,
            "verdicts": verdicts}


def run(argv: list[str]) -> int:
    parser = engine_parser("graphcp adaptive-bench", "Adaptive CP beside split-everything, "
                           "keep-whole, static zigzag and unsharded.", cp_default=2)
    parser.add_argument("--reps", type=int, default=15, help="timed prefills per batch and layout")
    parser.add_argument("--json", default=None, help="write the report here")
    ns = parser.parse_args(argv)
    args = engine_args(ns)
    report = adaptive_bench(args, ns.reps)
    cal = report["calibration"]
    print(f"CP {report['cp_size']}: adaptive splits requests of >= {cal['threshold']} new tokens "
          f"({cal['threshold_from']}); calibrated in {cal['calibration_s']:.2f} s")
    print(f"fitted: per token {cal['per_token_s'] * 1e6:.3g} us, per pair "
          f"{cal['per_pair_s'] * 1e9:.3g} ns, all-gather per token "
          f"{cal['per_gather_token_s'] * 1e6:.3g} us, fixed {cal['fixed_s'] * 1e3:.3g} ms, "
          f"per split request {cal['per_split_s'] * 1e3:.3g} ms; fit residual "
          f"{100 * cal['fit_residual']:.1f}% rms")
    print("lone request whole/split ms: " + ", ".join(
        f"{n}: {1e3 * w:.1f}/{1e3 * s:.1f}" for n, w, s in cal["crossover"]))
    for note in cal["fallbacks"]:
        print(f"fallback: {note}")
    print(f"{'batch':>10} {'layout':>16} {'mode':>6} {'median ms':>10} {'min ms':>8} "
          f"{'tokens/s':>9} {'rank tokens':>14} {'modelled ms':>12}")
    for c in report["cases"]:
        print(f"{c['batch']:>10} {c['layout']:>16} {c['mode']:>6} {c['median_ms']:>10.1f} "
              f"{c['min_ms']:>8.1f} {c['tokens_per_s']:>9.0f} {c['per_rank_tokens']!s:>14} "
              f"{c['modelled_ms']:>12.1f}")
    print(f"adaptive over the better of split everything and keep whole (target <= {TARGET}):")
    for v in report["verdicts"]:
        same = (f"; places the batch as {' and '.join(v['adaptive_places_as'])} does"
                if v["adaptive_places_as"] else "")
        print(f"{v['batch']:>10}: " + ", ".join(
            f"{stat[:-3]} {v['adaptive ' + stat]:.1f} vs {v['split everything ' + stat]:.1f} / "
            f"{v['keep whole ' + stat]:.1f} ms = {v['ratio ' + stat]:.2f}x"
            for stat in ("median_ms", "min_ms", "modelled_ms")) + same)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report | {"config": args.to_dict()}, f, indent=2)
    return 0

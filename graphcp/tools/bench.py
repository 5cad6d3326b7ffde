"""``graphcp bench``: graphcp graph vs graphcp eager vs HF transformers, side by side in one run.

Every case runs the same batch through the three paths on the same checkpoint, alternating them so machine
noise hits all three alike; medians and ratios are reported, with the host launches per forward and the
per-rank attention balance of each CP layout.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from graphcp.checkpoint.config import read_model_config
from graphcp.config import resolve_dtype
from graphcp.models.deepseek.config import MLAConfig
from graphcp.models.deepseek_v4.config import DeepseekV4Config
from graphcp.models.qwen3_next.config import HybridConfig
from graphcp.tools.cli import engine_args, engine_parser
from graphcp.tools.dsa_balance import dsa_table, v4_table
from graphcp.tools.hf_baseline import HFModel, time_ms
from graphcp.tools.linear_balance import linear_table

DEFAULT_CASES = ("1x64", "4x64", "1x256", "8x64", "2x256", "1x512")


def parse_case(text: str) -> tuple[int, int]:
    n, length = text.lower().split("x")
    return int(n), int(length)


def attention_balance(strategy: str, cp: int, extend_lens: list[int]) -> float:
    """max/mean over ranks of the keys their queries attend (causal work); 1.0 is perfect."""
    if cp == 1:
        return 1.0
    from graphcp.cp import build_layout
    work = []
    for rank in range(cp):
        lay = build_layout(strategy, cp, rank, extend_lens)
        if strategy == "zigzag":
            total = 0
            for q_lens, kv_lens in ((lay.q_lens_early, lay.kv_lens_early), (lay.q_lens_late, lay.kv_lens_late)):
                total += sum(q * kv - q * (q - 1) // 2 for q, kv in zip(q_lens, kv_lens))
            work.append(total)
        else:
            work.append(sum(lay.kv_lens))
    return max(work) / (sum(work) / cp)


def run(argv: list[str]) -> int:
    if "--kv-sharding" in argv:          # capacity and gathered bytes with / without KV sharding
        from graphcp.tools import shard_bench
        return shard_bench.run([a for a in argv if a != "--kv-sharding"])
    if "--scale" in argv:                # one request from 1K to 64K tokens at CP 1, 2, 4: its own flags
        from graphcp.tools import scale_bench
        return scale_bench.run([a for a in argv if a != "--scale"])
    # Engine defaults (CP=1): the fair comparison with HF on the same devices; pass the CP flags to bench CP.
    parser = engine_parser("graphcp bench", "graphcp graph vs eager vs HF transformers, side by side.", cp_default=1)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="NxL: N requests of L tokens")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per case (medians reported)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON")
    parser.add_argument("--plot", default=None, help="also draw the results into this PNG file")
    parser.add_argument("--adaptive", action="store_true",
                        help="instead of the cases: adaptive CP beside split-everything, keep-whole, static zigzag "
                             "and unsharded on all-short, mixed and lone batches (default CP 2)")
    parser.add_argument("--scale", action="store_true",
                        help="instead of the cases: one request at 1K to 64K tokens (128K with --long) at CP 1, 2 "
                             "and 4 beside HF, with a log-log plot (flags: graphcp bench --scale --help)")
    parser.add_argument("--kv-sharding", action="store_true",
                        help="instead of the cases: capacity and per-layer gathered bytes with "
                             "and without --enable-kv-cache-sharding at 4K-64K cached prefixes "
                             "(flags: graphcp bench --kv-sharding --help)")
    parser.add_argument("--real-model", action="store_true",
                        help="bench the real trained model (SmolLM2-135M-Instruct, GGUF) instead of the random one")
    parser.add_argument("--balance-cp", type=int, default=None,
                        help="CP size for the layout-balance columns (default: the run's, or 4 at CP=1)")
    ns = parser.parse_args(argv)
    if ns.adaptive:                      # the same report as ``graphcp adaptive-bench``
        from graphcp.tools import adaptive_bench
        flags = [a for a in argv if a != "--adaptive"]
        return adaptive_bench.run(flags if "--attn-cp-size" in flags else flags + ["--tp", "2", "--attn-cp-size", "2",
                                                                                    "--enable-prefill-cp",
                                                                                    "--cp-strategy", "zigzag"])
    if ns.real_model and ns.model_path is None:
        from graphcp.checkpoint.real_model import smollm2_path
        ns.model_path = smollm2_path()
    args = engine_args(ns)
    cases = [parse_case(c) for c in ns.cases]
    if args.max_total_tokens is None:
        args = dataclasses.replace(args, max_total_tokens=max(n * length for n, length in cases) + 1024)
    from graphcp import Engine, Request
    vocab = read_model_config(args.model_path).vocab_size
    hf = None
    if not ns.no_hf:
        try:
            hf = HFModel(args.model_path, args.resolved_device())
        except ImportError:
            print("transformers is not installed: HF column skipped (pip install graphcp[test])")
    gen = torch.Generator().manual_seed(0)
    balance_cp = ns.balance_cp or (args.cp_size if args.cp_size > 1 else 4)
    results = []
    print(f"graphcp bench: {args.model_path}  CP={args.cp_size} {args.cp_strategy or ''}  "
          f"device={args.resolved_device()}  reps={ns.reps}")
    with Engine(args) as engine:
        stats = engine.stats()
        print(f"attention kernel: {stats['attention_kernel']}  graph buckets: {stats['graph_buckets'] or 'none'}")
        for n, length in cases:
            batch = [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]
            requests = [Request(f"b{i}", ids) for i, ids in enumerate(batch)]

            def graphcp_run(force_eager: bool, count: bool = False):
                out = engine.prefill(requests, force_eager=force_eager, count_host_ops=count)
                for r in requests:
                    engine.release(r.rid)
                return out

            # warm-up, op counts and the K/V all-gather's bytes per layer of each path
            counts = [engine.collective_counts()]
            graph_out = graphcp_run(False, True)
            counts.append(engine.collective_counts())
            eager_out = graphcp_run(True, True)
            counts.append(engine.collective_counts())
            gathers = {"graph": gather_per_layer(*counts[:2]),
                       "eager": gather_per_layer(*counts[1:])}
            if hf is not None:
                hf(batch)
            times = {"graph": [], "eager": [], "hf": []}
            # At one rank the engine runs in this process, on HF's threads: HF joins the alternation.
            hf_alternates = hf is not None and args.world_size == 1
            runs = {"graph": lambda: graphcp_run(False), "eager": lambda: graphcp_run(True)}
            if hf_alternates:
                runs["hf"] = lambda: hf(batch)
            order = list(runs)
            for rep in range(ns.reps):
                # The paths alternate, so noise hits all alike; the order rotates every rep, so none
                # always runs in the caches (or after the allocations) another path left behind.
                for name in order[rep % len(order):] + order[:rep % len(order)]:
                    times[name].append(time_ms(runs[name]))
            if hf is not None and not hf_alternates:
                # HF runs in this process: its OpenMP threads spin after each call and would steal the
                # cores the ranks need, so it runs as its own block, followed by a pause.
                times["hf"] = [time_ms(lambda: hf(batch)) for _ in range(ns.reps)]
                time.sleep(0.5)
            med = {k: statistics.median(v) if v else None for k, v in times.items()}
            results.append({
                "case": f"{n}x{length}", "tokens": n * length, "graph_mode": graph_out.mode,
                "graph_bucket": graph_out.graph_bucket, "eager_reason": graph_out.eager_reason,
                "ms": med, "host_ops": {"eager": eager_out.host_ops, "graph": graph_out.host_ops},
                "gather_bytes_per_layer": gathers,
                "balance": {s: attention_balance(s, balance_cp, [length] * n) for s in ("zigzag", "interleave")}})
    report = _report(results, balance_cp)
    print(report["table"])
    from graphcp.tools.host_prep import measure_host_prep
    prep = report["host_prep"] = measure_host_prep()
    print(f"host prep per batch ({prep['case']}, validate + plan + descriptor fill, no ranks): "
          f"{prep['tensor']['total_us']:.0f} us with tensor ids, {prep['list']['total_us']:.0f} us with lists; "
          f"page allocation {prep['tensor']['allocate_us']:.0f} us")
    report["host_prep_us"] = prep["host_prep_us"]
    family = read_model_config(args.model_path).family_config
    if isinstance(family, MLAConfig) and family.index_topk:   # DSA: indexer and sparse work per rank
        table, report["dsa_balance"] = dsa_table(cases, balance_cp, family.index_topk)
        print(table)
    if isinstance(family, DeepseekV4Config):   # the same for V4's CSA indexers and all layers' keys
        table, report["v4_balance"] = v4_table(cases, balance_cp, family)
        print(table)
    if isinstance(family, HybridConfig):   # the linear layers' work per zigzag rank, their exchange
        dtype = resolve_dtype(args.dtype, torch.device(args.resolved_device()))
        heads = family.per_rank(args.attn_tp_size)         # a rank exchanges its heads' maps only
        table, report["linear_balance"] = linear_table(cases, balance_cp, heads, dtype)
        print(table)
    moe = moe_traffic(args, cases, vocab)
    if moe:
        report["moe_traffic"] = moe
        print(_moe_table(moe))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "table"} | {"config": args.to_dict()}, f, indent=2)
        print(f"wrote {ns.json_out}")
    if ns.plot:
        _plot(results, ns.plot)
        print(f"wrote {ns.plot}")
    return 0


def moe_traffic(args, cases: list[tuple[int, int]], vocab: int) -> list | None:
    """MoE layouts: bytes each rank hands to the MoE collectives per MoE layer, for each token flow,
    and the expert load (pairs per EP rank), as the communicators measure them on one eager forward
    per case. None for dense models or a one-rank TP world."""
    from graphcp import Engine, Request
    if not read_model_config(args.model_path).moe_layers or args.tp_size == 1:
        return None
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]
               for n, length in cases]
    rows = []
    for flow in ("none", "all_to_all"):
        flow_args = dataclasses.replace(args, moe_a2a_backend=flow, disable_cuda_graph=True)
        with Engine(flow_args) as engine:
            for (n, length), batch in zip(cases, batches):
                requests = [Request(f"m{i}", ids) for i, ids in enumerate(batch)]
                before = engine.stats()["moe_traffic_per_rank"]
                engine.prefill(requests)
                for r in requests:
                    engine.release(r.rid)
                per_rank, load = _traffic_delta(before, engine.stats()["moe_traffic_per_rank"])
                rows.append({"case": f"{n}x{length}", "flow": flow,
                             "bytes_per_layer_per_rank": per_rank, "expert_load_per_ep_rank": load,
                             "expert_load_max_over_mean": max(load) / (sum(load) / len(load))})
    return rows


def _traffic_delta(before: list[dict], after: list[dict]) -> tuple[list[dict], list[int]]:
    """(each rank's bytes per collective per MoE layer, pairs per EP rank summed over ranks)."""
    per_rank = []
    for b, a in zip(before, after):
        calls = a["layer_calls"] - b["layer_calls"]
        per_rank.append({k: (v - b["bytes"].get(k, 0)) // calls for k, v in a["bytes"].items()})
    deltas = [[x - y for x, y in zip(a["pairs_per_ep_rank"], b["pairs_per_ep_rank"])]
              for b, a in zip(before, after)]
    load = [sum(col) for col in zip(*deltas)]
    return per_rank, load


def _moe_table(rows: list[dict]) -> str:
    lines = ["", "MoE bytes per layer per rank (max over ranks), measured in the communicators "
                 "on an eager forward; expert load = pairs per EP rank, max/mean",
             f"{'case':>7} {'flow':>10} {'KiB/layer':>10}  {'by collective (rank 0, KiB)':<66} "
             f"{'load max/mean':>13}"]
    for r in rows:
        per_rank = r["bytes_per_layer_per_rank"]
        worst = max(sum(d.values()) for d in per_rank) / 1024
        parts = ", ".join(f"{k} {v / 1024:.1f}" for k, v in sorted(per_rank[0].items()))
        lines.append(f"{r['case']:>7} {r['flow']:>10} {worst:>10.1f}  {parts:<66} "
                     f"{r['expert_load_max_over_mean']:>13.3f}")
    return "\n".join(lines)


def gather_per_layer(before: dict, after: dict) -> dict[str, int]:
    """Bytes each rank received per K/V all-gather between two ``collective_counts``, per kind of
    layer ("sliding": a sliding-window layer's halo, "full": everything)."""
    out = {}
    for kind, layers in after["gathered_layers"].items():
        n = layers - before["gathered_layers"].get(kind, 0)
        if n:
            out[kind] = (after["gathered_bytes"][kind] - before["gathered_bytes"].get(kind, 0)) // n
    return out


def _gather_lines(results: list[dict]) -> list[str]:
    """Sliding-window models: each case's gathered bytes per layer, sliding beside full layers."""
    if not any("sliding" in g for r in results for g in r["gather_bytes_per_layer"].values()):
        return []

    def kib(per: dict, kind: str) -> str:
        return f"{per[kind] / 1024:.1f}" if kind in per else "-"

    lines = ["", "K/V all-gather per layer, KiB each rank receives (sliding layers gather their "
             "window's halo; full layers, interleave and small batches everything):",
             f"{'case':>7} {'graph sliding':>13} {'graph full':>10} {'eager sliding':>13} "
             f"{'eager full':>10}"]
    for r in results:
        g = r["gather_bytes_per_layer"]
        graph, eager = g["graph"], g["eager"]
        lines.append(f"{r['case']:>7} {kib(graph, 'sliding'):>13} {kib(graph, 'full'):>10} "
                     f"{kib(eager, 'sliding'):>13} {kib(eager, 'full'):>10}")
    return lines


def _report(results: list[dict], balance_cp: int) -> dict:
    lines = ["", f"{'case':>7} {'mode':>6} {'bucket':>6} {'graph ms':>9} {'eager ms':>9} {'hf ms':>8} "
                 f"{'graph/eager':>11} {'eager/hf':>8} {'ops eager':>9} {'ops graph':>9} {'zz bal':>6} {'il bal':>6}"]
    lines.append(f"{'':>7} graph/eager and eager/hf are speedups (>1: the first is faster); "
                 f"bal = max/mean attention work over ranks at CP={balance_cp}")
    total_tokens = sum(r["tokens"] for r in results)
    totals = {k: sum(r["ms"][k] for r in results) if all(r["ms"][k] for r in results) else None
              for k in ("graph", "eager", "hf")}
    for r in results:
        ms = r["ms"]
        speed = ms["eager"] / ms["graph"]
        vs_hf = f"{ms['hf'] / ms['eager']:.2f}x" if ms["hf"] else "-"
        hf_ms = f"{ms['hf']:.1f}" if ms["hf"] else "-"
        lines.append(f"{r['case']:>7} {r['graph_mode']:>6} {r['graph_bucket'] or '-':>6} {ms['graph']:>9.1f} "
                     f"{ms['eager']:>9.1f} {hf_ms:>8} {speed:>10.2f}x {vs_hf:>8} {r['host_ops']['eager']:>9} "
                     f"{r['host_ops']['graph']:>9} {r['balance']['zigzag']:>6.3f} {r['balance']['interleave']:>6.3f}")
    tps = {name: (total_tokens / totals[key] * 1e3 if totals[key] else None)
           for name, key in (("graphcp_graph", "graph"), ("graphcp_eager", "eager"), ("hf", "hf"))}
    ops = {"eager": int(statistics.median(r["host_ops"]["eager"] for r in results)),
           "graph": int(statistics.median(r["host_ops"]["graph"] for r in results))}
    lines.append("")
    lines.append("tokens/s (all cases): " + ", ".join(f"{k} {v:.0f}" for k, v in tps.items() if v))
    if tps["hf"]:
        lines.append(f"graphcp eager / HF: {tps['graphcp_eager'] / tps['hf']:.2f}x   "
                     f"graphcp graph / HF: {tps['graphcp_graph'] / tps['hf']:.2f}x")
    lines.append(f"graph / eager: {tps['graphcp_graph'] / tps['graphcp_eager']:.2f}x   host ops per forward "
                 f"(median): eager {ops['eager']}, graph {ops['graph']} -> {ops['graph'] / ops['eager']:.3f}")
    lines += _gather_lines(results)
    return {"table": "\n".join(lines), "host_ops_per_forward": ops, "tokens_per_s": tps, "cases": results,
            "balance_cp": balance_cp}


def _plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["case"] for r in results]
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 1.2), 4))
    width = 0.27
    columns = (("graph", "graphcp graph"), ("eager", "graphcp eager"), ("hf", "HF transformers"))
    for i, (key, label) in enumerate(columns):
        vals = [r["tokens"] / r["ms"][key] * 1e3 if r["ms"][key] else 0 for r in results]
        ax.bar([x + (i - 1) * width for x in range(len(names))], vals, width, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("batch (requests x tokens)")
    ax.set_ylabel("tokens / s (median)")
    ax.set_title("prefill throughput, side by side in one run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""``graphcp profile``: torch-profiler traces of a few prefills on every rank, a kernel summary and a timeline.

The profiler runs where the work runs. At CP=1 the engine runs in this process and is profiled here. At
CP>1 this command starts one process per rank itself, torchrun-style (``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``): each joins the group through ``Engine(args)``, calls ``prefill`` with the
same batches, profiles its own prefills and writes ``trace_rank{R}.json`` (Chrome trace) and
``ops_rank{R}.json`` (key averages). This process then merges them into ``kernel_summary.md`` and
``timeline.png``. Started by torchrun itself, every process is one rank and rank 0 merges.

The ranges in the timeline are graphcp's NVTX ranges (``graphcp.profiling.nvtx_range``), which are also
``record_function`` ranges while a torch profiler records.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import random
import subprocess
import sys
import time

import torch

from graphcp.distributed.procs import child_env, free_port
from graphcp.tools.cli import engine_args, engine_parser

TOP_OPS = 25
# Range kinds drawn in the timeline, top to bottom within a rank's lane: (label, name prefixes).
RANGE_ROWS = [
    ("prefill", ("prefill",)),
    ("graph replay", ("graph_replay:",)),
    ("break", ("break:",)),
    ("collective", ("all_gather_kv", "all_reduce")),
    ("attention", ("attention",)),
    ("cp_metadata", ("cp_metadata",)),
]
RANGE_COLORS = {"prefill": "#4c72b0", "graph replay": "#55a868", "break": "#c44e52", "collective": "#8172b2",
                "attention": "#dd8452", "cp_metadata": "#937860", "GPU kernels": "#64b5cd"}
GRAPHCP_RANGES = tuple(p for _, prefixes in RANGE_ROWS for p in prefixes) + ("capture:",)


def build_parser() -> argparse.ArgumentParser:
    parser = engine_parser("graphcp profile", "Profile a few prefills with the torch profiler on every rank; "
                           "write Chrome traces, a kernel summary table and a timeline PNG.", cp_default=2)
    parser.add_argument("--out", default=os.path.join("profiles", "out"), help="output directory")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per profiled batch")
    parser.add_argument("--requests", type=int, default=1, help="requests per batch (tokens split evenly)")
    parser.add_argument("--batches", type=int, default=3, help="profiled prefills (after one warmup)")
    parser.add_argument("--force-eager", action="store_true", help="profile the eager path instead of graphs")
    parser.add_argument("--spmd-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def run(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.tokens < ns.requests or ns.requests < 1 or ns.batches < 1:
        print("graphcp profile: need --batches >= 1 and --tokens >= --requests >= 1", file=sys.stderr)
        return 2
    args = engine_args(ns)
    if args.max_total_tokens is None:
        args = dataclasses.replace(args, max_total_tokens=max(16384, 2 * ns.tokens))
    os.makedirs(ns.out, exist_ok=True)
    torchrun = ns.spmd_rank is None and "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if ns.spmd_rank is not None or torchrun:
        return _run_rank(args, ns, merge=torchrun)
    for pattern in ("trace_rank*.json", "ops_rank*.json"):
        for stale in glob.glob(os.path.join(ns.out, pattern)):
            os.remove(stale)
    if args.world_size == 1:
        _profile(args, ns, rank=0)
    else:
        code = _spawn_ranks(args, ns, argv)
        if code:
            return code
    return _report(ns.out)


# -- per rank -------------------------------------------------------------------------------------
def _run_rank(args, ns: argparse.Namespace, merge: bool) -> int:
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _profile(args, ns, rank)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return _report(ns.out) if merge and rank == 0 else 0


def _batches(vocab: int, ns: argparse.Namespace) -> list[list[tuple[str, list[int]]]]:
    """One warmup batch then ``--batches`` profiled ones, fixed by a seed (every rank builds the same)."""
    rng = random.Random(0)
    base, extra = divmod(ns.tokens, ns.requests)
    return [[(f"profile{b}_{i}", [rng.randrange(vocab) for _ in range(base + (i < extra))])
             for i in range(ns.requests)] for b in range(ns.batches + 1)]


def _profile(args, ns: argparse.Namespace, rank: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from graphcp import Engine, Request
    from graphcp.checkpoint.config import read_model_config
    vocab = read_model_config(args.model_path).vocab_size
    batches = _batches(vocab, ns)
    device = args.resolved_device()
    cuda = device == "cuda" and torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    outputs = []
    with Engine(args) as engine:
        def step(batch: list[tuple[str, list[int]]]) -> None:
            out = engine.prefill([Request(rid, ids) for rid, ids in batch], force_eager=ns.force_eager)
            outputs.append({"mode": out.mode, "bucket": out.graph_bucket, "eager_reason": out.eager_reason,
                            "per_rank_tokens": out.per_rank_tokens})
            for rid, _ in batch:
                engine.release(rid)

        step(batches[0])                                    # warmup, not profiled
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=False) as prof:
            for batch in batches[1:]:
                step(batch)
            if cuda:
                torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(ns.out, f"trace_rank{rank}.json"))
    ops = []
    for e in prof.key_averages():
        ops.append({"name": e.key, "calls": int(e.count), "self_cpu_us": float(e.self_cpu_time_total),
                    "cpu_total_us": float(e.cpu_time_total),
                    "self_device_us": float(getattr(e, "self_device_time_total", 0.0) or 0.0),
                    "device_total_us": float(getattr(e, "device_time_total", 0.0) or 0.0),
                    "annotation": bool(getattr(e, "is_user_annotation", False))})
    meta = {"rank": rank, "world_size": args.world_size, "device": device, "cuda_profiled": cuda,
            "model_path": args.model_path, "cp_size": args.cp_size, "cp_strategy": args.cp_strategy,
            "tokens": ns.tokens, "requests": ns.requests, "batches": ns.batches, "outputs": outputs[1:]}
    with open(os.path.join(ns.out, f"ops_rank{rank}.json"), "w") as f:
        json.dump({"meta": meta, "ops": ops}, f)


def _spawn_ranks(args, ns: argparse.Namespace, argv: list[str]) -> int:
    world = args.world_size
    port = free_port()
    child_argv = list(argv) + ["--model-path", args.model_path, "--out", ns.out]
    if ns.max_total_tokens is None:
        child_argv += ["--max-total-tokens", str(args.max_total_tokens)]
    procs = []
    for rank in range(world):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "graphcp.tools.profile", *child_argv,
                                       "--spmd-rank", str(rank)], env=env))
    deadline = time.monotonic() + max(900.0, 10 * args.rank_timeout_s)
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad:
            failed = f"rank {bad[0][0]} exited with code {bad[0][1]}"
            break
        if time.monotonic() > deadline:
            failed = "ranks did not finish in time"
            break
        time.sleep(0.2)
    if failed is None:
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            failed = f"rank {bad[0][0]} exited with code {bad[0][1]}"
    if failed:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        print(f"graphcp profile: {failed}", file=sys.stderr)
        return 1
    return 0


# -- merge ----------------------------------------------------------------------------------------
def _load_ranks(out_dir: str) -> dict[int, dict]:
    ranks = {}
    for path in glob.glob(os.path.join(out_dir, "ops_rank*.json")):
        with open(path) as f:
            data = json.load(f)
        ranks[int(data["meta"]["rank"])] = data
    return dict(sorted(ranks.items()))


def _is_range(op: dict) -> bool:
    return op["annotation"] or op["name"].startswith(GRAPHCP_RANGES) or op["name"].startswith("ProfilerStep")


def summary_markdown(ranks: dict[int, dict]) -> str:
    """The kernel summary: per rank, the top ops by self time (device time where CUDA was profiled)."""
    meta = next(iter(ranks.values()))["meta"]
    device_time = meta["cuda_profiled"]
    key = "self_device_us" if device_time else "self_cpu_us"
    modes = ", ".join(sorted({f"{o['mode']}" + (f" (bucket {o['bucket']})" if o["bucket"] else "")
                              for o in meta["outputs"]}))
    lines = [
        "# graphcp profile: kernel summary", "",
        f"- model: `{meta['model_path']}`",
        f"- ranks: {len(ranks)}; CP={meta['cp_size']}{' ' + meta['cp_strategy'] if meta['cp_size'] > 1 else ''}; "
        f"device {meta['device']}",
        f"- profiled: {meta['batches']} prefills of {meta['tokens']} new tokens in {meta['requests']} request(s), "
        f"after one warmup; mode: {modes}",
        f"- time column: **self {'CUDA (device)' if device_time else 'CPU'} time** summed over the profiled "
        f"prefills; share = share of that rank's total self time. graphcp's own ranges are listed separately.",
        "",
    ]
    totals = []
    for rank, data in ranks.items():
        ops = [o for o in data["ops"] if not _is_range(o) and o[key] > 0]
        ops.sort(key=lambda o: o[key], reverse=True)
        total = sum(o[key] for o in ops) or 1.0
        totals.append((rank, len(ops), sum(o["calls"] for o in ops), total))
        lines += [f"## Rank {rank}: top {min(TOP_OPS, len(ops))} of {len(ops)} ops by self time", "",
                  "| # | name | calls | total time (ms) | share % |", "|---:|---|---:|---:|---:|"]
        for i, o in enumerate(ops[:TOP_OPS], 1):
            name = o["name"].replace("|", "\\|")
            if len(name) > 90:
                name = name[:87] + "..."
            lines.append(f"| {i} | `{name}` | {o['calls']} | {o[key] / 1e3:.3f} | {100 * o[key] / total:.1f} |")
        lines.append(f"| | **all ops, rank {rank}** | {totals[-1][2]} | {total / 1e3:.3f} | 100.0 |")
        lines.append("")
    lines += ["## Per-rank totals", "", "| rank | ops | calls | self time (ms) | prefill range, mean (ms) |",
              "|---:|---:|---:|---:|---:|"]
    for rank, n_ops, calls, total in totals:
        pre = [o for o in ranks[rank]["ops"] if o["name"] == "prefill"]
        mean = f"{pre[0]['cpu_total_us'] / max(1, pre[0]['calls']) / 1e3:.3f}" if pre else "-"
        lines.append(f"| {rank} | {n_ops} | {calls} | {total / 1e3:.3f} | {mean} |")
    lines += ["", "## graphcp ranges (NVTX names; inclusive CPU time)", "",
              "| range | " + " | ".join(f"rank {r} calls | rank {r} ms" for r in ranks) + " |",
              "|---|" + "---:|---:|" * len(ranks)]
    names = sorted({o["name"] for d in ranks.values() for o in d["ops"] if o["name"].startswith(GRAPHCP_RANGES)})
    for name in names:
        cells = []
        for data in ranks.values():
            hit = [o for o in data["ops"] if o["name"] == name]
            cells += [str(hit[0]["calls"]), f"{hit[0]['cpu_total_us'] / 1e3:.3f}"] if hit else ["-", "-"]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def _row_of(name: str) -> str | None:
    """The timeline row of a range: exact names, or a prefix for names ending in ':' (``break:<fn>``)."""
    for label, names in RANGE_ROWS:
        if any(name.startswith(n) if n.endswith(":") else name == n for n in names):
            return label
    return None


def timeline_events(trace_path: str) -> tuple[dict[str, list[tuple[float, float, str]]], float]:
    """{row label: [(start us, duration us, name)]} from a Chrome trace, times on the wall clock."""
    with open(trace_path) as f:
        trace = json.load(f)
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    rows: dict[str, list[tuple[float, float, str]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "user_annotation":
            row = _row_of(name)
        elif cat == "kernel":
            row = "GPU kernels"
        else:
            row = None
        if row is not None:
            rows.setdefault(row, []).append((base + float(ev["ts"]), float(ev["dur"]), name))
    start = min((s for evs in rows.values() for s, _, _ in evs), default=0.0)
    return rows, start


def write_timeline(out_dir: str, ranks: dict[int, dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("graphcp profile: matplotlib is not installed; timeline.png skipped (pip install matplotlib)")
        return False
    per_rank = {r: timeline_events(os.path.join(out_dir, f"trace_rank{r}.json")) for r in ranks
                if os.path.isfile(os.path.join(out_dir, f"trace_rank{r}.json"))}
    t0 = min((start for _, start in per_rank.values()), default=0.0)
    row_labels = [label for label, _ in RANGE_ROWS] + ["GPU kernels"]
    used = [lab for lab in row_labels if any(lab in rows for rows, _ in per_rank.values())] or row_labels[:1]
    n_rows = len(used)
    fig_h = 1.2 + 0.32 * n_rows * max(1, len(per_rank))
    fig, ax = plt.subplots(figsize=(14, fig_h))
    yticks, ylabels = [], []
    end = 0.0
    for lane, (rank, (rows, _)) in enumerate(per_rank.items()):
        top = lane * (n_rows + 1)
        for i, label in enumerate(used):
            y = top + i
            yticks.append(y + 0.4)
            ylabels.append(f"rank {rank} · {label}")
            evs = rows.get(label, [])
            if not evs:
                continue
            spans = [((s - t0) / 1e3, d / 1e3) for s, d, _ in evs]
            end = max(end, max(a + b for a, b in spans))
            ax.broken_barh(spans, (y, 0.8), facecolors=RANGE_COLORS[label], edgecolors="none")
        if lane:
            ax.axhline(top - 0.6, color="#999999", linewidth=0.6)
    # Names on the bars wide enough to hold them (prefill, graph replay, breaks).
    for lane, (rank, (rows, _)) in enumerate(per_rank.items()):
        top = lane * (n_rows + 1)
        for i, label in enumerate(used):
            if label in ("attention", "cp_metadata", "collective", "GPU kernels"):
                continue
            for s, d, name in rows.get(label, []):
                if end and d / 1e3 > max(0.05, 0.0065 * len(name)) * end:     # the name fits the bar
                    ax.text((s - t0) / 1e3 + d / 2e3, top + i + 0.4, name, ha="center", va="center", fontsize=7,
                            color="white", clip_on=True)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.01 if end else 1)
    ax.set_xlabel("time since the first profiled range (ms)")
    meta = next(iter(ranks.values()))["meta"]
    ax.set_title(f"graphcp prefill timeline: {len(per_rank)} rank(s), CP={meta['cp_size']}, device {meta['device']}",
                 fontsize=10)
    ax.legend(handles=[Patch(color=RANGE_COLORS[lab], label=lab) for lab in used], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _report(out_dir: str) -> int:
    ranks = _load_ranks(out_dir)
    if not ranks:
        print(f"graphcp profile: no rank wrote its profile into {out_dir}", file=sys.stderr)
        return 1
    text = summary_markdown(ranks)
    summary = os.path.join(out_dir, "kernel_summary.md")
    with open(summary, "w") as f:
        f.write(text)
    timeline = os.path.join(out_dir, "timeline.png")
    drew = write_timeline(out_dir, ranks, timeline)
    print("\ngraphcp profile: wrote")
    for r in ranks:
        print(f"  {os.path.join(out_dir, f'trace_rank{r}.json')}   (chrome://tracing or https://ui.perfetto.dev)")
    print(f"  {summary}")
    if drew:
        print(f"  {timeline}")
    rank0 = text.split("## Rank 0", 1)[-1].split("\n## ", 1)[0]     # its whole table: every top row
    print("\n## Rank 0" + rank0.rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]) or 0)

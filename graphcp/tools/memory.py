"""``graphcp memory --model-path DIR [engine flags] [--gpu-memory-gib G] [--json]``: will it fit?

DIR may hold config.json alone: every rank's model is built on the meta device by the loader's own
rules. Prints one line per rank (weights by dtype, KV bytes per token, state, reserve, the KV pool
in tokens, the longest request); exits 1 saying what does not fit. ``--json``: one JSON object on
the last stdout line.
"""
from __future__ import annotations

import argparse
import json

from graphcp.config import EngineArgs
from graphcp.kv.sizing import GIB
from graphcp.memory import MemoryReport, memory_report


def format_report(report: MemoryReport) -> str:
    fraction = report.mem_fraction_static
    head = (f"graphcp memory: {len(report.ranks)} ranks, {report.dtype} on {report.device} "
            f"({report.device_gib:.1f} GiB each, mem fraction "
            f"{fraction if fraction is not None else 'cpu share 0.2'})")
    lines = [head, "  rank  weights GiB  (by dtype)                       KV B/token  state GiB  "
                   "reserve GiB  pool tokens  longest request"]
    for r in report.ranks:
        dtypes = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(r.weight_bytes_by_dtype.items()))
        lines.append(f"  {r.rank:>4}  {r.weight_bytes / GIB:>11.2f}  {dtypes:<32} "
                     f"{r.kv_bytes_per_token:>10}  {r.state_bytes / GIB:>9.2f}  "
                     f"{r.reserve_bytes / GIB:>11.2f}  {r.max_total_tokens:>11}  {r.max_context:>15}")
    first = report.ranks[0] if report.ranks else None
    if first is not None and first.group_kv_tokens != first.max_total_tokens:
        times = first.group_kv_tokens // max(first.max_total_tokens, 1)
        lines.append(f"KV cache sharding: each page stored once per CP group; the group holds "
                     f"{first.group_kv_tokens} tokens ({times} x the pool; KV B/token includes the "
                     "scratch layer)")
    lines.append("fits" if report.fits else f"does not fit: {report.problem}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="graphcp memory",
        description="Each rank's memory plan from config.json alone (no weights needed): weights, "
                    "KV bytes per token, the KV pool and the longest request. Exits 1 if it does "
                    "not fit.")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the plan as one JSON object on the last stdout line")
    ns = parser.parse_args(argv)
    if ns.attn_cp_size == 1:
        ns.enable_prefill_cp = False
    args = EngineArgs.from_namespace(ns)
    report = memory_report(args, args.resolved_device(), args.gpu_memory_gib)
    print(format_report(report))
    if ns.json:
        print(json.dumps(report.as_json()))
    return 0 if report.fits else 1

"""``graphcp bench --kv-sharding``: what ``--enable-kv-cache-sharding`` buys and costs at 4K-64K
cached prefixes, for the given model and CP flags (config.json alone, no weights, no device).

Capacity: each rank's pool (``graphcp memory``'s plan, the scratch layer included) and the tokens
the CP group holds, unsharded (each page on every rank) and sharded (each page once). Traffic: the
bytes each rank receives per layer for one chunk over a cached prefix: the chunk's all-gather (both)
plus, sharded, the prefix pages from their owners, counted by the engine's own page table and prefix
plan (``kv/sharding.py``); ``tests/cp/test_kv_sharding.py`` pins these numbers to a sharded engine's
counter.
"""
from __future__ import annotations

import dataclasses
import json

from graphcp.attention.kinds import cache_parts
from graphcp.checkpoint.config import check_model_flags
from graphcp.config import EngineArgs, resolve_dtype
from graphcp.cp import build_layout
from graphcp.kv.cache import bytes_per_token
from graphcp.kv.pages import PageTable
from graphcp.kv.sharding import PrefixPlan, group_pages

DEFAULT_PREFIXES = (4096, 8192, 16384, 32768, 65536)


def layer_bytes(args: EngineArgs) -> int:
    """Bytes per token of the model's widest layer on one rank (what one layer's gather moves)."""
    import torch
    cfg = check_model_flags(args, weights=False)
    parts = cache_parts(cfg, range(cfg.num_hidden_layers), args.attn_tp_size)
    dtype = resolve_dtype(args.dtype, torch.device(args.resolved_device()))
    return max(bytes_per_token({layer: p}, dtype) for layer, p in parts.items())


def gathered_per_layer(args: EngineArgs, prefix: int, chunk: int, per_token: int) -> dict[str, int]:
    """Bytes one rank receives per layer for a request of ``prefix`` cached tokens extended by
    ``chunk``: the chunk's rows from every rank (padded to the largest), and under sharding the
    prefix's pages from their owners (padded to the largest owner's count), as the engine moves
    them."""
    cp, ps = args.cp_size, args.page_size
    layout = build_layout(args.resolved_cp_strategy, cp, 0, [chunk], [prefix])
    chunk_bytes = cp * max(layout.per_rank_tokens) * per_token
    table = PageTable(group_pages(-(-(prefix + chunk) // ps) + 1, cp), ps, prefix + chunk)
    (row,) = table.allocate(["r"], [prefix])
    plan = PrefixPlan([row], [prefix], ps, cp, 0, "cpu")
    return {"chunk": chunk_bytes, "prefix": cp * plan.width * ps * per_token}


def report(args: EngineArgs, prefixes: list[int], chunk: int, device_gib: float | None) -> dict:
    from graphcp.memory import memory_report
    plain = dataclasses.replace(args, enable_kv_cache_sharding=False)
    sharded = dataclasses.replace(args, enable_kv_cache_sharding=True)
    device = args.resolved_device()
    capacity = {}
    for name, flags in (("unsharded", plain), ("sharded", sharded)):
        rank = memory_report(flags, device, device_gib).ranks[0]
        capacity[name] = {"pool_tokens_per_rank": rank.max_total_tokens,
                          "group_tokens": rank.group_kv_tokens,
                          "kv_bytes_per_token": rank.kv_bytes_per_token}
    per_token, rows = layer_bytes(args), []
    for prefix in prefixes:
        moved = gathered_per_layer(args, prefix, chunk, per_token)
        rows.append({"prefix": prefix, "chunk": chunk, "unsharded_bytes": moved["chunk"],
                     "sharded_bytes": moved["chunk"] + moved["prefix"],
                     "held_per_rank_unsharded": (prefix + chunk) * per_token,
                     "held_per_rank_sharded": -(-(prefix + chunk) // args.cp_size) * per_token})
    return {"cp_size": args.cp_size, "strategy": args.resolved_cp_strategy,
            "layer_bytes_per_token": per_token,
            "capacity": capacity, "rows": rows}


def format_report(result: dict) -> str:
    cap, mib = result["capacity"], 1 << 20
    lines = [f"KV cache sharding at CP {result['cp_size']} ({result['strategy']}): one layer "
             f"{result['layer_bytes_per_token']} B/token",
             "capacity          pool tokens/rank  group tokens  KV B/token (per rank)"]
    for name in ("unsharded", "sharded"):
        c = cap[name]
        lines.append(f"  {name:<15} {c['pool_tokens_per_rank']:>16}  {c['group_tokens']:>12}  "
                     f"{c['kv_bytes_per_token']:>10}")
    lines.append("per layer, one rank   prefix   chunk  gathered MiB unsharded  sharded  "
                 "held MiB/layer unsharded  sharded")
    for r in result["rows"]:
        lines.append(f"  {r['prefix']:>26}  {r['chunk']:>6}  {r['unsharded_bytes'] / mib:>22.2f}  "
                     f"{r['sharded_bytes'] / mib:>7.2f}  "
                     f"{r['held_per_rank_unsharded'] / mib:>24.2f}  "
                     f"{r['held_per_rank_sharded'] / mib:>7.2f}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    from graphcp.tools.cli import engine_args, engine_parser
    parser = engine_parser("graphcp bench --kv-sharding",
                           "KV sharding: capacity and per-layer gathered bytes with and without "
                           "it at cached prefixes (config.json alone).", cp_default=2)
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(DEFAULT_PREFIXES),
                        help="cached prefix lengths (tokens)")
    parser.add_argument("--chunk", type=int, default=2048, help="new tokens extending each prefix")
    parser.add_argument("--json", dest="json_out", default=None,
                        help="also write the results as JSON")
    ns = parser.parse_args(argv)
    args = engine_args(ns)
    result = report(args, ns.prefixes, ns.chunk, ns.gpu_memory_gib)
    print(format_report(result))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0

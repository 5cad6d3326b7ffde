"""``graphcp pd-bench``: a prefill worker hands its KV to a decode worker's receiver over Mooncake.

Per request length: prefill, then ``transfer_kv`` into a ``KVReceiver`` process; reports the transfer
rate (bytes moved / time from prefill end to the KV received) and that time, medians of ``--reps`` runs,
and checks once per length that the receiver's copy equals the engine's cache.
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


def pd_bench(args: EngineArgs, lengths: list[int], reps: int = 5, seed: int = 0) -> dict:
    from graphcp import Engine
    from graphcp.checkpoint.config import read_model_config
    from graphcp.pd import KVReceiver
    vocab = read_model_config(args.model_path).vocab_size
    rng = random.Random(seed)
    dtype = "float32" if args.resolved_device() == "cpu" and args.dtype in ("auto", "float32") else args.dtype
    dtype = "bfloat16" if dtype == "auto" else dtype
    rows = []
    with Engine(args) as engine, KVReceiver(args.model_path, max_tokens=max(lengths), max_requests=1,
                                            dtype=dtype, protocol=args.resolved_transfer_protocol()) as receiver:
        for n in lengths:
            waits, rates, sends, sent = [], [], [], None
            for rep in range(reps + 1):                      # the first run warms the connections up
                rid = f"pd{n}-{rep}"
                engine.prefill([Request(rid, [rng.randrange(vocab) for _ in range(n)])])
                start = time.perf_counter()
                sent = engine.transfer_kv(rid, receiver.destination(rid))
                wait = time.perf_counter() - start
                if rep == 0:
                    ours = engine.kv_cache(rid)
                    if not all(_same(got, mine) for got, mine in zip(receiver.kv(rid), ours, strict=True)):
                        raise RuntimeError(f"pd-bench: the received KV of {rid!r} differs from the engine's cache")
                else:
                    waits.append(wait)
                    rates.append(sent["bytes"] / wait / 1e9)
                    sends.append(sent["seconds"])
                engine.release(rid)
                receiver.free(rid)
            rows.append({"tokens": n, "bytes": sent["bytes"], "sending_ranks": sent["ranks"],
                         "prefill_end_to_received_ms": 1e3 * statistics.median(waits),
                         "rank_write_ms": 1e3 * statistics.median(sends), "gb_per_s": statistics.median(rates)})
        held = engine.stats()["kv_bytes_per_rank"]
    return {"protocol": args.resolved_transfer_protocol(), "reps": reps, "cases": rows, "kv_bytes_per_rank": held}


def _same(got: tuple, ours: tuple) -> bool:
    """One layer's received tensors equal the engine's (dense: K, V; DSA: latent, rope, indexer keys or None)."""
    return all((a is None and b is None) or (a is not None and b is not None and a.equal(b))
               for a, b in zip(got, ours, strict=True))


def run(argv: list[str]) -> int:
    parser = engine_parser("graphcp pd-bench", "KV transfer from a prefill worker to a receiver over Mooncake.",
                           cp_default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048], help="request lengths")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the report here")
    ns = parser.parse_args(argv)
    ns.disaggregation_mode = "prefill"            # before the flags are checked (LayerSplit needs it)
    args = engine_args(ns)
    if args.max_total_tokens is None:
        args = dataclasses.replace(args, max_total_tokens=max(ns.tokens) + args.page_size)
    report = pd_bench(args, ns.tokens, ns.reps)
    print(f"PD transfer over Mooncake {report['protocol']}, {args.cp_size} CP rank(s) sending "
          f"(median of {ns.reps}):")
    print(f"{'tokens':>7} {'KV MiB':>8} {'ranks':>5} {'prefill end -> received ms':>27} {'rank writes ms':>15} "
          f"{'GB/s':>6}")
    for c in report["cases"]:
        print(f"{c['tokens']:>7} {c['bytes'] / 2**20:>8.2f} {c['sending_ranks']:>5} "
              f"{c['prefill_end_to_received_ms']:>27.2f} {c['rank_write_ms']:>15.2f} {c['gb_per_s']:>6.2f}")
    held = report["kv_bytes_per_rank"]
    split = " (--enable-dsa-cache-layer-split)" if args.enable_dsa_cache_layer_split else ""
    print(f"KV cache bytes held per rank{split}: " + ", ".join(f"{b / 2**20:.2f} MiB" for b in held))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report | {"config": args.to_dict()}, f, indent=2)
    return 0

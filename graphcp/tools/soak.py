"""``graphcp soak``: many random batches with chunked prefill and releases, in graph mode.

It shows what a long-running serving loop needs: no KV page leaks, no re-capture, bounded rank memory,
and graph outputs equal to eager on a sample of batches.
"""
from __future__ import annotations

import random

from graphcp.batch import Request
from graphcp.config import EngineArgs
from graphcp.tools.cli import engine_args, engine_parser


def soak(args: EngineArgs, batches: int = 1000, sample_every: int = 50, seed: int = 0, progress: bool = False) -> dict:
    from tqdm import tqdm

    from graphcp import Engine
    from graphcp.checkpoint.config import read_model_config
    vocab = read_model_config(args.model_path).vocab_size
    rng = random.Random(seed)
    min_len = 2 * args.cp_size
    report = {"batches": batches, "graph_batches": 0, "eager_batches": 0, "sampled": 0, "max_graph_vs_eager": 0.0}
    with Engine(args) as engine:
        start = engine.stats()
        total, captures = start["kv_tokens_total"], start["graph_captures"]
        live: dict[str, int] = {}
        next_id = 0
        mem_start = mem_peak = None
        for i in tqdm(range(batches), desc="soak", unit="batch", disable=not progress):
            sample = sample_every and i % sample_every == 0
            batch = []
            for _ in range(rng.randint(1, 4)):
                if live and not sample and rng.random() < 0.4:
                    rid = rng.choice([r for r in live if r not in {b[0] for b in batch}] or [None])
                    if rid is None:
                        continue
                    n = rng.randint(min_len, 64)
                else:
                    rid, next_id = f"s{next_id}", next_id + 1
                    n = rng.randint(4 * min_len, 100) if sample else rng.randint(min_len, 160)
                batch.append((rid, [rng.randrange(vocab) for _ in range(n)]))
            need = sum(len(ids) + args.page_size for _, ids in batch)
            while live and (engine.stats()["kv_tokens_free"] < need or rng.random() < 0.2):
                victim = rng.choice(sorted(live))
                engine.release(victim)
                del live[victim]
            requests = [Request(rid, ids) for rid, ids in batch]
            out = engine.prefill(requests)
            report["graph_batches" if out.mode == "graph" else "eager_batches"] += 1
            if sample and out.mode == "graph":
                for r in requests:
                    engine.release(r.rid)
                eager = engine.prefill(requests, force_eager=True)
                diff = float((out.logits - eager.logits).abs().max())
                report["max_graph_vs_eager"] = max(report["max_graph_vs_eager"], diff)
                report["sampled"] += 1
            for rid, ids in batch:
                live[rid] = live.get(rid, 0) + len(ids)
            mem = sum(engine.rank_memory())
            mem_start = mem if mem_start is None else mem_start
            mem_peak = max(mem_peak or 0, mem)
        for rid in list(live):
            engine.release(rid)
        end = engine.stats()
        report.update(leaked_tokens=total - end["kv_tokens_free"], recaptured=end["graph_captures"] != captures,
                      graph_buckets=end["graph_buckets"], rank_memory_start=mem_start, rank_memory_peak=mem_peak,
                      rank_memory_end=sum(engine.rank_memory()))
    return report


def run(argv: list[str]) -> int:
    parser = engine_parser("graphcp soak", "Random batches with chunked prefill and releases.", cp_default=2)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--sample-every", type=int, default=50, help="compare graph with eager every N batches")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    args = engine_args(ns)
    if args.max_total_tokens is None:
        import dataclasses
        args = dataclasses.replace(args, max_total_tokens=8192)
    r = soak(args, ns.batches, ns.sample_every, ns.seed, progress=True)
    mib = 2**20
    print(f"soak: {r['batches']} batches ({r['graph_batches']} graph, {r['eager_batches']} eager); "
          f"KV tokens leaked: {r['leaked_tokens']}; re-captured: {r['recaptured']}; "
          f"graph vs eager on {r['sampled']} sampled batches: max |diff| {r['max_graph_vs_eager']:.2e}; "
          f"rank memory (sum) start {r['rank_memory_start'] / mib:.0f} MiB, "
          f"peak {r['rank_memory_peak'] / mib:.0f} MiB, "
          f"end {r['rank_memory_end'] / mib:.0f} MiB")
    ok = r["leaked_tokens"] == 0 and not r["recaptured"] and r["max_graph_vs_eager"] <= 1e-5
    return 0 if ok else 1

"""``graphcp demo``: a short serving loop at CP=2 zigzag with graphs, checked against CP=1."""
from __future__ import annotations

import dataclasses
import random
import time

import torch

from graphcp.tools.cli import engine_args, engine_parser


def serving_batches(vocab: int, n_batches: int, seed: int = 0) -> list[list[tuple[str, list[int]]]]:
    """New requests and follow-up chunks of earlier ones (chunked prefill), fixed by the seed."""
    rng = random.Random(seed)
    batches, live, next_id = [], [], 0
    for _ in range(n_batches):
        batch = []
        for _ in range(rng.randint(1, 4)):
            if live and rng.random() < 0.3:
                rid = live.pop(rng.randrange(len(live)))
            else:
                rid, next_id = f"req{next_id}", next_id + 1
            batch.append((rid, [rng.randrange(vocab) for _ in range(rng.choice([24, 64, 100, 180, 300]))]))
        live += [rid for rid, _ in batch]
        batches.append(batch)
    return batches


def run_loop(engine, batches, progress: bool = True):  # noqa: ANN001
    from tqdm import tqdm

    from graphcp import Request
    rows, logits = [], []
    cached: dict[str, int] = {}
    for batch in tqdm(batches, desc="prefill batches", unit="batch", disable=not progress):
        t0 = time.perf_counter()
        out = engine.prefill([Request(rid, ids) for rid, ids in batch])
        ms = (time.perf_counter() - t0) * 1e3
        tokens = sum(len(ids) for _, ids in batch)
        for rid, ids in batch:
            rows.append((rid, len(ids), cached.get(rid, 0), out.mode, out.graph_bucket, ms, tokens / ms * 1e3))
            cached[rid] = cached.get(rid, 0) + len(ids)
        logits.append(out.logits)
    return rows, logits


def run(argv: list[str]) -> int:
    parser = engine_parser("graphcp demo", "Serve a few prefill batches at CP=2 zigzag with graphs.", cp_default=2)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--no-compare", action="store_true", help="skip the CP=1 reference run")
    ns = parser.parse_args(argv)
    args = engine_args(ns)
    if args.max_total_tokens is None:
        args = dataclasses.replace(args, max_total_tokens=16384)
    from graphcp import Engine
    from graphcp.models import read_model_config
    vocab = read_model_config(args.model_path).vocab_size
    batches = serving_batches(vocab, ns.batches)
    print(f"graphcp demo: {args.model_path}\n  CP={args.cp_size} {args.cp_strategy or ''} "
          f"backend={args.resolved_backend()} device={args.resolved_device()} graphs={'off' if args.disable_cuda_graph else 'on'}")
    with Engine(args) as engine:
        stats = engine.stats()
        print(f"  captured buckets: {stats['graph_buckets'] or 'none'}; KV pool {stats['kv_tokens_total']} tokens per rank")
        run_loop(engine, batches[:1], progress=False)                     # warm caches; not reported
        engine_release_all(engine, batches[:1])
        rows, logits = run_loop(engine, batches)
    print()
    print(f"{'request':<8} {'new':>5} {'cached':>6} {'mode':<6} {'bucket':>6} {'batch ms':>9} {'tokens/s':>9}")
    for rid, new, cached, mode, bucket, ms, tps in rows:
        print(f"{rid:<8} {new:>5} {cached:>6} {mode:<6} {bucket if bucket else '-':>6} {ms:>9.1f} {tps:>9.0f}")
    if not ns.no_compare and args.cp_size > 1:
        ref_args = dataclasses.replace(args, tp_size=1, attn_cp_size=1, enable_prefill_cp=False, cp_strategy=None,
                                       ep_size=1, moe_a2a_backend="none")
        with Engine(ref_args) as ref:
            _, ref_logits = run_loop(ref, batches, progress=False)
        err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits))
        same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(logits, ref_logits))
        print(f"\nCP={args.cp_size} vs CP=1 logits over {len(rows)} requests: max relative error {err:.2e}; "
              f"greedy tokens {'identical' if same else 'DIFFER'}")
    return 0


def engine_release_all(engine, batches) -> None:  # noqa: ANN001
    for batch in batches:
        for rid, _ in batch:
            engine.release(rid)

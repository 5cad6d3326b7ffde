"""``graphcp demo``: the real model answering chat prompts at CP=2 zigzag with graphs, checked against CP=1;
``--random-model`` serves random token ids through a short loop instead (fast, for tests)."""
from __future__ import annotations

import dataclasses
import random
import time

import torch

from graphcp.tools.cli import engine_args
from graphcp.tools.generate import (
    chat_ids,
    greedy_generate,
    print_steps,
    replay_logits,
    stop_ids,
    text_defaults,
    text_parser,
)


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


def run_loop(engine, batches, progress: bool = True):
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


DEMO_PROMPTS = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")


def run(argv: list[str]) -> int:
    parser = text_parser("graphcp demo", "Chat prompts through the real model at CP=2 zigzag with graphs, "
                         "answered greedily by one-token extends, checked against CP=1.", max_new_tokens=20)
    parser.add_argument("--prompt", action="append", help="a user message (repeatable); default: three questions")
    parser.add_argument("--random-model", action="store_true",
                        help="serve random token ids instead of text, on the embedded random-weight model unless "
                             "--model-path is given (fast; no tokenizer)")
    parser.add_argument("--batches", type=int, default=8, help="with --random-model: prefill batches to serve")
    parser.add_argument("--no-compare", action="store_true", help="skip the CP=1 reference run")
    ns = parser.parse_args(argv)
    return run_random(ns) if ns.random_model else run_text(ns)


def run_text(ns) -> int:
    from graphcp import Engine, tokenizer
    text_defaults(ns)
    args = engine_args(ns)
    tok = tokenizer(args.model_path)
    texts = ns.prompt or list(DEMO_PROMPTS)
    prompts = {f"q{i}": chat_ids(tok, text, chat=not ns.no_chat_template) for i, text in enumerate(texts)}
    _print_header(args)
    with Engine(args) as engine:
        _print_engine(engine)
        greedy_generate(engine, prompts, 1)                               # warm caches; not reported
        generated, steps = greedy_generate(engine, prompts, ns.max_new_tokens, stop_ids(tok))
    for (rid, ids), text in zip(prompts.items(), texts):
        answer = tok.decode(generated[rid], skip_special_tokens=True).strip()
        answer = answer.replace("\n", "\n" + " " * (len(rid) + 11))
        print(f"\n[{rid}] prompt ({len(ids)} tokens with the chat template): {text}\n[{rid}] answer: {answer}")
    print()
    print_steps(steps)
    if not ns.no_compare and args.cp_size > 1:
        ref_args = dataclasses.replace(args, tp_size=1, attn_cp_size=1, enable_prefill_cp=False, cp_strategy=None,
                                       disable_cuda_graph=True, ep_size=1, moe_a2a_backend="none")
        with Engine(ref_args) as ref:
            ref_logits = replay_logits(ref, steps)
        _print_agreement(args, [s.logits for s in steps], ref_logits, f"{len(steps)} steps", "CP=1 eager")
    return 0


def run_random(ns) -> int:
    from graphcp import Engine
    from graphcp.checkpoint.config import read_model_config
    args = engine_args(ns)
    if args.max_total_tokens is None:
        args = dataclasses.replace(args, max_total_tokens=16384)
    batches = serving_batches(read_model_config(args.model_path).vocab_size, ns.batches)
    _print_header(args)
    with Engine(args) as engine:
        _print_engine(engine)
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
        _print_agreement(args, logits, ref_logits, f"{len(rows)} requests", "CP=1")
    return 0


def _print_header(args) -> None:
    print(f"graphcp demo: {args.model_path}\n  CP={args.cp_size} {args.cp_strategy or ''} "
          f"backend={args.resolved_backend()} device={args.resolved_device()} "
          f"graphs={'off' if args.disable_cuda_graph else 'on'}")


def _print_engine(engine) -> None:
    stats = engine.stats()
    print(f"  captured buckets: {stats['graph_buckets'] or 'none'}; KV pool {stats['kv_tokens_total']} tokens per rank")


def _print_agreement(args, logits, ref_logits, what: str, ref_name: str) -> None:
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits))
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(logits, ref_logits))
    print(f"\nCP={args.cp_size} vs {ref_name} logits over {what}: max relative error {err:.2e}; "
          f"greedy tokens {'identical' if same else 'DIFFER'}")


def engine_release_all(engine, batches) -> None:
    for batch in batches:
        for rid, _ in batch:
            engine.release(rid)

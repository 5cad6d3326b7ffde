"""``graphcp generate``: greedy text continuation on a prefill engine, and the loop ``graphcp demo``
shares.

graphcp has no decode kernels: each new token is a one-token extend of its rid (chunked prefill of
length one), batched over the unfinished requests."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from graphcp.errors import ConfigError
from graphcp.tools.cli import engine_args, engine_parser


@dataclass
class Step:
    """One prefill call of the loop: its batch (rid, new ids), how it ran, and its logits."""

    batch: list[tuple[str, list[int]]]
    mode: str
    bucket: int | None
    eager_reason: str | None
    ms: float
    logits: torch.Tensor

    @property
    def tokens(self) -> int:
        return sum(len(ids) for _, ids in self.batch)


def greedy_generate(
    engine,
    prompts: dict[str, list[int]],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
) -> tuple[dict[str, list[int]], list[Step]]:
    """Prefill all prompts in one batch, then extend each unfinished rid by its last greedy token
    until ``max_new_tokens`` or a stop id (kept in the output). Every rid is released at the end."""
    from graphcp import Request

    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    steps, batch = [], [(rid, list(ids)) for rid, ids in prompts.items()]
    prefilled = False
    try:
        while batch:
            t0 = time.perf_counter()
            out = engine.prefill([Request(rid, ids) for rid, ids in batch])
            prefilled = True
            ms = (time.perf_counter() - t0) * 1e3
            steps.append(Step(batch, out.mode, out.graph_bucket, out.eager_reason, ms, out.logits))
            for (rid, _), token in zip(batch, out.next_token_ids):
                generated[rid].append(token)
            batch = [
                (rid, [generated[rid][-1]])
                for rid, _ in batch
                if generated[rid][-1] not in stop_ids and len(generated[rid]) < max_new_tokens
            ]
    finally:
        for rid in prompts if prefilled else ():     # a refused first batch cached nothing
            engine.release(rid)
    return generated, steps


def replay_logits(engine, steps: list[Step]) -> list[torch.Tensor]:
    """The same batches on another engine (e.g. CP=1), for an agreement check; rids released."""
    from graphcp import Request

    logits = [
        engine.prefill([Request(rid, ids) for rid, ids in step.batch]).logits for step in steps
    ]
    for rid in {rid for step in steps for rid, _ in step.batch}:
        engine.release(rid)
    return logits


def chat_ids(tok, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user message through the model's chat template (or the plain text)."""
    if chat and tok.chat_template:
        enc = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )
        ids = list(enc["input_ids"])
    else:
        ids = list(tok(text)["input_ids"])
    if not ids:
        raise ConfigError("the checkpoint's tokenizer turned the prompt into no tokens; check that "
                          "--model-path holds the model's own tokenizer files")
    return ids


def stop_ids(tok) -> tuple[int, ...]:
    return tuple(i for i in (tok.eos_token_id,) if i is not None)


def print_steps(steps: list[Step]) -> None:
    header = ("step", "requests", "new tokens", "mode", "bucket", "ms", "tokens/s")
    print("{:>4} {:>8} {:>10} {:<6} {:>6} {:>8} {:>9}".format(*header))
    for i, s in enumerate(steps):
        tps = s.tokens / s.ms * 1e3
        print(f"{i:>4} {len(s.batch):>8} {s.tokens:>10} {s.mode:<6} {s.bucket or '-':>6} "
              f"{s.ms:>8.1f} {tps:>9.0f}")
    for reason in dict.fromkeys(s.eager_reason for s in steps if s.eager_reason):
        print(f"eager because: {reason}")
    new = sum(len(s.batch) for s in steps)
    total_ms = sum(s.ms for s in steps)
    print(f"generated {new} tokens in {total_ms / 1e3:.2f} s ({new / total_ms * 1e3:.1f} tokens/s, "
          "prompt prefill included)")


def text_parser(prog: str, description: str, max_new_tokens: int):
    """Engine flags plus the text-generation ones; the real model is the default --model-path."""
    parser = engine_parser(prog, description, cp_default=2)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument(
        "--no-chat-template", action="store_true", help="feed the prompt text as is"
    )
    return parser


def text_defaults(ns) -> None:
    """The real model, and graph buckets and a KV pool sized for a few chat prompts, unless flags
    say otherwise."""
    if ns.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be >= 1")
    if ns.model_path is None:
        from graphcp.checkpoint.real_model import smollm2_path

        ns.model_path = smollm2_path()
    ns.cuda_graph_buckets = ns.cuda_graph_buckets or [32, 64, 128]
    ns.max_total_tokens = ns.max_total_tokens or 4096


def run(argv: list[str]) -> int:
    parser = text_parser("graphcp generate", "Greedy continuation of one prompt.", 32)
    parser.add_argument("--prompt", required=True)
    ns = parser.parse_args(argv)
    text_defaults(ns)
    args = engine_args(ns)
    from graphcp import Engine, tokenizer

    tok = tokenizer(args.model_path)
    ids = chat_ids(tok, ns.prompt, chat=not ns.no_chat_template)
    with Engine(args) as engine:
        generated, steps = greedy_generate(
            engine, {"prompt": ids}, ns.max_new_tokens, stop_ids(tok)
        )
    print(f"prompt ({len(ids)} tokens): {ns.prompt}")
    print(f"answer: {tok.decode(generated['prompt'], skip_special_tokens=True).strip()}\n")
    print_steps(steps)
    return 0

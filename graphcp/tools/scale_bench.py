"""``graphcp bench --scale``: one request from 1K to 64K tokens (128K with ``--long``) at CP 1, 2
and 4 (zigzag), beside HF transformers on the same checkpoint; a table and a log-log plot of time
against tokens.

One engine per CP size serves every length, shortest first, so a rank's peak RSS read after a length
is that length's peak. HF runs once per length after the engines, in this process (where CP 1's rank
runs too: HF last keeps its memory out of that rank's peak). Forwards are eager: long prompts are
past any graph bucket. Without ``--model-path`` the long-context 2-layer Llama is written once and
used.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from graphcp.checkpoint.config import read_model_config
from graphcp.config import STRATEGIES, EngineArgs
from graphcp.errors import ConfigError
from graphcp.tools.hf_baseline import HFModel, time_ms

DEFAULT_LENGTHS = (1024, 4096, 16384, 65536)
LONG_LENGTH = 131072
DEFAULT_CP = (1, 2, 4)
ONE_RUN_FROM = 32768      # lengths from here are timed once: 64K at CP 4 takes minutes on two cores


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphcp bench --scale", description=(
        "One request per length at each CP size, beside HF transformers: time, tokens/s, peak RSS "
        "per rank; a log-log plot of time against tokens."))
    parser.add_argument("--model-path", default=None,
                        help="an HF checkpoint (default: a random 2-layer Llama, 128K positions)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                        help="tokens per request")
    parser.add_argument("--long", action="store_true", help=f"add {LONG_LENGTH} tokens")
    parser.add_argument("--cp", type=int, nargs="+", default=list(DEFAULT_CP), help="CP sizes")
    parser.add_argument("--cp-strategy", default="zigzag", choices=STRATEGIES)
    parser.add_argument("--reps", type=int, default=3,
                        help=f"timed runs per length (median), one from {ONE_RUN_FROM} tokens")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--plot", default=None, help="also draw the log-log plot into this PNG file")
    parser.add_argument("--json", dest="json_out", default=None)
    return parser


def run(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.model_path is None:
        from graphcp.checkpoint.random import long_context_checkpoint
        ns.model_path = long_context_checkpoint()
    lengths = sorted(set(ns.lengths + ([LONG_LENGTH] if ns.long else [])))
    _check(ns, lengths)
    vocab = read_model_config(ns.model_path).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths}
    print(f"graphcp bench --scale: {ns.model_path}  lengths {lengths}  "
          f"CP {ns.cp} ({ns.cp_strategy})")
    rows = [row for cp in ns.cp for row in _graphcp_rows(ns, cp, lengths, prompts)]
    hf_ms = {} if ns.no_hf else _hf_times(ns, lengths, prompts)
    for row in rows:
        row["hf_ms"] = hf_ms.get(row["tokens"])
    print(_table(rows))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"model_path": ns.model_path, "rows": rows}, f, indent=2)
        print(f"wrote {ns.json_out}")
    if ns.plot:
        _plot(rows, hf_ms, ns.plot)
        print(f"wrote {ns.plot}")
    return 0


def _check(ns: argparse.Namespace, lengths: list[int]) -> None:
    if min(lengths) < 1 or ns.reps < 1 or min(ns.cp) < 1:
        raise ConfigError("--lengths, --cp and --reps take positive integers")
    positions = read_model_config(ns.model_path).max_position_embeddings
    if lengths[-1] > positions:
        raise ConfigError(f"--lengths up to {lengths[-1]} tokens exceed the model's "
                          f"max_position_embeddings ({positions}); pass shorter --lengths or a "
                          f"--model-path with more positions")


def _reps(ns: argparse.Namespace, tokens: int) -> int:
    return ns.reps if tokens < ONE_RUN_FROM else 1


def _graphcp_rows(ns: argparse.Namespace, cp: int, lengths: list[int],
                  prompts: dict) -> list[dict]:
    from graphcp import Engine, Request
    args = EngineArgs(model_path=ns.model_path, tp_size=cp, attn_cp_size=cp,
                      enable_prefill_cp=cp > 1, cp_strategy=ns.cp_strategy if cp > 1 else None,
                      disable_cuda_graph=True, max_total_tokens=lengths[-1] + 1024)
    rows = []
    with Engine(args) as engine:

        def prefill(tokens: int) -> None:
            engine.prefill([Request("scale", prompts[tokens])])
            engine.release("scale")

        prefill(lengths[0])                                 # warm-up: first-call allocations
        for tokens in lengths:
            ms = statistics.median(time_ms(lambda: prefill(tokens))
                                   for _ in range(_reps(ns, tokens)))
            peak = engine.stats()["peak_rss_bytes_per_rank"]
            rows.append({"tokens": tokens, "cp": cp, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
                         "peak_rss_bytes_per_rank": peak})
            print(f"  CP {cp} {tokens:>7} tokens: {ms:10.1f} ms  "
                  f"peak RSS/rank {max(peak) / 2**20:7.0f} MiB", flush=True)
    return rows


def _hf_times(ns: argparse.Namespace, lengths: list[int], prompts: dict) -> dict[int, float]:
    try:
        hf = HFModel(ns.model_path, "cpu")
    except ImportError:
        print("transformers is not installed: HF column skipped (pip install graphcp[test])")
        return {}
    hf([prompts[lengths[0]]])                               # warm-up
    times = {}
    for tokens in lengths:
        times[tokens] = statistics.median(time_ms(lambda: hf([prompts[tokens]]))
                                          for _ in range(_reps(ns, tokens)))
        print(f"  HF   {tokens:>7} tokens: {times[tokens]:10.1f} ms", flush=True)
    return times


def _table(rows: list[dict]) -> str:
    lines = ["", f"{'tokens':>7} {'CP':>3} {'graphcp ms':>11} {'tokens/s':>9} "
                 f"{'peak RSS/rank MiB':>18} {'HF ms':>10} {'HF tokens/s':>11} {'vs HF':>6}",
             f"{'':>7} one request, eager, median; peak RSS: the largest rank's; "
             f"vs HF = HF ms / graphcp ms"]
    for r in rows:
        hf = r["hf_ms"]
        hf_cols = f"{hf:>10.1f} {r['tokens'] / hf * 1e3:>11.0f} {hf / r['ms']:>5.2f}x" if hf \
            else f"{'-':>10} {'-':>11} {'-':>6}"
        lines.append(f"{r['tokens']:>7} {r['cp']:>3} {r['ms']:>11.1f} {r['tokens_per_s']:>9.0f} "
                     f"{max(r['peak_rss_bytes_per_rank']) / 2**20:>18.0f} {hf_cols}")
    return "\n".join(lines)


def _plot(rows: list[dict], hf_ms: dict[int, float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for cp in sorted({r["cp"] for r in rows}):
        mine = [r for r in rows if r["cp"] == cp]
        ax.plot([r["tokens"] for r in mine], [r["ms"] / 1e3 for r in mine], "o-",
                label=f"graphcp CP {cp}")
    if hf_ms:
        lengths_hf = sorted(hf_ms)
        ax.plot(lengths_hf, [hf_ms[n] / 1e3 for n in lengths_hf], "s--k", label="HF transformers")
    ax.set_xscale("log", base=2)
    lengths = sorted({r["tokens"] for r in rows})
    ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (one request)")
    ax.set_ylabel("prefill time (s, median)")
    ax.set_title("long-prompt prefill, side by side in one run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

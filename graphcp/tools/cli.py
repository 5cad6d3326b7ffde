"""``graphcp COMMAND``: the command line (``COMMANDS`` lists them, one line each)."""
from __future__ import annotations

import argparse
import sys

from graphcp.config import EngineArgs
from graphcp.errors import ConfigError


def engine_parser(prog: str, description: str, cp_default: int) -> argparse.ArgumentParser:
    """Engine flags (as EngineArgs.from_cli) with the embedded model as the default --model-path."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    EngineArgs.add_cli_args(parser, require_model=False)
    parser.add_argument("--demo-model", default="qwen3", choices=("qwen3", "qwen3_moe"),
                        help="the embedded random model used without --model-path (qwen3_moe: 8 experts, "
                             "top-2, for --ep / --moe-a2a-backend)")
    if cp_default > 1:
        parser.set_defaults(tp_size=cp_default, attn_cp_size=cp_default, enable_prefill_cp=True, cp_strategy="zigzag")
    return parser


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    if ns.model_path is None:
        from graphcp.checkpoint.random import demo_checkpoint
        ns.model_path = demo_checkpoint(getattr(ns, "demo_model", "qwen3"))
    if ns.attn_cp_size == 1:
        ns.enable_prefill_cp = False
    return EngineArgs.from_namespace(ns)


# command -> (module, what it does)
COMMANDS = {
    "demo": ("graphcp.tools.demo", "chat with the embedded real model (SmolLM2-135M) at CP 2 in graphs"),
    "generate": ("graphcp.tools.generate", "greedy continuation of one --prompt on any checkpoint"),
    "memory": ("graphcp.tools.memory", "will it fit? each rank's weights, KV pool and longest request "
                                       "from config.json alone"),
    "bench": ("graphcp.tools.bench", "long-prompt prefill: graph vs eager vs HF transformers, side by side"),
    "profile": ("graphcp.tools.profile", "torch-profiler kernel table and timeline of one prefill"),
    "soak": ("graphcp.tools.soak", "many random batches: no leaked pages, no re-capture, bounded memory"),
    "pd-bench": ("graphcp.tools.pd_bench", "KV transfer over Mooncake to a receiver: time and bandwidth"),
    "adaptive-bench": ("graphcp.tools.adaptive_bench", "static zigzag vs adaptive CP vs unsharded"),
    "serve": ("graphcp.serve.cli", "HTTP prefill worker for SGLang's router (SGLang 0.5.23 PD protocol)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: graphcp COMMAND [engine flags]   (graphcp COMMAND --help for its flags)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        return 2
    import importlib
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return module.run(argv[1:]) or 0
    except ConfigError as e:
        print(f"graphcp {argv[0]}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

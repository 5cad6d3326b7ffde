"""``graphcp demo | generate | bench | profile | soak | pd-bench | adaptive-bench | serve``: the command line."""
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
        from graphcp.models.random_checkpoint import demo_checkpoint
        ns.model_path = demo_checkpoint(getattr(ns, "demo_model", "qwen3"))
    if ns.attn_cp_size == 1:
        ns.enable_prefill_cp = False
    return EngineArgs.from_namespace(ns)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "graphcp.tools.demo", "generate": "graphcp.tools.generate", "bench": "graphcp.tools.bench",
                "profile": "graphcp.tools.profile", "soak": "graphcp.tools.soak", "pd-bench": "graphcp.tools.pd_bench",
                "adaptive-bench": "graphcp.tools.adaptive_bench", "serve": "graphcp.serve.cli"}
    if not argv or argv[0] not in commands:
        print("usage: graphcp {demo,generate,bench,profile,soak,pd-bench,adaptive-bench,serve} [engine flags]   "
              "(graphcp CMD --help for details)")
        return 2
    import importlib
    module = importlib.import_module(commands[argv[0]])
    try:
        return module.run(argv[1:]) or 0
    except ConfigError as e:
        print(f"graphcp {argv[0]}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

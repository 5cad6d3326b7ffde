"""Capture plans: which buckets ``capture/warmup.py`` captured and validated, for one configuration.

CUDA graphs cannot be saved, so a plan fixes the bucket list (and proves each bucket replays like eager);
the engine captures exactly those buckets at start and refuses a plan made for another configuration.
"""
from __future__ import annotations

import json
import os

from graphcp.config import EngineArgs
from graphcp.errors import ConfigError

PLAN_VERSION = 1


def plan_config(args: EngineArgs) -> dict:
    """The settings a captured graph depends on."""
    return {"model_path": os.path.abspath(args.model_path), "dtype": args.dtype, "device": args.resolved_device(),
            "tp_size": args.tp_size, "dp_size": args.dp_size, "pp_size": args.pp_size,
            "attn_cp_size": args.attn_cp_size, "enable_prefill_cp": args.enable_prefill_cp,
            "cp_strategy": args.cp_strategy, "attention_backend": args.resolved_backend(),
            "attention_kernel": args.attention_kernel, "page_size": args.page_size,
            "max_batch_requests": args.max_batch_requests, "ffn_tp_size": args.resolved_ffn_tp_size}


def load_plan_buckets(path: str, args: EngineArgs) -> list[int]:
    try:
        with open(path) as f:
            plan = json.load(f)
        config, buckets = plan["config"], plan["buckets"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--capture-plan {path!r} is not a graphcp capture plan: {e}") from e
    ours = plan_config(args)
    for key, value in ours.items():
        if config.get(key) != value:
            raise ConfigError(f"--capture-plan {path!r} was made for another configuration: {key} is "
                              f"{config.get(key)!r} in the plan but {value!r} now; re-run capture/warmup.py")
    good = [int(b["tokens"]) for b in buckets if b.get("replay_matches_eager")]
    if not good:
        raise ConfigError(f"--capture-plan {path!r} has no bucket whose replay matched eager; re-run capture/warmup.py")
    return good

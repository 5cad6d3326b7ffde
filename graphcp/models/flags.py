"""The engine flags that depend on the model, judged from its config alone."""
from __future__ import annotations

from typing import Callable

from graphcp.config import EngineArgs, check_model_fits, check_weights
from graphcp.models.config import ModelConfig, check_expert_parallel, read_model_config
from graphcp.models.deepseek_v4_config import check_v4_flags
from graphcp.models.dsa_config import check_dsa_flags, check_mla_flags
from graphcp.models.hybrid_config import check_hybrid_flags

# Flags a family restricts further (its errors name the flag).
FLAG_CHECKS: dict[str, Callable[[EngineArgs], None]] = {
    "deepseek_v32": check_dsa_flags, "glm_moe_dsa": check_dsa_flags, "deepseek_v3": check_mla_flags,
    "deepseek_v4": check_v4_flags, "hybrid": check_hybrid_flags,
}


def check_model_flags(args: EngineArgs, weights: bool = True) -> ModelConfig:
    """The flags that depend on the model, judged from its config alone: the engine calls this before any
    rank process starts, so a bad flag costs no start-up. ``weights``: the checkpoint's weights must be
    there too (not for ``graphcp memory``, which plans from config.json alone)."""
    if weights:
        check_weights(args.model_path)
    cfg = read_model_config(args.model_path)
    check_model_fits(args, cfg)
    check_expert_parallel(cfg, args.ep_size)
    if cfg.family in FLAG_CHECKS:
        FLAG_CHECKS[cfg.family](args)
    return cfg

"""Which model class serves a checkpoint: the one place a family's architecture becomes its model."""
from __future__ import annotations

from typing import Callable

from graphcp.config import EngineArgs, check_model_fits
from graphcp.models.config import ModelConfig, check_expert_parallel, read_model_config
from graphcp.models.decoder import DecoderLM
from graphcp.models.deepseek_v32 import DSACausalLM
from graphcp.models.dsa_config import check_dsa_flags
from graphcp.models.llama import CausalLM

# ModelConfig.family (models/config.py ARCHITECTURES) -> model class
FAMILIES: dict[str, type[DecoderLM]] = {
    "llama": CausalLM, "qwen2": CausalLM, "qwen3": CausalLM,
    "deepseek_v32": DSACausalLM, "glm_moe_dsa": DSACausalLM,
}


# Flags a family restricts further (its errors name the flag).
FLAG_CHECKS: dict[str, Callable[[EngineArgs], None]] = {
    "deepseek_v32": check_dsa_flags, "glm_moe_dsa": check_dsa_flags,
}


def model_class(cfg: ModelConfig) -> type[DecoderLM]:
    return FAMILIES[cfg.family]


def check_model_flags(args: EngineArgs) -> ModelConfig:
    """The flags that depend on the model, judged from its config alone: the engine calls this before any
    rank process starts, so a bad flag costs no start-up."""
    cfg = read_model_config(args.model_path)
    check_model_fits(args, cfg)
    check_expert_parallel(cfg, args.ep_size)
    if cfg.family in FLAG_CHECKS:
        FLAG_CHECKS[cfg.family](args)
    return cfg

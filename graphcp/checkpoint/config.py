"""A checkpoint's model config (config.json, or a GGUF file's metadata mapped to the same fields:
one validation), and the engine flags that depend on it, judged from it alone."""
from __future__ import annotations

import json
import os

from graphcp.checkpoint.gguf import hf_config
from graphcp.config import EngineArgs, check_model_fits, check_weights, is_gguf
from graphcp.errors import ConfigError
from graphcp.models.config import ModelConfig, check_expert_parallel
from graphcp.models.registry import config_from_dict, family_of


def read_model_config(model_path: str) -> ModelConfig:
    if is_gguf(model_path):
        return config_from_dict(hf_config(model_path), "GGUF metadata")
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model-path: cannot read {path}: {e}") from e
    return config_from_dict(raw, "config.json")


def check_model_flags(args: EngineArgs, weights: bool = True) -> ModelConfig:
    """The flags that depend on the model, judged from its config alone: the engine calls this before any
    rank process starts, so a bad flag costs no start-up. ``weights``: the checkpoint's weights must be
    there too (not for ``graphcp memory``, which plans from config.json alone)."""
    if weights:
        check_weights(args.model_path)
    cfg = read_model_config(args.model_path)
    check_model_fits(args, cfg)
    check_expert_parallel(cfg, args.ep_size)
    if args.enable_kv_cache_sharding:
        check_sharded_kinds(cfg)
    family = family_of(cfg)
    if family.check_flags is not None:      # the flags a family restricts further
        family.check_flags(args, cfg)
    return cfg


def check_sharded_kinds(cfg) -> None:
    """``--enable-kv-cache-sharding`` shards paged caches whose ops read them through the pool's
    hooks (``LayerKind.shardable``); per-request state and compressed caches are not sharded."""
    from graphcp.attention.kinds import KINDS
    other = sorted({k for k in cfg.attention_kinds if not (k in KINDS and KINDS[k].shardable)})
    if other:
        shardable = ", ".join(name for name, kind in KINDS.items() if kind.shardable)
        raise ConfigError(f"--enable-kv-cache-sharding shards the paged caches of {shardable} "
                          f"layers; this model has {', '.join(other)} layers: drop the flag")

"""RoPE tables of the DSA models over ``qk_rope_head_dim``, from models/rope.py: HF's DeepSeek
V3.2 and GLM-5 rotary modules call the same rope functions as the llama family, YaRN included.
The tables are cat(freqs, freqs), so the interleaved (MLA) and half-split (V3.2 indexer) rotations
both read them. DeepSeek's one addition is MLA's softmax scale under a scaled RoPE."""
from __future__ import annotations

import torch

from graphcp.models.common.rope import rope_tables, yarn_mscale
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import MLAConfig


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under any scaled RoPE (HF's
    ``yarn_apply_mscale``)."""
    scale = MLAConfig.of(cfg).qk_head_dim ** -0.5
    params = cfg.rope_scaling
    if params is not None and params.get("mscale_all_dim"):
        factor = params["factor"]
        if factor is None:      # YaRN's factor derived from the context lengths (models/rope.py)
            factor = cfg.max_position_embeddings / params["original_max_position_embeddings"]
        scale *= yarn_mscale(float(factor), params["mscale_all_dim"]) ** 2
    return scale


class DSARotary:
    """cos/sin tables [positions, qk_rope_head_dim] (the attention factor applied), gathered by
    position."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.config = cfg
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        cfg = self.config
        cos, sin = rope_tables(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim,
                               cfg.max_position_embeddings)
        self.cos, self.sin = cos.to(device), sin.to(device)

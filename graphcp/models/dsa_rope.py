"""RoPE tables of the DSA models: default or YaRN (DeepSeek's long-context scaling), computed as
transformers 5 computes them, over ``qk_rope_head_dim``. The tables are cat(freqs, freqs) like the
llama family's, so the interleaved (MLA) and half-split (V3.2 indexer) rotations both read them."""
from __future__ import annotations

import math

import torch

from graphcp.models.config import ModelConfig


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin factor): frequencies below ``beta_slow`` rotations over the
    original context are divided by ``factor``, those above ``beta_fast`` kept, a ramp between."""
    factor, original = float(params["factor"]), params["original_max_position_embeddings"]
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all)
                            if mscale and mscale_all else _mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:    # the feature index that turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp                                   # weight of the unscaled frequency
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """MLA's 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as HF)."""
    scale = cfg.dsa.qk_head_dim ** -0.5
    params = cfg.rope_scaling
    if params is not None and params.get("mscale_all_dim"):
        scale *= _mscale(float(params["factor"]), params["mscale_all_dim"]) ** 2
    return scale


class DSARotary:
    """cos/sin tables [max_positions, qk_rope_head_dim] (YaRN's factor applied), gathered by
    position."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.config = cfg
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        cfg, dim = self.config, self.config.head_dim
        if cfg.rope_scaling is not None:
            inv_freq, factor = yarn_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling)
        else:
            exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
            inv_freq = 1.0 / (cfg.rope_theta ** exponents)
            factor = 1.0
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        emb = torch.cat([pos[:, None] * inv_freq[None, :]] * 2, dim=-1)
        self.cos, self.sin = (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)

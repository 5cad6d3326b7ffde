"""Which model class serves a checkpoint: the one place a family's architecture becomes its model."""
from __future__ import annotations

from torch import nn

from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_v32 import DSACausalLM
from graphcp.models.deepseek_v4 import DeepseekV4CausalLM
from graphcp.models.llama import CausalLM
from graphcp.models.qwen3_next import HybridCausalLM

# ModelConfig.family (models/config.py ARCHITECTURES) -> model class: a DecoderLM, or DeepSeek V4's
# hyper-connected decoder with the same interface (forward, compute_logits, fuse_projections, ...)
FAMILIES: dict[str, type[nn.Module]] = {
    "llama": CausalLM, "qwen2": CausalLM, "qwen3": CausalLM,
    "deepseek_v32": DSACausalLM, "glm_moe_dsa": DSACausalLM, "deepseek_v3": DSACausalLM,
    "deepseek_v4": DeepseekV4CausalLM, "hybrid": HybridCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return FAMILIES[cfg.family]

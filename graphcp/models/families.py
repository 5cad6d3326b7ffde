"""Which model class serves a checkpoint: the one place a family's architecture becomes its model."""
from __future__ import annotations

from graphcp.models.config import ModelConfig
from graphcp.models.decoder import DecoderLM
from graphcp.models.deepseek_v32 import DSACausalLM
from graphcp.models.deepseek_v4 import DeepseekV4CausalLM
from graphcp.models.llama import CausalLM
from graphcp.models.qwen3_next import HybridCausalLM

# ModelConfig.family (models/config.py ARCHITECTURES) -> model class: every one a DecoderLM (the shared
# decoder loop, models/decoder.py)
FAMILIES: dict[str, type[DecoderLM]] = {
    "llama": CausalLM, "qwen2": CausalLM, "qwen3": CausalLM,
    "deepseek_v32": DSACausalLM, "glm_moe_dsa": DSACausalLM, "deepseek_v3": DSACausalLM,
    "deepseek_v4": DeepseekV4CausalLM, "hybrid": HybridCausalLM,
}


def model_class(cfg: ModelConfig) -> type[DecoderLM]:
    return FAMILIES[cfg.family]

"""The GLM-4.5 family: GLM-4.5, GLM-4.5-Air, GLM-4.6 and GLM-4.7 (``Glm4MoeForCausalLM``: GQA with
partial RoPE, dense first layers, the grouped top-k MoE with shared experts), bf16 or FP8
(compressed-tensors, as released)."""
from graphcp.models.config import ModelConfig
from graphcp.models.family import Family
from graphcp.models.glm4_moe.config import ARCHITECTURES, HF_DEFAULTS, Glm4MoeConfig, read_config
from graphcp.models.glm4_moe.model import Glm4MoeForCausalLM


def _mtp_layers(cfg: ModelConfig) -> tuple[str, ...]:
    """The releases carry ``num_nextn_predict_layers`` multi-token-prediction layers after the last
    one; HF does not load them."""
    first = cfg.num_hidden_layers
    return tuple(f"model.layers.{first + i}." for i in range(Glm4MoeConfig.of(cfg).mtp_layers))


FAMILY = Family("glm4_moe", ARCHITECTURES, read_config, Glm4MoeForCausalLM, HF_DEFAULTS,
                unused_tensors=_mtp_layers)

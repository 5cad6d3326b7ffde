"""The config.json fields of GLM-4.5 / 4.5-Air / 4.6 / 4.7 (``Glm4MoeForCausalLM``, model_type
``glm4_moe``), read as transformers 5 reads them: GQA attention with q/k/v biases
(``attention_bias``; o_proj never has one), optional per-head q/k RMSNorm (``use_qk_norm``), RoPE
over the first ``partial_rotary_factor`` of each head (half-split, default 0.5), dense FFNs on the
first ``first_k_dense_replace`` layers and the grouped top-k MoE with shared experts on the others.
"""
from __future__ import annotations

from dataclasses import dataclass

from graphcp.errors import ConfigError
from graphcp.models.common.grouped_moe import GroupedRouting
from graphcp.models.common.rope import partial_rotary
from graphcp.models.config import Fields, ModelConfig, base_fields, expert_count, rope_fields

ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}
# transformers' class defaults (Glm4MoeConfig) for the fields graphcp reads with another fallback
HF_DEFAULTS = {"Glm4MoeForCausalLM": dict(
    max_position_embeddings=131072, rms_norm_eps=1e-5, num_key_value_heads=8,
    partial_rotary_factor=0.5, n_routed_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=1408, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1,
    topk_group=1, first_k_dense_replace=1, norm_topk_prob=True)}


@dataclass(frozen=True)
class Glm4MoeConfig:
    """``ModelConfig.family_config`` of the GLM-4.5 family (``Glm4MoeConfig.of(cfg)``)."""
    rotary_dim: int                  # the rotated dims at the start of each head
    routing: GroupedRouting
    mtp_layers: int                  # num_nextn_predict_layers: the releases' draft layers

    @staticmethod
    def of(cfg: ModelConfig) -> "Glm4MoeConfig":
        if not isinstance(cfg.family_config, Glm4MoeConfig):
            raise TypeError(f"{cfg.architecture} is no GLM-4.5 model")
        return cfg.family_config


def read_config(f: Fields, arch: str) -> dict:
    """ModelConfig fields of a GLM-4.5 checkpoint; the expert count is ``n_routed_experts`` or its
    alias ``num_local_experts``, the MTP count ``num_nextn_predict_layers`` or ``num_mtp_layers``."""
    raw = expert_count(f.raw, ("num_local_experts", "n_routed_experts"), "n_routed_experts")
    raw = expert_count(raw, ("num_nextn_predict_layers", "num_mtp_layers"),
                       "num_nextn_predict_layers")
    f = Fields(raw, f.source)
    fields = base_fields(f)
    layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
    rotary_dim, rope_raw = partial_rotary(raw, head_dim)
    experts, top_k = f.need("n_routed_experts"), f.need("num_experts_per_tok")
    routing = _routing(raw, experts, f.need)
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds "
                          f"n_routed_experts={experts}")
    mtp = raw.get("num_nextn_predict_layers", 1)       # HF's default, under either name
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise ConfigError(f"--model-path: num_nextn_predict_layers={mtp!r} must be an integer "
                          ">= 0")
    fields.update(
        qkv_bias=bool(raw.get("attention_bias", False)), qk_norm=bool(raw.get("use_qk_norm", False)),
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_layers=tuple(range(_dense_layers(raw, layers), layers)),
        attention_kinds=("gqa",) * layers,
        family_config=Glm4MoeConfig(rotary_dim, routing, mtp),
        **rope_fields(rope_raw, rotary_dim, fields["max_position_embeddings"]))
    return fields


def _routing(raw: dict, experts: int, need) -> GroupedRouting:
    """The grouped router: ``n_group`` groups of >= 2 experts (HF ranks a group by its two best),
    ``topk_group`` of them kept."""
    groups, kept = need("n_group"), need("topk_group")
    if experts % groups or kept > groups or experts // groups < 2:
        raise ConfigError(f"--model-path: n_group={groups} must divide n_routed_experts="
                          f"{experts} into groups of >= 2, with topk_group={kept} <= n_group")
    scaling = raw.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise ConfigError(f"--model-path: routed_scaling_factor={scaling!r} must be a positive "
                          "number")
    shared = raw.get("n_shared_experts", 1)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ConfigError(f"--model-path: n_shared_experts={shared!r} must be an integer >= 0")
    return GroupedRouting(groups, kept, float(scaling), shared)


def _dense_layers(raw: dict, num_layers: int) -> int:
    """Layers before ``first_k_dense_replace`` have a dense FFN, the others the MoE (as HF builds
    them: ``layer_idx >= first_k_dense_replace``)."""
    dense = raw.get("first_k_dense_replace", 1)
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
        raise ConfigError(f"--model-path: first_k_dense_replace={dense!r} must be an integer >= 0")
    return min(dense, num_layers)

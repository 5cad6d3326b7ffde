"""The config.json fields of gpt-oss (``GptOssForCausalLM``), read as transformers 5 reads them:
sliding and full attention layers (``layer_types``), attention sinks and biases, YaRN RoPE, a
top-k router with bias and experts with a clamped SwiGLU, and the MXFP4 ``quantization_config``
the releases carry (which experts stay in 4 bits)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from graphcp.errors import ConfigError
from graphcp.models.config import Fields, ModelConfig, base_fields, expert_count, rope_fields

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' class defaults (GptOssConfig) for the fields graphcp reads with another fallback.
HF_DEFAULTS = {"GptOssForCausalLM": dict(
    num_hidden_layers=36, num_experts=128, vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
    num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True)}
# transformers' rope parameters when a config gives none
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
_EXPERTS = "model.layers.{}.mlp.experts"


@dataclass(frozen=True)
class GptOssConfig:
    """``ModelConfig.family_config`` of gpt-oss (``GptOssConfig.of(cfg)``)."""
    layer_types: tuple[str, ...]     # per layer: "sliding_attention" or "full_attention"
    swiglu_limit: float              # gate clamped above, up clamped both sides
    swiglu_alpha: float              # the sigmoid's gain
    mxfp4_layers: tuple[int, ...]    # layers whose experts the checkpoint holds in MXFP4

    @staticmethod
    def of(cfg: ModelConfig) -> "GptOssConfig":
        if not isinstance(cfg.family_config, GptOssConfig):
            raise TypeError(f"{cfg.architecture} is no gpt-oss model")
        return cfg.family_config


def read_config(f: Fields, arch: str) -> dict:
    """Every layer is MoE (``num_local_experts``, top ``num_experts_per_tok`` with experts of
    ``intermediate_size``); ``attention_bias`` biases q/k/v/o. transformers ignores
    ``hidden_act`` (the experts' activation is their clamped SwiGLU), ``experts_per_token`` and
    ``initial_context_length`` (the rope parameters carry the original context); so does graphcp.
    ``num_experts`` spells ``num_local_experts`` (transformers' attribute map), which wins."""
    raw = {k: v for k, v in f.raw.items() if k not in ("quantization_config", "hidden_act")}
    f = Fields(expert_count(f.raw, ("num_local_experts", "num_experts"), "num_local_experts"),
               f.source)
    if not raw.get("rope_scaling") and not raw.get("rope_parameters"):
        raw["rope_parameters"] = dict(_DEFAULT_ROPE)
    fields = base_fields(Fields(raw, f.source))
    layers = fields["num_hidden_layers"]
    experts, top_k = f.need("num_local_experts"), f.need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds "
                          f"num_local_experts={experts}")
    layer_types = _layer_types(f.get("layer_types"), layers)
    window = f.get("sliding_window")
    if SLIDING in layer_types and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):
        raise ConfigError(f"--model-path: sliding_window={window!r} must be a positive integer "
                          "(layer_types has sliding_attention layers)")
    family = GptOssConfig(
        layer_types=layer_types, swiglu_limit=_positive(f, "swiglu_limit"),
        swiglu_alpha=_positive(f, "swiglu_alpha"),
        mxfp4_layers=mxfp4_layers(f.get("quantization_config"), layers))
    if family.mxfp4_layers:
        for key in ("hidden_size", "intermediate_size"):
            if fields[key] % 32:
                raise ConfigError(f"--model-path: {key}={fields[key]} must be a multiple of 32 "
                                  "(MXFP4 experts hold 32 values per scale)")
    bias = bool(f.get("attention_bias"))
    fields.update(
        qkv_bias=bias, o_bias=bias, attention_kinds=("gqa",) * layers,
        sliding_window=window if SLIDING in layer_types else None,
        sliding_layers=tuple(i for i, t in enumerate(layer_types) if t == SLIDING),
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=fields["intermediate_size"], moe_layers=tuple(range(layers)),
        family_config=family,
        **rope_fields(raw, fields["head_dim"], fields["max_position_embeddings"]))
    return fields


def _layer_types(types: object, num_layers: int) -> tuple[str, ...]:
    """As given, or transformers' default: sliding and full layers alternating, sliding first."""
    if types is None:
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (SLIDING, FULL) for t in types)):
        raise ConfigError(f"--model-path: layer_types must list num_hidden_layers={num_layers} "
                          f"entries, each {SLIDING!r} or {FULL!r}, got {types!r}")
    return tuple(types)


def _positive(f: Fields, key: str) -> float:
    value = f.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"--model-path: {key}={value!r} must be a positive number")
    return float(value)


def mxfp4_layers(quant: object, num_layers: int) -> tuple[int, ...]:
    """The layers whose experts are MXFP4 (``*_blocks`` and ``*_scales`` in the checkpoint):
    transformers' MXFP4 integration converts every experts module that ``modules_to_not_convert``
    does not name, and nothing else (attention, router, embeddings and head stay as stored)."""
    if not quant:
        return ()
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "mxfp4":
        raise ConfigError(f"--model-path: quantization_config quant_method {method!r} is not "
                          "supported for gpt-oss (mxfp4 as released, or no quantization)")
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
        raise ConfigError(f"--model-path: quantization_config modules_to_not_convert {skip!r} "
                          "must be a list of module names or patterns")
    return tuple(i for i in range(num_layers) if converted(_EXPERTS.format(i), skip))


def converted(module: str, skip: list[str]) -> bool:
    """transformers' rule: an entry leaves a module unconverted when it matches the name from its
    start up to a module boundary, as a regular expression (``model.layers.*.mlp``), or as a
    suffix of the name."""
    for pattern in skip:
        try:
            matched = re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module)
        except re.error as e:
            raise ConfigError(f"--model-path: quantization_config modules_to_not_convert entry "
                              f"{pattern!r} is not a valid pattern: {e}") from e
        if matched or module.endswith(pattern):
            return False
    return True

"""The config.json fields of DeepSeek V4 (``DeepseekV4ForCausalLM``), read as transformers 5.24
reads them (legacy keys folded in the same way), every field that changes the numerics either read
or refused with a ConfigError naming it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphcp.errors import ConfigError
from graphcp.models.config import Fields, ModelConfig, fp8_quantization

ARCHITECTURES = {"DeepseekV4ForCausalLM": "deepseek_v4"}
SLIDING, CSA = "sliding_attention", "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
MLP_KINDS = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "sigmoid")       # transformers has no "softmax" activation to route with
_LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}
# each layer type's attention kind (graphcp/attention/kinds.py)
ATTENTION_KINDS = {SLIDING: "deepseek_v4_sliding", CSA: "deepseek_v4_csa",
                   HCA: "deepseek_v4_hca"}
# transformers' defaults for the fields a config.json may leave out
_DEFAULTS = {"head_dim": 512, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
             "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
             "hc_mult": 4, "hc_sinkhorn_iters": 20, "n_routed_experts": 256,
             "num_experts_per_tok": 6, "moe_intermediate_size": 2048}


@dataclass(frozen=True)
class RopeSpec:
    """One of V4's two rotaries ("main" on sliding layers, "compress" on the compressed ones):
    interleaved pairs over the last ``dim`` features of a head."""
    theta: float
    dim: int
    yarn: dict | None = None        # YaRN: factor, original_max_position_embeddings, ...


@dataclass(frozen=True)
class DeepseekV4Config:
    """``ModelConfig.family_config`` of DeepSeek V4 (``DeepseekV4Config.of(cfg)``)."""
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[int, ...]     # per layer: tokens per compressed entry, 0 if sliding
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]       # per layer: experts chosen by token id (tid2eid)
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    main_rope: RopeSpec
    compress_rope: RopeSpec

    @staticmethod
    def of(cfg: ModelConfig) -> "DeepseekV4Config":
        if not isinstance(cfg.family_config, DeepseekV4Config):
            raise TypeError(f"{cfg.architecture} is no DeepSeek V4 model")
        return cfg.family_config

    def rope(self, layer: int) -> RopeSpec:
        return self.main_rope if self.layer_types[layer] == SLIDING else self.compress_rope


def _positive(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"--model-path: config.json field {key!r} must be a positive number, got "
                          f"{value!r}")
    return float(value)


def _refuse(raw: dict, key: str, allowed: object, why: str) -> None:
    if key in raw and raw[key] != allowed:
        raise ConfigError(f"--model-path: DeepSeek V4 {key}={raw[key]!r} is not supported ({why})")


def read_config(f: Fields, arch: str) -> dict:
    """Every ModelConfig field of a DeepSeek V4 checkpoint: its own rotaries, layer kinds and MoE
    fields, and the FP8 quantization config."""
    fields = v4_fields(f.raw, f.need)
    block, skip, scale_fmt = fp8_quantization(f.get("quantization_config"))
    return dict(fields, fp8_block=block, fp8_skip=skip, fp8_scale_fmt=scale_fmt,
                attention_kinds=v4_attention_kinds(fields["family_config"]))


def v4_fields(raw: dict, need: Callable[[str], int]) -> dict:
    """Every ModelConfig field of a DeepSeek V4 checkpoint; ``need`` reads a positive integer."""
    def get(key: str) -> int:
        return need(key) if key in raw else _DEFAULTS[key]

    layers, heads = need("num_hidden_layers"), need("num_attention_heads")
    head_dim = get("head_dim")
    _refuse(raw, "num_key_value_heads", 1, "shared-KV attention has one KV head")
    _refuse(raw, "hidden_act", "silu", "the experts are SwiGLU")
    _refuse(raw, "attention_bias", False, "V4 attention has no biases")
    _refuse(raw, "mlp_bias", False, "the shared expert has no biases")
    _refuse(raw, "n_shared_experts", 1, "transformers builds exactly one shared expert")
    _refuse(raw, "norm_topk_prob", True, "V4 renormalises the top-k weights, as transformers")
    _refuse(raw, "topk_method", "noaux_tc", "transformers picks the top-k of the bias-corrected "
            "scores")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise ConfigError(f"--model-path: DeepSeek V4 scoring_func {scoring!r} is not supported "
                          f"({', '.join(SCORING)})")
    quant = raw.get("quantization_config")
    quant = quant if isinstance(quant, dict) else {}
    expert_dtype = quant.get("expert_dtype", raw.get("expert_dtype"))
    if expert_dtype not in (None, "fp8"):
        raise ConfigError(f"--model-path: quantization_config expert_dtype {expert_dtype!r} is not "
                          "supported (fp8 experts; graphcp has no FP4 expert path)")
    kinds, rates = _layer_kinds(raw, layers)
    v4 = DeepseekV4Config(
        q_lora_rank=get("q_lora_rank"), o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"),
        sliding_window=get("sliding_window"), layer_types=kinds, compress_rates=rates,
        index_n_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"),
        index_topk=get("index_topk"), hc_mult=get("hc_mult"),
        hc_sinkhorn_iters=get("hc_sinkhorn_iters"), hc_eps=_positive(raw, "hc_eps", 1e-6),
        hash_layers=_hash_layers(raw, layers), scoring_func=scoring,
        routed_scaling_factor=_positive(raw, "routed_scaling_factor", 1.5),
        swiglu_limit=_positive(raw, "swiglu_limit", 10.0), **_ropes(raw, head_dim))
    if heads % v4.o_groups:
        raise ConfigError(f"--model-path: o_groups={v4.o_groups} must divide "
                          f"num_attention_heads={heads}")
    if CSA in kinds and v4.compress_rope.dim > v4.index_head_dim:
        raise ConfigError(f"--model-path: the compressed rotary covers {v4.compress_rope.dim} "
                          f"features, more than index_head_dim={v4.index_head_dim}")
    # transformers' attribute_map: num_local_experts and intermediate_size, where given, win
    experts = need("num_local_experts") if "num_local_experts" in raw else get("n_routed_experts")
    top_k = get("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds "
                          f"n_routed_experts={experts}")
    inter = (need("intermediate_size") if "intermediate_size" in raw
             else get("moe_intermediate_size"))
    return dict(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"), intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
        head_dim=head_dim, rms_norm_eps=_positive(raw, "rms_norm_eps", 1e-6),
        rope_theta=v4.main_rope.theta, rope_scaling=None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 1 << 20)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=False, qk_norm=False, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, norm_topk_prob=True, moe_layers=tuple(range(layers)),
        family_config=v4)


def v4_attention_kinds(v4: DeepseekV4Config) -> tuple[str, ...]:
    return tuple(ATTENTION_KINDS[kind] for kind in v4.layer_types)


def _layer_kinds(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``layer_types`` (or the legacy per-layer ``compress_ratios``, else transformers' default:
    two HCA layers, then CSA and HCA alternating) and each layer's compression rate."""
    rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(key) is not None:
            rates[kind] = raw[key]
    kinds = raw.get("layer_types")
    if kinds is None and raw.get("compress_ratios") is not None:
        legacy = raw["compress_ratios"]
        if not isinstance(legacy, list) or any(r not in _LEGACY_RATIOS for r in legacy):
            raise ConfigError(f"--model-path: compress_ratios={legacy!r} must list 0, 4 or 128 "
                              "per layer")
        kinds = [_LEGACY_RATIOS[r] for r in legacy]
    if kinds is None:
        kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    kinds = tuple(kinds[:layers]) if isinstance(kinds, list) else kinds
    if not isinstance(kinds, tuple) or len(kinds) != layers or not set(kinds) <= set(LAYER_KINDS):
        raise ConfigError(f"--model-path: layer_types={kinds!r} must give one of "
                          f"{', '.join(LAYER_KINDS)} for each of the {layers} layers")
    for kind in set(kinds) - {SLIDING}:
        rate = rates.get(kind)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ConfigError(f"--model-path: compress_rates[{kind!r}]={rate!r} must be a "
                              "positive integer")
    return kinds, tuple(0 if k == SLIDING else rates[k] for k in kinds)


def _hash_layers(raw: dict, layers: int) -> tuple[bool, ...]:
    """``mlp_layer_types``, else the first ``num_hash_layers`` (default 3) layers hash-routed."""
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        hashed = min(layers, int(raw.get("num_hash_layers", 3)))
        kinds = ["hash_moe"] * hashed + ["moe"] * (layers - hashed)
    if (not isinstance(kinds, list) or len(kinds[:layers]) != layers
            or not set(kinds) <= set(MLP_KINDS)):
        raise ConfigError(f"--model-path: mlp_layer_types={kinds!r} must give 'hash_moe' or 'moe' "
                          f"for each of the {layers} layers")
    return tuple(k == "hash_moe" for k in kinds[:layers])


def _ropes(raw: dict, head_dim: int) -> dict:
    """The "main" and "compress" rotaries: nested ``rope_parameters`` as transformers writes them,
    or the flat legacy form (top-level YaRN parameters apply to the compressed layers only, with
    attention_factor 1.0). A non-empty legacy ``rope_scaling`` replaces ``rope_parameters`` whole,
    as in transformers."""
    if raw.get("partial_rotary_factor") is not None:
        factor = raw["partial_rotary_factor"]
    else:
        factor = raw["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in raw else 64 / 512
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = (_nested(label, params[label], raw) for label in ("main", "compress"))
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0),
                "partial_rotary_factor": factor}
        compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0),
                    "partial_rotary_factor": factor}
        if compress.get("rope_type", compress.get("type", "default")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    return dict(main_rope=_rope_spec("main", main, head_dim, raw),
                compress_rope=_rope_spec("compress", compress, head_dim, raw))


def _nested(label: str, params: dict, raw: dict) -> dict:
    """One nested rotary completed as transformers' standardization completes it: the top-level
    rope_theta (default 10000) and partial_rotary_factor where the rotary has none. Without
    either, transformers' factor depends on the order it builds the two rotaries: refused."""
    params = {"rope_theta": raw.get("rope_theta", 10000.0), **params}
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if "partial_rotary_factor" not in params:
        raise ConfigError(f"--model-path: rope_parameters[{label!r}] needs partial_rotary_factor "
                          "(or a top-level partial_rotary_factor)")
    return params


def _rope_spec(label: str, params: dict, head_dim: int, raw: dict) -> RopeSpec:
    kind = params.get("rope_type", params.get("type", "default"))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ConfigError(f"--model-path: rope_parameters[{label!r}] partial_rotary_factor gives "
                          f"{dim} rotated features; it must be even and at most "
                          f"head_dim={head_dim}")
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise ConfigError(f"--model-path: rope_parameters[{label!r}] rope_theta={theta!r} must be "
                          "a number above 1")
    if kind == "default":
        return RopeSpec(float(theta), dim)
    if kind != "yarn":
        raise ConfigError(f"--model-path: rope_parameters[{label!r}] rope_type {kind!r} is not "
                          "supported (default, yarn)")
    if "factor" not in params:           # a KeyError in transformers
        raise ConfigError(f"--model-path: rope_parameters[{label!r}] yarn needs factor")
    context = raw.get("max_position_embeddings", 1 << 20)
    # transformers' standardization: the original context defaults to max_position_embeddings
    original = params.get("original_max_position_embeddings", context)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"--model-path: rope_parameters[{label!r}] yarn "
                          f"original_max_position_embeddings={original!r} must be a positive "
                          "integer")
    yarn = dict(params, original_max_position_embeddings=original)
    if yarn["factor"] is None:           # as transformers: the context extension ratio
        yarn["factor"] = context / original
    yarn["factor"] = _positive(yarn, "factor", 1.0)
    return RopeSpec(float(theta), dim, yarn)


def check_flags(args, cfg: ModelConfig) -> None:
    """V4 shards queries by interleave only, without DP, attention TP or pipeline stages (its
    attention has one KV head, as DSA's MLA); the flags its op and model do not serve are
    refused."""
    if args.cp_size > 1 and args.cp_strategy != "interleave":
        raise ConfigError(f"--cp-strategy {args.cp_strategy}: DeepSeek V4 needs --cp-strategy "
                          "interleave (its compressors run on the all-gathered rows in token "
                          "order)")
    for flag, value in (("--dp", args.dp_size), ("--pp", args.pp_size)):
        if value > 1:
            raise ConfigError(f"{flag} {value}: DeepSeek V4 needs {flag} 1")
    if args.attn_tp_size > 1:
        raise ConfigError(f"--tp {args.tp_size}: DeepSeek V4 needs attention TP 1 (--tp equal to "
                          "--dp x --attn-cp-size)")
    if args.speculative_aux_hidden_layers:
        raise ConfigError("--speculative-aux-hidden-layers: DeepSeek V4's residual is hc_mult "
                          "streams; graphcp returns no aux hidden states for it")

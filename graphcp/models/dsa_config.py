"""The config.json fields of the DSA models (DeepSeek V3.2, GLM-5): MLA, the lightning indexer
and the DeepSeek MoE, read as transformers 5 reads them, and the flags DSA allows."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphcp.errors import ConfigError

DSA_ARCHITECTURES = {"DeepseekV32ForCausalLM": "deepseek_v32",
                     "GlmMoeDsaForCausalLM": "glm_moe_dsa"}
# Released config.json fields that transformers never reads: it runs exactly these values (sigmoid
# router with the score-correction bias, fp32 router, MoE on every layer past the dense ones,
# interleaved MLA RoPE), and so does graphcp. Any other value is refused, not silently replaced.
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
          "moe_router_dtype": "float32", "rope_interleave": True}


@dataclass(frozen=True)
class DSAConfig:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleaved: bool     # GLM-5 rotates the indexer interleaved, V3.2 half-split
    shared_indexer: tuple[bool, ...]   # per layer: reuse the previous layer's top-k (GLM "shared")
    attention_bias: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def dsa_fields(raw: dict, arch: str, num_layers: int, need: Callable[[str], int]) -> dict:
    """ModelConfig fields of a DSA model: its MLA/indexer config and its MoE layers."""
    glm = arch == "GlmMoeDsaForCausalLM"
    # HF rotates GLM-5's indexer interleaved and V3.2's half-split, whatever the field says.
    for key, value in {**_FIXED, "indexer_rope_interleave": glm}.items():
        if key in raw and raw[key] != value:
            raise ConfigError(f"--model-path: {key}={raw[key]!r} is not supported: transformers "
                              f"and graphcp run {arch} with {key}={value!r}")
    layer_types = raw.get("layer_types")
    if layer_types is not None and layer_types != ["indexed_attention"] * num_layers:
        raise ConfigError(f"--model-path: layer_types={layer_types!r} is not supported: every "
                          "layer of a DSA model is 'indexed_attention'")
    for key in ("num_key_value_heads",):
        if raw.get(key, raw["num_attention_heads"]) != raw["num_attention_heads"]:
            raise ConfigError(f"--model-path: MLA needs num_key_value_heads == "
                              f"num_attention_heads, got {raw.get(key)}")
    if raw.get("q_lora_rank") is None:
        raise ConfigError("--model-path: DSA models need q_lora_rank (MLA with a query LoRA)")
    dsa = DSAConfig(
        q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), index_n_heads=need("index_n_heads"),
        index_head_dim=need("index_head_dim"), index_topk=need("index_topk"),
        indexer_rope_interleaved=glm,
        shared_indexer=_shared_indexer(raw, arch, num_layers),
        attention_bias=bool(raw.get("attention_bias", False)),
        n_group=need("n_group"), topk_group=need("topk_group"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0))
    if dsa.qk_rope_head_dim % 2 or dsa.qk_rope_head_dim > dsa.index_head_dim:
        raise ConfigError(f"--model-path: qk_rope_head_dim={dsa.qk_rope_head_dim} must be even and "
                          f"at most index_head_dim={dsa.index_head_dim}")
    experts = need("n_routed_experts")
    if experts % dsa.n_group or dsa.topk_group > dsa.n_group or experts // dsa.n_group < 2:
        raise ConfigError(f"--model-path: n_group={dsa.n_group} must divide n_routed_experts="
                          f"{experts} into groups of >= 2, with topk_group={dsa.topk_group} "
                          "<= n_group")
    top_k = need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds "
                          f"n_routed_experts={experts}")
    return dict(dsa=dsa, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=need("moe_intermediate_size"),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                moe_layers=_moe_layers(raw, num_layers))


def _moe_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """``mlp_layer_types`` where given, else the first ``first_k_dense_replace`` layers dense."""
    types = raw.get("mlp_layer_types")
    if types is None:
        dense = min(int(raw.get("first_k_dense_replace", 3)), num_layers)
        types = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    if len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
        raise ConfigError(f"--model-path: mlp_layer_types={types!r} must give 'dense' or 'sparse' "
                          "per layer")
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def _shared_indexer(raw: dict, arch: str, num_layers: int) -> tuple[bool, ...]:
    """Per layer: does it reuse the previous layer's top-k (GLM-5 IndexShare "shared")? As HF's
    GlmMoeDsaConfig decides: ``indexer_types``; else ``index_topk_pattern`` ("F"/"S" per layer,
    or a list of modes); else the schedule: layer i runs its indexer when
    ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2 and 1: every
    layer). V3.2 runs the indexer on every layer."""
    if arch != "GlmMoeDsaForCausalLM":
        return (False,) * num_layers
    field, types = "indexer_types", raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        field, pattern = "index_topk_pattern", raw["index_topk_pattern"]
        modes = {"F": "full", "S": "shared"}
        types = [modes.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    elif types is None:
        field = "index_topk_freq / index_skip_topk_offset"
        freq, offset = raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (freq, offset)):
            raise ConfigError(f"--model-path: index_topk_freq={freq!r} and index_skip_topk_offset="
                              f"{offset!r} must be integers")
        freq = max(freq, 1)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or not set(types) <= {"full", "shared"} or types[0] != "full"):
        raise ConfigError(f"--model-path: {field} gives indexer modes {types!r}: need 'full' or "
                          f"'shared' for each of the {num_layers} layers, the first 'full' (a "
                          "shared layer reuses the top-k of the layer before)")
    return tuple(t == "shared" for t in types)


def check_dsa_flags(args) -> None:
    """DSA shards queries by interleave only, without DP or attention TP (as SGLang)."""
    if args.cp_size > 1 and args.cp_strategy != "interleave":
        raise ConfigError(f"--cp-strategy {args.cp_strategy}: DSA models need --cp-strategy "
                          "interleave")
    if args.dp_size > 1:
        raise ConfigError(f"--dp {args.dp_size}: DSA models need --dp 1")
    if args.attn_tp_size > 1:
        raise ConfigError(f"--tp {args.tp_size}: DSA models need attention TP 1 (--tp equal to "
                          "--dp x --attn-cp-size)")
    if args.pp_size > 1:
        raise ConfigError(f"--pp {args.pp_size}: DSA models need --pp 1")

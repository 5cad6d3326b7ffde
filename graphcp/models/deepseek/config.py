"""The config.json fields of the DeepSeek-style models: MLA (DeepSeek-V3 / R1, Kimi-K2), MLA with
the DSA lightning indexer (DeepSeek V3.2, GLM-5) and the DeepSeek MoE, read as transformers 5 reads
them, and the flags these models allow."""
from __future__ import annotations

from dataclasses import dataclass

from graphcp.errors import ConfigError
from graphcp.models.config import Fields, ModelConfig, base_fields, expert_count, rope_fields

# architecture -> model_type; DeepSeek-V3 (and Kimi-K2) have no indexer
ARCHITECTURES = {"DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa",
                 "DeepseekV3ForCausalLM": "deepseek_v3"}
# transformers' class defaults for the fields graphcp reads with another fallback
HF_DEFAULTS = {
    "DeepseekV32ForCausalLM": dict(max_position_embeddings=163840, routed_scaling_factor=2.5,
                                   n_shared_experts=1, n_group=8, topk_group=4),
    "DeepseekV3ForCausalLM": dict(max_position_embeddings=4096, routed_scaling_factor=2.5,
                                  n_shared_experts=1, n_group=8, topk_group=4, q_lora_rank=1536),
    "GlmMoeDsaForCausalLM": dict(max_position_embeddings=202752, rms_norm_eps=1e-5,
                                 routed_scaling_factor=2.5, n_shared_experts=1, n_group=1,
                                 topk_group=1),
}
# Released config.json fields that transformers never reads: it runs exactly these values (sigmoid
# router with the score-correction bias, fp32 router, MoE on every layer past the dense ones,
# interleaved MLA RoPE but in DeepSeek-V3, which reads it), and so does graphcp. Any other value
# is refused, not silently replaced.
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
          "moe_router_dtype": "float32", "rope_interleave": True}


@dataclass(frozen=True)
class MLAConfig:
    """MLA's fields, the indexer's (all 0 for DeepSeek-V3, which has none), the DeepSeek MoE's:
    ``ModelConfig.family_config`` of the deepseek family (``MLAConfig.of(cfg)``)."""
    q_lora_rank: int | None            # None: one q_proj, no query LoRA (HF's DeepSeek-V3 reads it)
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
    rope_interleave: bool = True       # MLA's RoPE pairwise (DeepSeek), else half-split

    @staticmethod
    def of(cfg: ModelConfig) -> "MLAConfig":
        if not isinstance(cfg.family_config, MLAConfig):
            raise TypeError(f"{cfg.architecture} is no MLA model")
        return cfg.family_config

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def indexed(self, layer: int) -> bool:
        """Does ``layer`` run its own indexer (DSA, not a GLM "shared" layer)?"""
        return self.index_topk > 0 and not self.shared_indexer[layer]


def read_config(f: Fields, arch: str) -> dict:
    """ModelConfig fields of an MLA model: RoPE covers the decoupled rope part only (HF overwrites
    head_dim with it), its MLA (and indexer) config, its MoE layers; the expert count is
    ``num_experts`` over ``num_local_experts`` over ``n_routed_experts``."""
    f = Fields(expert_count(f.raw, ("num_experts", "num_local_experts", "n_routed_experts"),
                            "n_routed_experts"), f.source)
    fields = base_fields(f, "qk_rope_head_dim", head_dim_fallback=False)
    layers = fields["num_hidden_layers"]
    fields.update(_mla_fields(f.raw, arch, layers, f.need),
                  **rope_fields(f.raw, fields["head_dim"], fields["max_position_embeddings"]))
    kind = "dsa" if fields["family_config"].index_topk else "mla"
    return dict(fields, attention_kinds=(kind,) * layers)


def _mla_fields(raw: dict, arch: str, num_layers: int, need) -> dict:
    glm, v3 = arch == "GlmMoeDsaForCausalLM", arch == "DeepseekV3ForCausalLM"
    # HF rotates GLM-5's indexer interleaved and V3.2's half-split, whatever the field says.
    fixed = {k: v for k, v in _FIXED.items() if not (v3 and k == "rope_interleave")}
    for key, value in (fixed if v3 else {**fixed, "indexer_rope_interleave": glm}).items():
        if key in raw and raw[key] != value:
            raise ConfigError(f"--model-path: {key}={raw[key]!r} is not supported: transformers "
                              f"and graphcp run {arch} with {key}={value!r}")
    layer_types = raw.get("layer_types")
    if not v3 and layer_types is not None and layer_types != ["indexed_attention"] * num_layers:
        raise ConfigError(f"--model-path: layer_types={layer_types!r} is not supported: every "
                          "layer of a DSA model is 'indexed_attention'")
    for key in ("num_key_value_heads",):
        if raw.get(key, raw["num_attention_heads"]) != raw["num_attention_heads"]:
            raise ConfigError(f"--model-path: MLA needs num_key_value_heads == "
                              f"num_attention_heads, got {raw.get(key)}")
    if raw.get("q_lora_rank") is None and not v3:
        raise ConfigError("--model-path: DSA models need q_lora_rank (MLA with a query LoRA)")
    interleave = raw.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"--model-path: rope_interleave={interleave!r} must be true or false")
    index = (0, 0, 0) if v3 else (need("index_n_heads"), need("index_head_dim"), need("index_topk"))
    mla = MLAConfig(
        q_lora_rank=None if raw.get("q_lora_rank") is None else need("q_lora_rank"),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), index_n_heads=index[0], index_head_dim=index[1],
        index_topk=index[2], indexer_rope_interleaved=glm,
        shared_indexer=_shared_indexer(raw, arch, num_layers),
        attention_bias=bool(raw.get("attention_bias", False)),
        n_group=need("n_group"), topk_group=need("topk_group"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0), rope_interleave=interleave)
    if mla.qk_rope_head_dim % 2 or (not v3 and mla.qk_rope_head_dim > mla.index_head_dim):
        raise ConfigError(f"--model-path: qk_rope_head_dim={mla.qk_rope_head_dim} must be even and "
                          f"at most index_head_dim={mla.index_head_dim}")
    experts = need("n_routed_experts")
    if experts % mla.n_group or mla.topk_group > mla.n_group or experts // mla.n_group < 2:
        raise ConfigError(f"--model-path: n_group={mla.n_group} must divide n_routed_experts="
                          f"{experts} into groups of >= 2, with topk_group={mla.topk_group} "
                          "<= n_group")
    top_k = need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds "
                          f"n_routed_experts={experts}")
    # DeepSeek-V3's HF model reads first_k_dense_replace only (no mlp_layer_types there).
    moe_raw = {k: v for k, v in raw.items() if not (v3 and k == "mlp_layer_types")}
    return dict(family_config=mla, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=need("moe_intermediate_size"),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                moe_layers=_moe_layers(moe_raw, num_layers))


def _moe_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """``mlp_layer_types`` where given, else the first ``first_k_dense_replace`` layers dense."""
    types = raw.get("mlp_layer_types")
    if types is None:
        dense = raw.get("first_k_dense_replace", 3)
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ConfigError(f"--model-path: first_k_dense_replace={dense!r} must be an integer "
                              ">= 0")
        dense = min(dense, num_layers)
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


def check_flags(args, cfg: ModelConfig) -> None:
    """The flags an MLA model runs with (DSA or dense MLA)."""
    (check_dsa_flags if MLAConfig.of(cfg).index_topk else check_mla_flags)(args)


def check_dsa_flags(args) -> None:
    """DSA shards queries by interleave only, without DP; attention TP splits the heads without
    CP (under CP, attention TP is 1: --tp equal to --attn-cp-size, as SGLang)."""
    if args.cp_size > 1 and args.cp_strategy != "interleave":
        raise ConfigError(f"--cp-strategy {args.cp_strategy}: DSA models need --cp-strategy "
                          "interleave")
    if args.cp_size > 1 and args.attn_tp_size > 1:
        raise ConfigError(f"--tp {args.tp_size}: DSA models under CP need attention TP 1 (--tp "
                          "equal to --dp x --attn-cp-size)")
    _check_mla_flags(args, "DSA")


def check_mla_flags(args) -> None:
    """DeepSeek-V3 / Kimi-K2: either layout, heads over attention TP; its attention runs the torch
    forms (``kernels/mla_torch.py``), so another --attention-kernel is refused."""
    if args.attention_kernel not in ("auto", "torch"):
        raise ConfigError(f"--attention-kernel {args.attention_kernel}: MLA models run the torch "
                          "attention forms (auto or torch)")
    _check_mla_flags(args, "MLA")


def _check_mla_flags(args, family: str) -> None:
    if args.dp_size > 1:
        raise ConfigError(f"--dp {args.dp_size}: {family} models need --dp 1")
    if args.pp_size > 1:
        raise ConfigError(f"--pp {args.pp_size}: {family} models need --pp 1")
    # Attention-TP ranks hold the same MLA rows; a PD sender sends heads per rank.
    if args.attn_tp_size > 1 and args.disaggregation_mode == "prefill":
        raise ConfigError(f"--disaggregation-mode prefill: {family} models send their cache with "
                          f"attention TP 1 (--tp {args.tp_size} splits the heads)")

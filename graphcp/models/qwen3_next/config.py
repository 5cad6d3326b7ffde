"""The config.json fields of the hybrid linear-attention models (Qwen3-Next, Qwen3.5 text,
Qwen3.5-MoE text): which layers are Gated DeltaNet, their head shapes and conv kernel, the partial
rotary of the gated full-attention layers and the shared expert, read as transformers 5 reads
them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from graphcp.errors import ConfigError
from graphcp.models.config import Fields, ModelConfig, base_fields, moe_fields, rope_fields

ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
                 "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}
LINEAR, FULL = "linear_attention", "full_attention"
KIND = {LINEAR: "gated_deltanet", FULL: "gqa"}    # layer type -> layer kind (attention/kinds.py)
# transformers' class defaults for the fields graphcp reads with another fallback.
_SHAPES = dict(max_position_embeddings=32768, head_dim=256, num_key_value_heads=2,
               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_num_key_heads=16, linear_num_value_heads=32)
_EXPERTS = dict(moe_intermediate_size=512, shared_expert_intermediate_size=512)
HF_DEFAULTS = {
    "Qwen3NextForCausalLM": dict(_SHAPES, **_EXPERTS, num_experts=512, num_experts_per_tok=10,
                                 norm_topk_prob=True),
    "Qwen3_5ForCausalLM": dict(_SHAPES, num_key_value_heads=4),
    "Qwen3_5MoeForCausalLM": dict(_SHAPES, **_EXPERTS, num_experts=256, num_experts_per_tok=8),
}


@dataclass(frozen=True)
class HybridConfig:
    """``ModelConfig.family_config`` of the Qwen3-Next family (``HybridConfig.of(cfg)``)."""
    layer_types: tuple[str, ...]     # per layer: "linear_attention" (DeltaNet), "full_attention"
    num_k_heads: int                 # linear_num_key_heads
    num_v_heads: int                 # linear_num_value_heads (a multiple of the key heads)
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int                 # linear_conv_kernel_dim
    rotary_dim: int                  # rotated dims of a full-attention head (partial_rotary_factor)
    split_projections: bool          # Qwen3.5: in_proj_qkv/z/b/a; Qwen3-Next: in_proj_qkvz/ba
    shared_expert_intermediate_size: int   # 0 without MoE

    @staticmethod
    def of(cfg: ModelConfig) -> "HybridConfig":
        if not isinstance(cfg.family_config, HybridConfig):
            raise TypeError(f"{cfg.architecture} has no linear-attention layers")
        return cfg.family_config

    def per_rank(self, attn_tp: int) -> "HybridConfig":
        """The linear heads one of ``attn_tp`` ranks holds: whole key heads, each with its value
        heads (``check_flags`` makes them divide)."""
        return replace(self, num_k_heads=self.num_k_heads // attn_tp,
                       num_v_heads=self.num_v_heads // attn_tp)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


def read_config(f: Fields, arch: str) -> dict:
    """As transformers 5 reads them: gated full attention (q/k/v/o biased by attention_bias), the
    Gated DeltaNet layers, a Qwen-style MoE where there are experts (Qwen3.5-MoE: every layer,
    renormalised top-k, and HF's text model reads no intermediate_size), RoPE over the rotary part
    of each full-attention head."""
    if arch == "Qwen3_5MoeForCausalLM":
        f = Fields({**f.raw, "intermediate_size": f.get("moe_intermediate_size"),
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
                   f.source)
    fields = base_fields(f)
    bias = bool(f.get("attention_bias", False))
    layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
    hybrid = hybrid_fields(f.raw, arch, layers, head_dim, f.need)
    fields.update(qkv_bias=bias, o_bias=bias, family_config=hybrid,
                  attention_kinds=hybrid_kinds(hybrid),
                  **rope_fields(hybrid_rope(f.raw), hybrid.rotary_dim,
                                fields["max_position_embeddings"]))
    if arch == "Qwen3_5MoeForCausalLM" or (arch == "Qwen3NextForCausalLM" and f.get("num_experts")):
        fields.update(moe_fields(f, layers))
    return fields


def hybrid_fields(raw: dict, arch: str, num_layers: int, head_dim: int,
                  need: Callable[[str], int]) -> HybridConfig:
    """The hybrid part of a ModelConfig; the MoE fields go through the Qwen3-MoE reader."""
    layer_types = _layer_types(raw, num_layers)
    k_heads, v_heads = need("linear_num_key_heads"), need("linear_num_value_heads")
    if v_heads % k_heads:
        raise ConfigError(f"--model-path: linear_num_value_heads={v_heads} must be a multiple of "
                          f"linear_num_key_heads={k_heads}")
    if raw.get("attn_output_gate", True) is not True:
        raise ConfigError(f"--model-path: attn_output_gate={raw['attn_output_gate']!r} is not "
                          "supported (transformers gates every full-attention layer)")
    _, rope = _rope_source(raw)
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    numeric = isinstance(factor, (int, float)) and 0 < factor <= 1
    rotary_dim = int(head_dim * factor) if numeric else 0
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"--model-path: partial_rotary_factor={factor!r} must give an even "
                          f"rotary size in (0, head_dim={head_dim}]")
    moe = arch != "Qwen3_5ForCausalLM" and raw.get("num_experts", 0)
    return HybridConfig(
        layer_types=layer_types, num_k_heads=k_heads, num_v_heads=v_heads,
        head_k_dim=need("linear_key_head_dim"), head_v_dim=need("linear_value_head_dim"),
        conv_kernel=need("linear_conv_kernel_dim"), rotary_dim=rotary_dim,
        split_projections=arch != "Qwen3NextForCausalLM",
        shared_expert_intermediate_size=need("shared_expert_intermediate_size") if moe else 0)


def _layer_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    """``layer_types`` where given, else every ``full_attention_interval``-th layer full (4)."""
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"--model-path: full_attention_interval={interval!r} must be a "
                              "positive integer")
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (LINEAR, FULL) for t in types)):
        raise ConfigError(f"--model-path: layer_types must list {num_layers} entries, each "
                          f"{LINEAR!r} or {FULL!r}, got {types!r}")
    return tuple(types)


def hybrid_kinds(cfg: HybridConfig) -> tuple[str, ...]:
    """Each layer's kind: Gated DeltaNet layers their own, gated full attention the dense ``gqa``
    kind (its output gate, q/k norms and partial rotary all sit outside the attention call)."""
    return tuple(KIND[t] for t in cfg.layer_types)


def _rope_source(raw: dict) -> tuple[str, dict]:
    """(key, rope parameters): a non-empty legacy ``rope_scaling`` replaces ``rope_parameters``
    whole, as in transformers."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"--model-path: {key} must be a mapping, got {params!r}")
    return key, params


def hybrid_rope(raw: dict) -> dict:
    """The config as the rope reader should see it: the rotary part of a head is what rotates, so
    ``partial_rotary_factor`` (which sets that part) is not applied a second time."""
    key, params = _rope_source(raw)
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    return {**{k: v for k, v in raw.items() if k != "partial_rotary_factor"},
            "rope_parameters": None, "rope_scaling": None, key: params or None}


def check_flags(args, cfg: ModelConfig) -> None:
    """What the hybrid models run with: zigzag CP (the state hand-off cuts each request into 2C
    blocks; interleave would cut every linear-attention sequence token by token) without adaptive
    placement (untested), attention TP over whole linear key heads (each with its value heads),
    no PD transfer (it would have to carry the linear states)."""
    if args.cp_size > 1 and args.resolved_cp_strategy != "zigzag":
        raise ConfigError(f"--cp-strategy {args.resolved_cp_strategy}: hybrid linear-attention "
                          "models need --cp-strategy zigzag")
    if args.enable_adaptive_cp:
        raise ConfigError("--enable-adaptive-cp: hybrid linear-attention models are not served "
                          "with adaptive placement yet (drop the flag: every request is split zigzag)")
    atp, k_heads = args.attn_tp_size, HybridConfig.of(cfg).num_k_heads
    if k_heads % atp:
        raise ConfigError(f"--tp {args.tp_size}: attention TP size {atp} (tp / (dp x "
                          f"attn-cp-size)) must divide linear_num_key_heads={k_heads} (each rank "
                          "holds whole Gated DeltaNet key heads with their value heads)")
    if args.disaggregation_mode != "null":
        raise ConfigError(f"--disaggregation-mode {args.disaggregation_mode}: hybrid "
                          "linear-attention models do not transfer their linear states yet "
                          "(use null)")

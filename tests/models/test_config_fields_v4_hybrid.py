"""Every config field of DeepSeek V4 and the hybrid linear-attention families (Qwen3-Next, Qwen3.5
text, Qwen3.5-MoE text), classified and checked against graphcp's reader (the machinery and the
kinds of field: tests/testkit/config_fields.py), and every config graphcp reads here also read by
transformers: the shapes, schedules, routing and both rotaries (inverse frequencies and attention
factor, from HF's own rotary modules) agree.

The fields are the ``to_dict()`` keys of transformers' classes plus the config.json keys of the
released checkpoints and the legacy spellings transformers folds in (V4's ``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ...; Qwen3.5's ``attn_output_gate``, ``mtp_*``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from testkit.config_fields import DROP, INERT, FieldTable, read

from graphcp import ConfigError
from graphcp.models.common.rope import inv_freq
from graphcp.models.deepseek_v4.rope import V4Rotary

V4 = "DeepseekV4Config"
HYBRID = ("Qwen3NextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig")
CLASSES = {V4: "DeepseekV4ForCausalLM", "Qwen3NextConfig": "Qwen3NextForCausalLM",
           "Qwen3_5TextConfig": "Qwen3_5ForCausalLM",
           "Qwen3_5MoeTextConfig": "Qwen3_5MoeForCausalLM"}
ROTARY = {V4: "deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding",
          "Qwen3NextConfig": "qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding",
          "Qwen3_5TextConfig": "qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding",
          "Qwen3_5MoeTextConfig": "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding"}
SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
FULL, LINEAR = "full_attention", "linear_attention"
SHAPES = dict(vocab_size=211, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              head_dim=32, max_position_embeddings=2048)
HYB = dict(SHAPES, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=16)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
TINY = {V4: dict(SHAPES, moe_intermediate_size=32, q_lora_rank=32, n_routed_experts=4,
                 num_experts_per_tok=2, sliding_window=8, o_groups=2, o_lora_rank=16,
                 index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
                 partial_rotary_factor=0.25),
        "Qwen3NextConfig": dict(HYB, intermediate_size=96, **EXPERTS),
        "Qwen3_5TextConfig": dict(HYB, intermediate_size=96),
        "Qwen3_5MoeTextConfig": dict(HYB, **EXPERTS)}

MTP = "the MTP draft layers are not part of the prefill forward; their mtp.* weights are skipped"
NO_WINDOW = "the hybrid models have no sliding-window layers: transformers never reads it"
INERT_FOR = {
    "router_jitter_noise": ((V4,), "training only: HF's V4 routers never read it"),
    "original_max_position_embeddings": ((V4,), "V4's rotaries are nested, each with its own "
                                                "original context; HF never reads the top level"),
    "use_sliding_window": (("Qwen3NextConfig",), NO_WINDOW),
    "sliding_window": (("Qwen3NextConfig",), NO_WINDOW),
    "max_window_layers": (("Qwen3NextConfig",), NO_WINDOW),
    "mamba_ssm_dtype": (HYBRID[1:], "another engine's state dtype: HF does not read it, graphcp "
                                    "keeps the recurrent state in float32 (attention/kinds.py)"),
    "mtp_num_hidden_layers": (HYBRID[1:], MTP), "mtp_use_dedicated_embeddings": (HYBRID[1:], MTP),
    **{key: (("Qwen3_5TextConfig",), "Qwen3.5's dense text model builds no experts")
       for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "shared_expert_intermediate_size")},
    "intermediate_size": (("Qwen3_5MoeTextConfig",), "every layer is MoE: HF's Qwen3.5-MoE text "
                                                     "model builds no dense MLP"),
    **{key: (("Qwen3_5MoeTextConfig",), "HF's Qwen3.5-MoE routes every layer and always "
                                        "renormalises the top-k")
       for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")},
}
FIXED_FOR = {   # transformers runs one value whatever the field says
    "num_key_value_heads": {V4: (1, 2)}, "n_shared_experts": {V4: (1, 2)},
    "norm_topk_prob": {V4: (True, False)}, "attention_bias": {V4: (False, True)},
    "topk_method": {V4: ("noaux_tc", "greedy")},
    "attn_output_gate": {c: (True, False) for c in HYBRID[1:]},
}
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
NESTED = {"main": {"rope_type": "default", "rope_theta": 2e4, "partial_rotary_factor": 0.5},
          "compress": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e5,
                       "original_max_position_embeddings": 256, "partial_rotary_factor": 0.25}}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
FLAT = {"rope_parameters": dict(YARN)}
ALT = {   # field -> (context patch, another value)
    "architectures": ({}, None), "model_type": ({}, None),      # per class: OTHER_ARCH
    "vocab_size": ({}, 300), "hidden_size": ({}, 128), "intermediate_size": ({}, 128),
    "num_hidden_layers": ({"layer_types": None, "mlp_layer_types": None}, 3),
    "num_attention_heads": ({}, 8), "num_key_value_heads": ({}, 1), "head_dim": ({}, 8),
    "hidden_act": ({}, "gelu"), "rms_norm_eps": ({}, 1e-3), "max_position_embeddings": ({}, 4096),
    "tie_word_embeddings": ({}, True), "attention_bias": ({}, True), "mlp_bias": ({}, True),
    "rope_parameters": ({}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    "rope_scaling": ({}, {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
    "rope_theta": ({"rope_parameters": None}, 5e5), "partial_rotary_factor": (FLAT, 0.5),
    "original_max_position_embeddings": (FLAT, 64), "quantization_config": ({}, FP8),
    "layer_types": ({}, [FULL, LINEAR, LINEAR, FULL]),
    "full_attention_interval": ({"layer_types": None}, 2),
    "linear_conv_kernel_dim": ({}, 3), "linear_key_head_dim": ({}, 32),
    "linear_value_head_dim": ({}, 32), "linear_num_key_heads": ({}, 1),
    "linear_num_value_heads": ({}, 8), "decoder_sparse_step": ({}, 2),
    "mlp_only_layers": ({}, [0]), "moe_intermediate_size": ({}, 64),
    "shared_expert_intermediate_size": ({}, 64), "norm_topk_prob": ({}, "flip"),
    "num_experts_per_tok": ({}, 1), "num_experts": ({}, 8), "num_local_experts": ({}, 8),
    "n_routed_experts": ({}, 16), "q_lora_rank": ({}, 64), "o_groups": ({}, 4),
    "o_lora_rank": ({}, 32), "index_n_heads": ({}, 8), "index_head_dim": ({}, 64),
    "index_topk": ({}, 16), "hc_mult": ({}, 3), "hc_sinkhorn_iters": ({}, 5),
    "hc_eps": ({}, 1e-4), "swiglu_limit": ({}, 5.0), "routed_scaling_factor": ({}, 2.5),
    "scoring_func": ({}, "sigmoid"), "compress_rates": ({}, {CSA: 8, HCA: 16}),
    "compress_rope_theta": ({"rope_parameters": None}, 5e4),
    "compress_ratios": ({"layer_types": None}, [0, 4, 128, 4]),
    "compress_rate_csa": ({}, 8), "compress_rate_hca": ({}, 32),
    "num_hash_layers": ({"mlp_layer_types": None}, 1), "expert_dtype": ({}, "fp4"),
    "qk_rope_head_dim": ({"partial_rotary_factor": None, "rope_parameters": None}, 16),
}
ALT_FOR = {   # V4's own values where the hybrids' do not fit
    "layer_types": {V4: ({}, [SLIDING, CSA, HCA, CSA])}, "sliding_window": {V4: ({}, 16)},
    "mlp_layer_types": {V4: ({}, ["moe"] * 4)}, "rope_parameters": {V4: ({}, NESTED)},
    # Qwen3-Next reads its dense size on the layers mlp_only_layers names
    "intermediate_size": {"Qwen3NextConfig": ({"mlp_only_layers": [0]}, 128)},
}
OTHER_ARCH = {V4: "DeepseekV3ForCausalLM", "Qwen3NextConfig": "Qwen3_5ForCausalLM",
              "Qwen3_5TextConfig": "Qwen3_5MoeForCausalLM",
              "Qwen3_5MoeTextConfig": "Qwen3_5ForCausalLM"}
QWEN_EXTRAS = ["rope_scaling", "rope_theta", "partial_rotary_factor", "torch_dtype",
               "original_max_position_embeddings", "quantization_config",
               "full_attention_interval"]
QWEN35_EXTRAS = QWEN_EXTRAS + ["attn_output_gate", "mamba_ssm_dtype", "mtp_num_hidden_layers",
                               "mtp_use_dedicated_embeddings"]
EXTRAS = {V4: ["rope_scaling", "torch_dtype", "quantization_config", "expert_dtype",
               "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers",
               "topk_method", "num_local_experts", "intermediate_size",
               "original_max_position_embeddings"],
          "Qwen3NextConfig": QWEN_EXTRAS + ["use_sliding_window", "sliding_window",
                                            "max_window_layers"],
          "Qwen3_5TextConfig": QWEN35_EXTRAS + ["num_experts", "num_experts_per_tok",
                                                "moe_intermediate_size",
                                                "shared_expert_intermediate_size"],
          "Qwen3_5MoeTextConfig": QWEN35_EXTRAS + ["intermediate_size", "norm_topk_prob",
                                                   "decoder_sparse_step", "mlp_only_layers"]}
TABLE = FieldTable(classes=CLASSES, tiny=TINY, extras=EXTRAS, other_arch=OTHER_ARCH,
                   inert=INERT, fixed={}, alt=ALT, inert_for=INERT_FOR, fixed_for=FIXED_FOR,
                   alt_for=ALT_FOR)
CASES = TABLE.cases()


def _hf(name: str, raw: dict):
    import importlib

    import transformers
    config = getattr(transformers, name).from_dict(copy.deepcopy(raw))
    module, cls = ROTARY[name].rsplit(".", 1)
    rotary = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(config)
    return config, rotary


def _views(name: str, raw: dict) -> tuple[dict, dict]:
    """(graphcp's reading, transformers' reading) of one config.json, side by side."""
    cfg, (hf, rotary) = read(raw), _hf(name, raw)
    ours = dict(vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                heads=cfg.num_attention_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                tie=cfg.tie_word_embeddings)
    theirs = dict(vocab=hf.vocab_size, hidden=hf.hidden_size, layers=hf.num_hidden_layers,
                  heads=hf.num_attention_heads, head_dim=hf.head_dim, eps=hf.rms_norm_eps,
                  tie=hf.tie_word_embeddings)
    if name == V4:
        v4, labels = cfg.family_config, ("main", "compress")
        ours |= dict(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                     inter=(cfg.intermediate_size, cfg.moe_intermediate_size),
                     **{k: getattr(v4, k) for k in _V4_SAME}, layer_types=v4.layer_types,
                     rates=v4.compress_rates, hash=v4.hash_layers,
                     rotary=[_v4_rotary(spec) for spec in (v4.main_rope, v4.compress_rope)])
        theirs |= dict(experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                       inter=(hf.intermediate_size,) * 2, **{k: getattr(hf, k) for k in _V4_SAME},
                       layer_types=tuple(hf.layer_types),
                       rates=tuple(0 if t == SLIDING else hf.compress_rates[t]
                                   for t in hf.layer_types),
                       hash=tuple(t == "hash_moe" for t in hf.mlp_layer_types),
                       rotary=[_hf_rotary(rotary, label) for label in labels])
        return ours, theirs
    h = cfg.family_config
    ours |= dict(kv_heads=cfg.num_key_value_heads, bias=(cfg.qkv_bias, cfg.o_bias),
                 layer_types=h.layer_types, moe_layers=cfg.moe_layers,
                 linear=(h.num_k_heads, h.num_v_heads, h.head_k_dim, h.head_v_dim, h.conv_kernel),
                 rotary=[inv_freq(cfg.rope_theta, cfg.rope_scaling, h.rotary_dim,
                                  cfg.max_position_embeddings)])
    moe_layers = _hf_moe_layers(name, hf)
    theirs |= dict(kv_heads=hf.num_key_value_heads, bias=(hf.attention_bias,) * 2,
                   layer_types=tuple(hf.layer_types), moe_layers=moe_layers,
                   linear=(hf.linear_num_key_heads, hf.linear_num_value_heads,
                           hf.linear_key_head_dim, hf.linear_value_head_dim,
                           hf.linear_conv_kernel_dim),
                   rotary=[_hf_rotary(rotary, None)])
    if moe_layers:
        ours |= dict(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                     moe_inter=cfg.moe_intermediate_size, norm=cfg.norm_topk_prob,
                     shared_inter=h.shared_expert_intermediate_size)
        theirs |= dict(experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                       moe_inter=hf.moe_intermediate_size,
                       norm=name == "Qwen3_5MoeTextConfig" or hf.norm_topk_prob,
                       shared_inter=hf.shared_expert_intermediate_size)
    if len(moe_layers) < cfg.num_hidden_layers:        # some layer has the dense MLP
        ours["inter"], theirs["inter"] = cfg.intermediate_size, hf.intermediate_size
    return ours, theirs


_V4_SAME = ("q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
            "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
            "scoring_func", "routed_scaling_factor", "swiglu_limit")


def _hf_moe_layers(name: str, hf) -> tuple[int, ...]:
    layers = range(hf.num_hidden_layers)
    if name == "Qwen3NextConfig":        # Qwen3NextDecoderLayer's rule
        return tuple(i for i in layers if i not in hf.mlp_only_layers and hf.num_experts > 0
                     and (i + 1) % hf.decoder_sparse_step == 0)
    return tuple(layers) if name == "Qwen3_5MoeTextConfig" else ()


def _v4_rotary(spec) -> tuple[torch.Tensor, float]:
    rotary = V4Rotary(spec)
    rotary.build(torch.device("cpu"))
    return rotary.inv_freq, rotary.factor


def _hf_rotary(rotary, label: str | None) -> tuple[torch.Tensor, float]:
    prefix = f"{label}_" if label else ""
    scaling = getattr(rotary, f"{prefix}attention_scaling")
    return getattr(rotary, f"{prefix}inv_freq"), float(scaling)


def _assert_agrees_with_hf(name: str, raw: dict) -> None:
    ours, theirs = _views(name, raw)
    ours_rotary, theirs_rotary = ours.pop("rotary"), theirs.pop("rotary")
    assert ours == theirs
    for (freqs, factor), (hf_freqs, hf_factor) in zip(ours_rotary, theirs_rotary, strict=True):
        assert freqs.shape == hf_freqs.shape
        torch.testing.assert_close(freqs, hf_freqs, rtol=1e-6, atol=0)
        assert factor == pytest.approx(hf_factor, rel=1e-6)


@pytest.mark.parametrize("name", list(CLASSES))
def test_every_field_is_classified(name):
    TABLE.check_classified(name)


@pytest.mark.parametrize("name,field", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_field_is_honoured_refused_or_inert(name, field):
    """As in tests/models/test_config_fields.py; and what graphcp reads with another value of a field
    it reads, or of an inert field transformers accepts, transformers reads too."""
    raw = TABLE.check_field(name, field)
    if raw is None or field in ("quantization_config", "expert_dtype"):
        return      # refused, or quantization (tests/test_fp8*.py, tests/models/test_deepseek_v4.py)
    if TABLE.kind(name, field) == "inert":
        try:
            _hf(name, raw)
        except (ValueError, TypeError, KeyError):
            return          # transformers refuses a perturbed bookkeeping value; nothing to match
    _assert_agrees_with_hf(name, raw)


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_dropped_field_reads_as_transformers_default(name):
    TABLE.check_dropped(name)


ROPES = {   # config.json rotaries, in the spellings transformers standardizes
    V4: [{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},   # original: the context
         {"rope_parameters": {"rope_type": "yarn", "factor": None,
                              "original_max_position_embeddings": 512}},  # factor: the ratio
         {"rope_parameters": dict(YARN), "original_max_position_embeddings": 64},
         {"rope_parameters": {"main": {"rope_type": "default", "partial_rotary_factor": 0.5},
                              "compress": {"rope_type": "yarn", "factor": 2.0,
                                           "partial_rotary_factor": 0.25}},
          "rope_theta": 5e4},                     # nested without a theta: the top-level one
         {"rope_parameters": {"main": {"rope_type": "default"},
                              "compress": {"rope_type": "default", "rope_theta": 1e5}},
          "partial_rotary_factor": 0.5},          # nested without a factor: the top-level one
         {"rope_parameters": NESTED, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                      "beta_fast": 16}}],    # legacy wins
    **{c: [{"rope_scaling": {"rope_type": "yarn", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 3.0}},      # legacy wins
           {"rope_parameters": {"rope_type": "yarn", "factor": 2.0},
            "original_max_position_embeddings": 64},                          # the top level wins
           {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5},
            "partial_rotary_factor": 0.25},                                   # its own factor wins
           {"rope_parameters": None, "rope_theta": 5e5, "partial_rotary_factor": 0.5},
           {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [1, 1, 2], "mrope_interleaved": True}}]
       for c in HYBRID},
}
ROPE_CASES = [(name, i) for name, ropes in ROPES.items() for i in range(len(ropes))]


@pytest.mark.parametrize("name,i", ROPE_CASES, ids=[f"{n}-{i}" for n, i in ROPE_CASES])
def test_rotaries_are_transformers(name, i):
    raw = {k: v for k, v in TABLE.base(name).items() if k not in ("rope_parameters",)}
    raw = {k: v for k, v in {**raw, **copy.deepcopy(ROPES[name][i])}.items()
           if v is not None and v != DROP}
    _assert_agrees_with_hf(name, raw)


@pytest.mark.parametrize("rope,field", [
    # transformers builds the two nested rotaries with different factors (1.0, then the default):
    # a shape error when it initializes the model
    ({"main": {"rope_type": "default"}, "compress": {"rope_type": "default"}},
     "partial_rotary_factor"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "factor"),   # HF: KeyError
    ({"rope_type": "longrope", "factor": 2.0}, "longrope"),      # graphcp runs default and yarn
])
def test_v4_rotaries_graphcp_cannot_serve_are_refused(rope, field):
    raw = {k: v for k, v in TABLE.base(V4).items() if k != "partial_rotary_factor"}
    with pytest.raises(ConfigError, match=field):
        read(dict(raw, rope_parameters=rope))

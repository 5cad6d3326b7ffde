"""Every config field of the dense, Qwen3-MoE and MLA families, classified and checked against
graphcp's reader (the machinery and the kinds of field: tests/testkit/config_fields.py).

The fields are the ``to_dict()`` keys of transformers' config classes plus the released config.json
fields those classes do not declare (DeepSeek's ``scoring_func``, GLM-5.2's schedule, ...).
"""
from __future__ import annotations

import pytest
from testkit.config_fields import DROP, INERT, FieldTable, hf_config, read

CLASSES = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
           "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
           "Qwen3MoeConfig": "Qwen3MoeForCausalLM", "DeepseekV32Config": "DeepseekV32ForCausalLM",
           "GlmMoeDsaConfig": "GlmMoeDsaForCausalLM", "DeepseekV3Config": "DeepseekV3ForCausalLM"}
DSA = ("DeepseekV32Config", "GlmMoeDsaConfig")
MLA = DSA + ("DeepseekV3Config",)
DENSE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
TINY = {"Qwen3Config": dict(DENSE, head_dim=32),
        "Qwen3MoeConfig": dict(DENSE, head_dim=32, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32),
        **{c: dict(DENSE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                   qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, index_topk=8,
                   index_head_dim=32, index_n_heads=4, n_group=1, topk_group=1) for c in DSA},
        "DeepseekV3Config": dict(DENSE, num_key_value_heads=4, moe_intermediate_size=32,
                                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                 kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                                 v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=1,
                                 first_k_dense_replace=1)}

INERT_FOR = {   # inert for these classes only: transformers' model ignores the field there
    "head_dim": (MLA, "HF overwrites it with qk_rope_head_dim"),
    "qk_head_dim": (MLA, "HF recomputes it as qk_nope_head_dim + qk_rope_head_dim"),
    "mlp_bias": (MLA, "HF's DeepSeek MLPs have no biases"),
    "mlp_layer_types": (("DeepseekV3Config",), "DeepSeek-V3 reads first_k_dense_replace only"),
    "index_topk_freq": (("DeepseekV32Config",), "V3.2 runs its indexer on every layer"),
    "index_skip_topk_offset": (("DeepseekV32Config",), "V3.2 runs its indexer on every layer"),
    "index_topk_pattern": (("DeepseekV32Config",), "V3.2 runs its indexer on every layer"),
}
FIXED = {"scoring_func": ("sigmoid", "softmax"), "topk_method": ("noaux_tc", "greedy"),
         "moe_layer_freq": (1, 2), "moe_router_dtype": ("float32", "bfloat16")}
FIXED_FOR = {"indexer_rope_interleave": {"DeepseekV32Config": (False, True),
                                         "GlmMoeDsaConfig": (True, False)},
             "rope_interleave": {c: (True, False) for c in DSA}}     # DeepSeek-V3 reads it
NO_WINDOW = dict(layer_types=None, sliding_window=64, use_sliding_window=True, max_window_layers=1)
FREE_LAYERS = dict(mlp_layer_types=None, layer_types=None, indexer_types=None)
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
# field -> (context patch, another value)
ALT = {
    "architectures": ({}, None),          # per class: OTHER_ARCH
    "model_type": ({}, None),             # per class: OTHER_ARCH's model type
    "vocab_size": ({}, 300), "hidden_size": ({}, 128), "intermediate_size": ({}, 128),
    "num_hidden_layers": (FREE_LAYERS, 3), "num_attention_heads": ({}, 8),
    "num_key_value_heads": ({}, 1), "head_dim": ({}, 8), "hidden_act": ({}, "gelu"),
    "rms_norm_eps": ({}, 1e-3), "max_position_embeddings": ({}, 4096),
    "tie_word_embeddings": ({}, True), "attention_bias": ({}, True), "mlp_bias": ({}, True),
    "rope_parameters": ({}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    "rope_scaling": ({}, {"rope_type": "linear", "factor": 2.0}),
    "rope_theta": ({"rope_parameters": None}, 5e5),
    "partial_rotary_factor": ({"rope_parameters": dict(YARN)}, 0.5),
    "original_max_position_embeddings": ({"rope_parameters": dict(YARN)}, 64),
    "quantization_config": ({}, FP8),
    "sliding_window": ({"use_sliding_window": True, "sliding_window": 32,
                        "layer_types": ["sliding_attention", "full_attention"]}, 64),
    "use_sliding_window": (dict(NO_WINDOW, use_sliding_window=False), True),
    "max_window_layers": (dict(NO_WINDOW, max_window_layers=2), 1),
    "layer_types": ({"sliding_window": 64, "use_sliding_window": True},
                    ["sliding_attention", "full_attention"]),
    "decoder_sparse_step": ({}, 2), "mlp_only_layers": ({}, [0]),
    "moe_intermediate_size": ({}, 64), "norm_topk_prob": ({}, "flip"),
    "num_experts_per_tok": ({}, 1), "num_local_experts": ({}, 8),
    "num_experts": ({"num_local_experts": DROP}, 8),     # transformers 5's name wins over it
    "first_k_dense_replace": ({"mlp_layer_types": None}, 0),
    "mlp_layer_types": ({}, ["sparse", "sparse"]), "index_head_dim": ({}, 64),
    "index_n_heads": ({}, 8), "index_topk": ({}, 16), "kv_lora_rank": ({}, 64),
    "q_lora_rank": ({}, 64), "rope_interleave": ({}, False), "qk_nope_head_dim": ({}, 32),
    "qk_rope_head_dim": ({}, 8),
    "v_head_dim": ({}, 32), "n_group": ({}, 2), "topk_group": ({}, 2),
    "n_routed_experts": ({}, 16), "n_shared_experts": ({}, 2), "routed_scaling_factor": ({}, 1.5),
    "indexer_types": ({}, ["full", "shared"]),
    "index_topk_freq": ({"indexer_types": None, "index_skip_topk_offset": 1}, 2),
    "index_skip_topk_offset": ({"indexer_types": None, "index_topk_freq": 2}, 1),
    "index_topk_pattern": ({"indexer_types": None}, "FS"),
}
OTHER_ARCH = {"LlamaConfig": "MistralForCausalLM", "MistralConfig": "LlamaForCausalLM",
              "Qwen2Config": "Qwen3ForCausalLM", "Qwen3Config": "Qwen2ForCausalLM",
              "Qwen3MoeConfig": "Qwen3ForCausalLM", "DeepseekV32Config": "GlmMoeDsaForCausalLM",
              "GlmMoeDsaConfig": "DeepseekV32ForCausalLM",
              "DeepseekV3Config": "DeepseekV32ForCausalLM"}
# Released config.json fields the classes do not declare, per class.
DENSE_EXTRAS = ["rope_scaling", "rope_theta", "partial_rotary_factor",
                "original_max_position_embeddings", "torch_dtype", "quantization_config"]
DSA_EXTRAS = DENSE_EXTRAS + list(FIXED) + [
    "indexer_rope_interleave", "num_nextn_predict_layers", "ep_size", "aux_loss_alpha", "seq_aux",
    "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern",
    "index_share_for_mtp_iteration"]
# DeepSeek-V3 / R1 and Kimi-K2 as released (tests/testkit/mla_checkpoint.py has their config.json files).
V3_EXTRAS = DENSE_EXTRAS + ["scoring_func", "topk_method", "moe_layer_freq", "ep_size",
                            "aux_loss_alpha", "seq_aux", "auto_map"]
EXTRAS = {c: DSA_EXTRAS if c in DSA else V3_EXTRAS if c == "DeepseekV3Config"
          else DENSE_EXTRAS + (["num_experts"] if "Moe" in c else []) for c in CLASSES}

TABLE = FieldTable(classes=CLASSES, tiny={c: TINY.get(c, DENSE) for c in CLASSES}, extras=EXTRAS,
                   other_arch=OTHER_ARCH, inert=INERT, fixed=FIXED, alt=ALT,
                   inert_for=INERT_FOR, fixed_for=FIXED_FOR)
CASES = TABLE.cases()


@pytest.mark.parametrize("name", list(CLASSES))
def test_every_field_is_classified(name):
    TABLE.check_classified(name)


@pytest.mark.parametrize("name,field", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_field_is_honoured_refused_or_inert(name, field):
    TABLE.check_field(name, field)


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_dropped_field_reads_as_transformers_default(name):
    TABLE.check_dropped(name)


def test_mla_norm_epsilons_are_hfs():
    """MLA's q_a / kv_a norms and the indexer's k_norm use transformers' fixed 1e-6, not
    rms_norm_eps, in the DSA models and DeepSeek-V3; graphcp's too."""
    import importlib

    import torch

    from graphcp.models.deepseek.attention import MLAttention
    for name, module in (("DeepseekV32Config", "deepseek_v32"), ("GlmMoeDsaConfig", "glm_moe_dsa"),
                         ("DeepseekV3Config", "deepseek_v3")):
        config = hf_config(name, **dict(TINY[name], rms_norm_eps=1e-2))
        attn_class = name.replace("Config", "Attention")
        theirs = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                         attn_class)(config, 0)
        with torch.device("meta"):
            ours = MLAttention(read(TABLE.base(name) | {"rms_norm_eps": 1e-2}), 0)
        assert ours.q_a_layernorm.eps == theirs.q_a_layernorm.variance_epsilon == 1e-6
        assert ours.kv_a_layernorm.eps == theirs.kv_a_layernorm.variance_epsilon == 1e-6
        if name in DSA:
            assert ours.indexer.k_norm.eps == theirs.indexer.k_norm.eps == 1e-6
        else:
            assert ours.indexer is None

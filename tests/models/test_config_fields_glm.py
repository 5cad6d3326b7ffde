"""Every config field of GLM-4.5 / 4.6 / 4.7 (``Glm4MoeConfig``), classified and checked against
graphcp's reader (the machinery and the kinds of field: tests/testkit/config_fields.py), and what
graphcp reads also read by transformers: shapes, biases, q/k norm, dense and MoE layers, routing,
the MTP layer count and the partial rotary (inverse frequencies and attention factor from HF's own
rotary module). Then the compressed-tensors ``quantization_config`` of the FP8 releases: read, or
refused naming the field.

The fields are the ``to_dict()`` keys of transformers' class plus the released config.json keys it
folds in (``partial_rotary_factor``, ``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the
aliases it maps (``num_local_experts``, ``num_mtp_layers``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from testkit.config_fields import DROP, INERT, FieldTable, read
from testkit.glm_checkpoint import FP8_DYNAMIC

from graphcp import ConfigError
from graphcp.kernels.fp8_types import WHOLE_ROW
from graphcp.models.common.rope import inv_freq
from graphcp.models.glm4_moe.config import Glm4MoeConfig

NAME = "Glm4MoeConfig"
TINY = {NAME: dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=2048, moe_intermediate_size=32, n_routed_experts=8,
                   num_experts_per_tok=2)}
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
ALT = {   # field -> (context patch, another value)
    "architectures": ({}, None), "model_type": ({}, None),
    "vocab_size": ({}, 300), "hidden_size": ({}, 128), "intermediate_size": ({}, 128),
    "num_hidden_layers": ({}, 4), "num_attention_heads": ({}, 8), "num_key_value_heads": ({}, 1),
    "head_dim": ({}, 16), "hidden_act": ({}, "gelu"), "rms_norm_eps": ({}, 1e-3),
    "max_position_embeddings": ({}, 4096), "tie_word_embeddings": ({}, True),
    "attention_bias": ({}, True), "use_qk_norm": ({}, True),
    "rope_parameters": ({}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                             "partial_rotary_factor": 0.25}),
    "rope_scaling": ({}, {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
    "rope_theta": ({"rope_parameters": None}, 5e5),
    "partial_rotary_factor": ({"rope_parameters": None}, 0.25),
    "original_max_position_embeddings": ({"rope_parameters": dict(YARN)}, 64),
    "quantization_config": ({}, FP8_DYNAMIC),
    "moe_intermediate_size": ({}, 64), "n_routed_experts": ({}, 16),
    "num_local_experts": ({"n_routed_experts": DROP}, 16), "num_experts_per_tok": ({}, 1),
    "n_shared_experts": ({}, 2), "routed_scaling_factor": ({}, 2.5), "n_group": ({}, 2),
    "topk_group": ({"n_group": 4}, 2), "first_k_dense_replace": ({}, 2),
    "norm_topk_prob": ({}, "flip"), "num_nextn_predict_layers": ({}, 2),
    "num_mtp_layers": ({"num_nextn_predict_layers": DROP}, 3),
}
EXTRAS = {NAME: ["rope_scaling", "rope_theta", "partial_rotary_factor", "torch_dtype",
                 "original_max_position_embeddings", "quantization_config", "num_local_experts",
                 "num_mtp_layers"]}
TABLE = FieldTable(classes={NAME: "Glm4MoeForCausalLM"}, tiny=TINY, extras=EXTRAS,
                   other_arch={NAME: "Qwen3MoeForCausalLM"},
                   inert={k: v for k, v in INERT.items() if k != "num_nextn_predict_layers"},
                   fixed={}, alt=ALT)
CASES = TABLE.cases()


def _hf(raw: dict):
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
    config = transformers.Glm4MoeConfig.from_dict(copy.deepcopy(raw))
    return config, Glm4MoeRotaryEmbedding(config)


def _assert_agrees_with_hf(raw: dict) -> None:
    import transformers
    cfg, (hf, rotary) = read(raw), _hf(raw)
    glm = Glm4MoeConfig.of(cfg)
    with torch.device("meta"):
        layers = [type(layer.mlp).__name__ for layer in transformers.Glm4MoeModel(hf).layers]
    ours = dict(vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                heads=(cfg.num_attention_heads, cfg.num_key_value_heads), head_dim=cfg.head_dim,
                eps=cfg.rms_norm_eps, tie=cfg.tie_word_embeddings, bias=(cfg.qkv_bias, cfg.o_bias),
                qk_norm=cfg.qk_norm, inter=(cfg.intermediate_size, cfg.moe_intermediate_size),
                moe_layers=cfg.moe_layers, experts=(cfg.num_experts, cfg.num_experts_per_tok),
                norm=cfg.norm_topk_prob, routing=tuple(vars(glm.routing).values()),
                mtp=glm.mtp_layers, positions=cfg.max_position_embeddings)
    theirs = dict(vocab=hf.vocab_size, hidden=hf.hidden_size, layers=hf.num_hidden_layers,
                  heads=(hf.num_attention_heads, hf.num_key_value_heads),
                  head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                  eps=hf.rms_norm_eps, tie=hf.tie_word_embeddings, bias=(hf.attention_bias, False),
                  qk_norm=hf.use_qk_norm, inter=(hf.intermediate_size, hf.moe_intermediate_size),
                  moe_layers=tuple(i for i, t in enumerate(layers) if t == "Glm4MoeMoE"),
                  experts=(hf.n_routed_experts, hf.num_experts_per_tok), norm=hf.norm_topk_prob,
                  routing=(hf.n_group, hf.topk_group, hf.routed_scaling_factor,
                           hf.n_shared_experts),
                  mtp=hf.num_nextn_predict_layers, positions=hf.max_position_embeddings)
    assert ours == theirs
    freqs = inv_freq(cfg.rope_theta, cfg.rope_scaling, glm.rotary_dim, cfg.max_position_embeddings)
    assert freqs[0].shape == rotary.inv_freq.shape
    torch.testing.assert_close(freqs[0], rotary.inv_freq, rtol=1e-6, atol=0)
    assert freqs[1] == pytest.approx(float(rotary.attention_scaling), rel=1e-6)


def test_every_field_is_classified():
    TABLE.check_classified(NAME)


@pytest.mark.parametrize("name,field", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_field_is_honoured_refused_or_inert(name, field):
    """As in tests/models/test_config_fields.py; and what graphcp reads with another value of a
    field it reads, or of an inert field transformers accepts, transformers reads too."""
    raw = TABLE.check_field(name, field)
    if raw is None or field == "quantization_config":
        return      # refused, or quantization (below and tests/models/test_glm4_moe.py)
    if TABLE.kind(name, field) == "inert":
        try:
            _hf(raw)
        except (ValueError, TypeError, KeyError):
            return          # transformers refuses a perturbed bookkeeping value
    _assert_agrees_with_hf(raw)


def test_a_dropped_field_reads_as_transformers_default():
    TABLE.check_dropped(NAME)


ROPES = [   # config.json rotaries, in the spellings transformers standardizes
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0},
     "rope_parameters": {"rope_type": "linear", "factor": 3.0}},         # legacy wins
    {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.25},
     "original_max_position_embeddings": 64},                             # the top level wins
    {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25},
     "partial_rotary_factor": 0.75},                                      # its own factor wins
    {"rope_parameters": None, "rope_theta": 1e6, "partial_rotary_factor": 0.5},   # as released
    {"rope_parameters": None, "rope_theta": 1e6},                 # GLM's default factor, 0.5
    {"rope_parameters": None, "partial_rotary_factor": None},     # none: the whole head
    {"rope_parameters": {"rope_type": "proportional", "partial_rotary_factor": 0.5}},
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
]


@pytest.mark.parametrize("i", range(len(ROPES)))
def test_rotaries_are_transformers(i):
    raw = {k: v for k, v in TABLE.base(NAME).items() if k != "rope_parameters"}
    raw = {k: v for k, v in {**raw, **copy.deepcopy(ROPES[i])}.items()
           if v is not None or k == "partial_rotary_factor"}
    _assert_agrees_with_hf(raw)


def _quant(**patch) -> dict:
    quant = copy.deepcopy(FP8_DYNAMIC)
    group = quant["config_groups"]["group_0"]
    for key, value in patch.items():
        where, _, field = key.partition("__")
        target = quant if where == "top" else group if where == "group" else group[where]
        target[field] = value
    return quant


def test_compressed_tensors_as_read():
    """Per channel: one scale per row (a K block wider than any row); per block: its blocks."""
    cfg = read(dict(TABLE.base(NAME), quantization_config=FP8_DYNAMIC))
    assert (cfg.fp8_block, cfg.fp8_format) == ((1, WHOLE_ROW), "compressed-tensors")
    assert cfg.fp8_skip == ("lm_head", "re:.*mlp.gate$")
    block = _quant(weights__strategy="block", weights__block_structure=[128, 128],
                   input_activations__strategy="group", input_activations__group_size=128)
    assert read(dict(TABLE.base(NAME), quantization_config=block)).fp8_block == (128, 128)
    weight_only = _quant(group__input_activations=None)
    assert read(dict(TABLE.base(NAME), quantization_config=weight_only)).fp8_block[0] == 1


@pytest.mark.parametrize("patch,named", [
    (dict(top__format="pack-quantized"), "format"),
    (dict(top__quantization_status="frozen"), "quantization_status"),
    (dict(top__kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (dict(top__unknown_knob=1), "unknown_knob"),
    (dict(group__targets=["Linear", "Embedding"]), "targets"),
    (dict(weights__num_bits=4, weights__type="int"), "weights"),
    (dict(weights__strategy="tensor"), "weights.strategy"),
    (dict(weights__strategy="group", weights__group_size=128), "weights.strategy"),
    (dict(input_activations__dynamic=False), "input_activations.dynamic"),
    (dict(input_activations__strategy="tensor"), "input_activations.strategy"),
    (dict(top__ignore="lm_head"), "ignore"),
])
def test_compressed_tensors_refused(patch, named):
    with pytest.raises(ConfigError, match=f"quantization_config.*{named}"):
        read(dict(TABLE.base(NAME), quantization_config=_quant(**patch)))

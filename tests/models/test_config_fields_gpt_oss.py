"""Every config field of gpt-oss, classified and checked against graphcp's reader (the machinery:
tests/testkit/config_fields.py); the released gpt-oss-20b and 120b config.json files read as
transformers reads them (the schedule, MXFP4 experts, YaRN: inverse frequencies and attention
factor from HF's own rotary module); a quantization_config that leaves some experts unconverted,
as transformers' MXFP4 integration decides it."""
from __future__ import annotations

import json
import os

import pytest
import torch
from testkit.config_fields import DROP, INERT, FieldTable, hf_config, read
from testkit.paths import REPO

from graphcp import ConfigError
from graphcp.models.common.rope import inv_freq
from graphcp.models.gpt_oss.config import GptOssConfig

NAME = "GptOssConfig"
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=2048)
HF_IGNORES = {
    "hidden_act": "HF's experts run their clamped SwiGLU whatever hidden_act names",
    "experts_per_token": "transformers reads num_experts_per_tok",
    "initial_context_length": "transformers reads the rope parameters' original context",
}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
ALT = {
    "architectures": ({}, None), "model_type": ({}, None),
    "vocab_size": ({}, 300), "hidden_size": ({}, 128), "intermediate_size": ({}, 128),
    "num_hidden_layers": ({"layer_types": None}, 3), "num_attention_heads": ({}, 8),
    "num_key_value_heads": ({}, 1), "head_dim": ({}, 8), "rms_norm_eps": ({}, 1e-3),
    "max_position_embeddings": ({}, 4096), "tie_word_embeddings": ({}, True),
    "attention_bias": ({}, "flip"),
    "rope_parameters": ({}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    "rope_scaling": ({}, {"rope_type": "yarn", "factor": 4.0, "truncate": True,
                          "original_max_position_embeddings": 512}),
    "rope_theta": ({"rope_parameters": None}, 5e5),
    "quantization_config": ({}, MXFP4),
    "sliding_window": ({}, 64), "layer_types": ({}, ["full_attention", "sliding_attention"]),
    "num_experts_per_tok": ({}, 1), "num_local_experts": ({}, 8),
    "num_experts": ({"num_local_experts": DROP}, 8),
    "swiglu_limit": ({}, 3.0), "swiglu_alpha": ({}, 1.5),
}
TABLE = FieldTable(classes={NAME: "GptOssForCausalLM"}, tiny={NAME: TINY},
                   extras={NAME: ["rope_scaling", "rope_theta", "quantization_config",
                                  "num_experts", "torch_dtype", *HF_IGNORES]},
                   other_arch={NAME: "Qwen3MoeForCausalLM"},
                   inert={**INERT, **HF_IGNORES}, fixed={}, alt=ALT)
CASES = TABLE.cases()


def _release(name: str) -> dict:
    with open(os.path.join(REPO, "docs", "configs", name, "config.json")) as f:
        return json.load(f)


def test_every_field_is_classified():
    TABLE.check_classified(NAME)


@pytest.mark.parametrize("name,field", CASES, ids=[f for _, f in CASES])
def test_field_is_honoured_refused_or_inert(name, field):
    TABLE.check_field(name, field)


def test_a_dropped_field_reads_as_transformers_default():
    TABLE.check_dropped(NAME)


@pytest.mark.parametrize("release,layers,experts", [("gpt-oss-20b", 24, 32),
                                                    ("gpt-oss-120b", 36, 128)])
def test_the_releases_read_as_transformers_reads_them(release, layers, experts):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    raw = _release(release)
    cfg = read(raw)
    family = GptOssConfig.of(cfg)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (layers, experts, 4)
    assert cfg.moe_layers == family.mxfp4_layers == tuple(range(layers))
    assert family.layer_types == tuple(raw["layer_types"]) and cfg.sliding_window == 128
    assert (family.swiglu_limit, family.swiglu_alpha) == (7.0, 1.702)
    assert cfg.qkv_bias and cfg.o_bias and cfg.head_dim == 64 and cfg.moe_intermediate_size == 2880
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    hf = hf_config(NAME, **{k: v for k, v in raw.items() if k != "quantization_config"})
    rotary = GptOssRotaryEmbedding(hf)
    ours, factor = inv_freq(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim,
                            cfg.max_position_embeddings)
    assert torch.equal(ours, rotary.inv_freq) and factor == rotary.attention_scaling
    assert cfg.max_positions == 131072


def test_modules_to_not_convert_as_transformers_decides():
    """Entries match from the start up to a module boundary, as patterns, or as suffixes."""
    from transformers.quantizers.quantizers_utils import should_convert_module
    raw = dict(_release("gpt-oss-20b"), num_hidden_layers=12)
    raw["layer_types"] = raw["layer_types"][:12]
    for skip in (["model.layers.1.mlp.experts"], ["model.layers.1"], ["model.layers.1*.mlp"],
                 ["layers.3.mlp.experts"], ["experts"], ["model.layers.*.self_attn", "lm_head"]):
        quant = {"quant_method": "mxfp4", "modules_to_not_convert": skip}
        ours = GptOssConfig.of(read(dict(raw, quantization_config=quant))).mxfp4_layers
        theirs = tuple(i for i in range(12)
                       if should_convert_module(f"model.layers.{i}.mlp.experts", skip))
        assert ours == theirs, skip


@pytest.mark.parametrize("patch,field", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quant_method"),
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["("]}},
     "modules_to_not_convert"),
    ({"intermediate_size": 48}, "intermediate_size"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"swiglu_limit": 0}, "swiglu_limit"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_what_graphcp_cannot_serve_is_refused_by_name(patch, field):
    raw = {**TABLE.base(NAME), "quantization_config": MXFP4, **patch}
    with pytest.raises(ConfigError, match=field):
        read(raw)

"""Every config field of the supported families, classified and checked against graphcp's reader.

The fields are the ``to_dict()`` keys of transformers' config classes plus the released config.json
fields those classes do not declare (DeepSeek's ``scoring_func``, GLM-5.2's schedule, ...). Each is
one of:
- read: ``ALT`` gives another value (after a context patch); graphcp's ModelConfig changes, or the
  value is refused with a ConfigError naming the field. Dropped from config.json, the field reads
  as transformers' default for that class (or graphcp requires it, naming it).
- fixed: transformers runs one value; graphcp accepts it and refuses any other, naming the field.
- inert: cannot change prefill numerics (the reason is given); another value changes nothing.
A field transformers adds and nobody classified fails ``test_every_field_is_classified``.
"""
from __future__ import annotations

import copy
import functools

import pytest

from graphcp import ConfigError
from graphcp.models.config import _from_raw

CLASSES = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
           "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
           "Qwen3MoeConfig": "Qwen3MoeForCausalLM", "DeepseekV32Config": "DeepseekV32ForCausalLM",
           "GlmMoeDsaConfig": "GlmMoeDsaForCausalLM"}
DSA = ("DeepseekV32Config", "GlmMoeDsaConfig")
DENSE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
TINY = {"Qwen3Config": dict(DENSE, head_dim=32),
        "Qwen3MoeConfig": dict(DENSE, head_dim=32, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32),
        **{c: dict(DENSE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                   qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, index_topk=8,
                   index_head_dim=32, index_n_heads=4, n_group=1, topk_group=1) for c in DSA}}

INERT = {
    "_name_or_path": "where the checkpoint was loaded from",
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "the storage dtype; the compute dtype is --dtype (weights are cast on load)",
    "dtype": "the storage dtype; the compute dtype is --dtype (weights are cast on load)",
    "attention_dropout": "dropout runs in training only",
    "initializer_range": "random initialization only",
    "bos_token_id": "tokenizer / generation", "eos_token_id": "tokenizer / generation",
    "pad_token_id": "the embedding's padding_idx only masks gradients",
    "chunk_size_feed_forward": "these models never chunk their feed-forward",
    "id2label": "classification heads", "label2id": "classification heads",
    "problem_type": "classification heads",
    "is_encoder_decoder": "generation utilities; these models are decoder-only either way",
    "output_attentions": "what HF returns", "output_hidden_states": "what HF returns",
    "return_dict": "what HF returns", "use_cache": "HF's decode cache; graphcp always caches",
    "pretraining_tp": "transformers 5 no longer reads it (Llama)",
    "output_router_logits": "the router's training loss", "router_aux_loss_coef": "training loss",
    "aux_loss_alpha": "training loss", "seq_aux": "training loss",
    "ep_size": "a deployment hint; graphcp's expert parallelism is --ep",
    "num_nextn_predict_layers": "the MTP draft layers are not part of the prefill forward; "
                                "their weights are skipped",
    "index_share_for_mtp_iteration": "the MTP layers' indexer",
}
INERT_FOR = {   # inert for these classes only: transformers' model ignores the field there
    "head_dim": (DSA, "HF overwrites it with qk_rope_head_dim"),
    "qk_head_dim": (DSA, "HF recomputes it as qk_nope_head_dim + qk_rope_head_dim"),
    "mlp_bias": (DSA, "HF's DSA MLPs have no biases"),
    "index_topk_freq": (("DeepseekV32Config",), "V3.2 runs its indexer on every layer"),
    "index_skip_topk_offset": (("DeepseekV32Config",), "V3.2 runs its indexer on every layer"),
    "index_topk_pattern": (("DeepseekV32Config",), "V3.2 runs its indexer on every layer"),
}
FIXED = {"scoring_func": ("sigmoid", "softmax"), "topk_method": ("noaux_tc", "greedy"),
         "moe_layer_freq": (1, 2), "moe_router_dtype": ("float32", "bfloat16"),
         "rope_interleave": (True, False)}
FIXED_FOR = {"indexer_rope_interleave": {"DeepseekV32Config": (False, True),
                                         "GlmMoeDsaConfig": (True, False)}}
DROP = "<drop>"            # in a context patch: leave the field out of config.json
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
    "sliding_window": ({"layer_types": ["sliding_attention", "full_attention"]}, 64),
    "use_sliding_window": (dict(NO_WINDOW, use_sliding_window=False), True),
    "max_window_layers": (dict(NO_WINDOW, max_window_layers=2), 1),
    "layer_types": ({"sliding_window": 64}, ["sliding_attention", "full_attention"]),
    "decoder_sparse_step": ({}, 2), "mlp_only_layers": ({}, [0]),
    "moe_intermediate_size": ({}, 64), "norm_topk_prob": ({}, "flip"),
    "num_experts_per_tok": ({}, 1), "num_local_experts": ({}, 8),
    "num_experts": ({"num_local_experts": DROP}, 8),     # transformers 5's name wins over it
    "first_k_dense_replace": ({"mlp_layer_types": None}, 0),
    "mlp_layer_types": ({}, ["sparse", "sparse"]), "index_head_dim": ({}, 64),
    "index_n_heads": ({}, 8), "index_topk": ({}, 16), "kv_lora_rank": ({}, 64),
    "q_lora_rank": ({}, 64), "qk_nope_head_dim": ({}, 32), "qk_rope_head_dim": ({}, 8),
    "v_head_dim": ({}, 32), "n_group": ({}, 2), "topk_group": ({}, 2),
    "n_routed_experts": ({}, 16), "n_shared_experts": ({}, 2), "routed_scaling_factor": ({}, 1.5),
    "indexer_types": ({}, ["full", "shared"]),
    "index_topk_freq": ({"indexer_types": None, "index_skip_topk_offset": 1}, 2),
    "index_skip_topk_offset": ({"indexer_types": None, "index_topk_freq": 2}, 1),
    "index_topk_pattern": ({"indexer_types": None}, "FS"),
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "GlmMoeDsaForCausalLM": "glm_moe_dsa", "DeepseekV32ForCausalLM": "deepseek_v32"}
OTHER_ARCH = {"LlamaConfig": "MistralForCausalLM", "MistralConfig": "LlamaForCausalLM",
              "Qwen2Config": "Qwen3ForCausalLM", "Qwen3Config": "Qwen2ForCausalLM",
              "Qwen3MoeConfig": "Qwen3ForCausalLM", "DeepseekV32Config": "GlmMoeDsaForCausalLM",
              "GlmMoeDsaConfig": "DeepseekV32ForCausalLM"}
# Released config.json fields the classes do not declare, per class.
DENSE_EXTRAS = ["rope_scaling", "rope_theta", "partial_rotary_factor",
                "original_max_position_embeddings", "torch_dtype", "quantization_config"]
DSA_EXTRAS = DENSE_EXTRAS + list(FIXED) + [
    "indexer_rope_interleave", "num_nextn_predict_layers", "ep_size", "aux_loss_alpha", "seq_aux",
    "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern",
    "index_share_for_mtp_iteration"]
EXTRAS = {c: DSA_EXTRAS if c in DSA else DENSE_EXTRAS + (["num_experts"] if "Moe" in c else [])
          for c in CLASSES}


def _config(name: str, **kwargs):  # noqa: ANN202 - a transformers config
    import transformers
    return getattr(transformers, name)(**kwargs)


@functools.cache
def _tiny(name: str) -> dict:
    raw = _config(name, **TINY.get(name, DENSE)).to_dict()
    raw["architectures"] = [CLASSES[name]]
    return raw


def _base(name: str) -> dict:
    return copy.deepcopy(_tiny(name))


def _kind(name: str, field: str) -> str:
    if field in INERT or (field in INERT_FOR and name in INERT_FOR[field][0]):
        return "inert"
    if field in FIXED or (field in FIXED_FOR and name in FIXED_FOR[field]):
        return "fixed"
    return "read" if field in ALT else "unclassified"


def _fields(name: str) -> list[str]:
    return sorted(set(_base(name)) | set(EXTRAS[name]))


def _read(raw: dict):  # noqa: ANN202 - a ModelConfig
    return _from_raw(copy.deepcopy(raw), "config.json")


def _patched(raw: dict, patch: dict) -> dict:
    out = {**raw, **copy.deepcopy(patch)}
    return {k: v for k, v in out.items() if v != DROP and (v is not None or k in raw)}


CASES = [(name, field) for name in CLASSES for field in _fields(name)]


@pytest.mark.parametrize("name", list(CLASSES))
def test_every_field_is_classified(name):
    unclassified = [f for f in _fields(name) if _kind(name, f) == "unclassified"]
    assert not unclassified, f"{name}: classify {unclassified} in tests/test_config_fields.py"


@pytest.mark.parametrize("name,field", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_field_is_honoured_refused_or_inert(name, field):
    kind, base = _kind(name, field), _base(name)
    if kind == "inert":
        changed = dict(base, **{field: _perturbed(base.get(field))})
        assert _read(changed) == _read(base), f"{field} ({INERT.get(field)}) changed the model"
    elif kind == "fixed":
        accepted, refused = FIXED_FOR[field][name] if field in FIXED_FOR else FIXED[field]
        assert _read(dict(base, **{field: accepted})) == _read(base)
        with pytest.raises(ConfigError, match=field):
            _read(dict(base, **{field: refused}))
    else:
        patch, alt = ALT[field]
        if field == "architectures":
            alt = [OTHER_ARCH[name]]
        elif field == "model_type":
            alt = MODEL_TYPES[OTHER_ARCH[name]]
        elif alt == "flip":
            alt = not base[field]
        context = _patched(base, patch)
        before = _read(context)
        try:
            after = _read(dict(context, **{field: alt}))
        except ConfigError as e:
            assert field in str(e), f"{field}={alt!r} refused without naming it: {e}"
            return
        assert after != before, f"{field}={alt!r} did not change what graphcp reads"


def _perturbed(value):  # noqa: ANN001, ANN202
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-changed"
    return {"changed": 1} if isinstance(value, dict) else 7


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_dropped_field_reads_as_transformers_default(name):
    """Absent from config.json, a field graphcp reads means what transformers' class default
    means, or graphcp requires it and says which. (A default that does not fit the tiny config,
    such as 128 experts for top-8 of 4, is skipped.)"""
    import dataclasses
    import transformers
    defaults = {f.name: f.default for f in dataclasses.fields(getattr(transformers, name))
                if f.default is not dataclasses.MISSING}
    base = _base(name)
    wrong = []
    for field in sorted(set(base) & set(defaults)):
        if _kind(name, field) != "read" or field in ("architectures",):
            continue
        dropped = {k: v for k, v in base.items() if k != field}
        try:
            ours = _read(dropped)
        except ConfigError as e:
            assert field in str(e), f"{field} dropped: {e}"
            continue
        try:
            theirs = _read(dict(base, **{field: defaults[field]}))
        except ConfigError:
            continue
        if ours != theirs:
            wrong.append(field)
    assert not wrong, f"{name}: a dropped {wrong} does not read as transformers' default"


def test_mla_norm_epsilons_are_hfs():
    """MLA's q_a / kv_a norms and the indexer's k_norm use transformers' fixed 1e-6, not
    rms_norm_eps, in both DSA models; graphcp's too."""
    import importlib
    import torch
    from graphcp.models.mla import MLAttention
    for name, module in (("DeepseekV32Config", "deepseek_v32"), ("GlmMoeDsaConfig", "glm_moe_dsa")):
        config = _config(name, **dict(TINY[name], rms_norm_eps=1e-2))
        attn_class = name.replace("Config", "Attention")
        theirs = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                         attn_class)(config, 0)
        with torch.device("meta"):
            ours = MLAttention(_read(_base(name) | {"rms_norm_eps": 1e-2}), 0)
        assert ours.q_a_layernorm.eps == theirs.q_a_layernorm.variance_epsilon == 1e-6
        assert ours.kv_a_layernorm.eps == theirs.kv_a_layernorm.variance_epsilon == 1e-6
        assert ours.indexer.k_norm.eps == theirs.indexer.k_norm.eps == 1e-6

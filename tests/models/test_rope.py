"""Every rope type transformers applies to Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and the DSA
models, in both spellings (legacy ``rope_scaling`` and ``rope_parameters``): graphcp's cos/sin
tables equal HF's rotary module on the same config.json for every position graphcp serves, and
logits and caches equal HF end to end (one rank in two chunks, and CP 2 zigzag)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from testkit.hf_reference import make_checkpoint, rel_err
from testkit.parity import Session, random_ids

from graphcp import ConfigError
from graphcp.checkpoint.config import read_model_config
from graphcp.models.common.layers import RotaryEmbedding
from graphcp.models.deepseek.rope import DSARotary, softmax_scale
from graphcp.models.registry import config_from_dict

VOCAB = 211
TABLE_TOL = 1e-6
ARCHS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
         "qwen3_moe": "Qwen3Moe"}
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
DSA_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
                q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16,
                index_topk=8, index_head_dim=32, index_n_heads=4, n_group=1, topk_group=1,
                max_position_embeddings=2048)
QWEN3_CARD = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def _factors(dim: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (1 + 3 * torch.rand(dim // 2, generator=gen)).tolist()


def rope_cases(dim: int) -> dict[str, dict]:
    """config.json rope fields per case, spelled as released configs do (``dim``: rotary dim)."""
    return {
        "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        "default_legacy": {"rope_theta": 1e6, "rope_scaling": None},
        "linear_legacy_type": {"rope_theta": 1e5,
                               "rope_scaling": {"type": "linear", "factor": 2.5}},
        "dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4}},
        "yarn_qwen3_card": {"rope_theta": 1e6, "max_position_embeddings": 40960,
                            "rope_scaling": dict(QWEN3_CARD)},
        "yarn_deepseek_mscale": {"max_position_embeddings": 5120, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 40, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 128}},
        "yarn_untruncated_attention_factor": {"rope_parameters": {
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
            "beta_fast": 16, "beta_slow": 2, "truncate": False, "attention_factor": 0.9}},
        "yarn_null_factor": {"rope_parameters": {"rope_type": "yarn", "factor": None,
                                                 "original_max_position_embeddings": 512}},
        "longrope": {"max_position_embeddings": 1024, "rope_parameters": {
            "rope_type": "longrope", "factor": 8.0, "original_max_position_embeddings": 1024,
            "short_factor": _factors(dim, 1), "long_factor": _factors(dim, 2)}},
        "llama3": {"rope_theta": 5e5, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
        "proportional": {"rope_parameters": {"rope_type": "proportional", "factor": 2.0,
                                             "partial_rotary_factor": 0.5}},
        # rope_scaling replaces rope_parameters whole (its theta too): the top-level theta counts
        "both_spellings": {"rope_theta": 7e5,
                           "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                           "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        "top_level_original": {"original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}},
        "top_level_partial_default": {"partial_rotary_factor": 0.5,
                                      "rope_parameters": {"rope_type": "default"}},
    }


def _write_config(path: str, hf_config, rope: dict) -> str:
    """config.json as transformers writes it, its rope fields replaced by ``rope``'s spelling."""
    raw = hf_config.to_dict()
    raw.pop("rope_parameters", None)
    raw.update(json.loads(json.dumps(rope)))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return path


def _hf_rotary(path: str, rotary_class: str, module: str):
    import importlib

    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    rotary = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                     rotary_class)(config)
    return rotary, config


def _compare(rotary, graphcp_rotary, positions: int) -> float:
    pos = torch.arange(positions)[None]
    cos, sin = rotary(torch.zeros(1), pos)        # one call over the whole served range
    assert graphcp_rotary.cos.shape[0] == positions
    return max(rel_err(graphcp_rotary.cos, cos[0]), rel_err(graphcp_rotary.sin, sin[0]))


CASE_NAMES = list(rope_cases(16))


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_tables_equal_hf_rotary(tmp_path, arch, case):
    import transformers
    name = ARCHS[arch]
    kwargs = dict(TINY, head_dim=32) if arch in ("qwen3", "qwen3_moe") else dict(TINY)
    hf_config = getattr(transformers, f"{name}Config")(**kwargs)
    dim = kwargs.get("head_dim", 16)
    path = _write_config(str(tmp_path / case), hf_config, rope_cases(dim)[case])
    rotary, config = _hf_rotary(path, f"{name}RotaryEmbedding", arch)
    cfg = read_model_config(path)
    ours = RotaryEmbedding(cfg)
    ours.build(torch.device("cpu"))
    assert cfg.rope_theta == config.rope_parameters["rope_theta"]
    expected = 131072 if case == "yarn_qwen3_card" else config.max_position_embeddings
    assert cfg.max_positions == expected        # YaRN serves factor x its original context
    assert _compare(rotary, ours, cfg.max_positions) <= TABLE_TOL


@pytest.mark.parametrize("case", ["default", "linear_legacy_type", "dynamic", "llama3",
                                  "yarn_deepseek_mscale", "yarn_untruncated_attention_factor"])
@pytest.mark.parametrize("arch", ["DeepseekV32", "GlmMoeDsa", "DeepseekV3"])
def test_dsa_tables_and_softmax_scale_equal_hf(tmp_path, arch, case):
    """HF's MLA rotary modules (DSA and DeepSeek-V3) call the same rope functions; MLA's softmax
    scale takes mscale_all_dim^2."""
    import importlib

    import transformers
    module = {"DeepseekV32": "deepseek_v32", "GlmMoeDsa": "glm_moe_dsa",
              "DeepseekV3": "deepseek_v3"}[arch]
    hf_config = getattr(transformers, f"{arch}Config")(**DSA_TINY)
    path = _write_config(str(tmp_path / case), hf_config, rope_cases(16)[case])
    rotary, config = _hf_rotary(path, f"{arch}RotaryEmbedding", module)
    cfg = read_model_config(path)
    ours = DSARotary(cfg)
    ours.build(torch.device("cpu"))
    assert _compare(rotary, ours, cfg.max_positions) <= TABLE_TOL
    attention = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                        f"{arch}Attention")(config, 0)
    assert softmax_scale(cfg) == pytest.approx(attention.scaling, rel=1e-12)


def _raw(**rope) -> dict:
    return dict(architectures=["LlamaForCausalLM"], **TINY, **rope)


@pytest.mark.parametrize("rope,field", [
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                           "long_factor": [1.0] * 8, "original_max_position_embeddings": 512}),
     "rope_type 'longrope' with max_position_embeddings=2048"),
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 3,
                           "long_factor": [1.0] * 8}), "short_factor must list 8"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}, partial_rotary_factor=0.5),
     "partial_rotary_factor=0.5 with rope_type 'yarn'"),
    (dict(rope_scaling={"rope_type": "su", "factor": 2.0}), "rope_type 'su' is not supported"),
    (dict(rope_scaling={"type": "linear"}), "rope_type 'linear' needs factor"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     "needs high_freq_factor"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -2.0}), "factor=-2.0 must be a"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_theta='big'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}},
          layer_types=["full_attention"] * 2), "per-layer rope_parameters"),
    (dict(max_position_embeddings=64, rope_scaling={"rope_type": "yarn", "factor": 1e7,
                                                    "original_max_position_embeddings": 64}),
     "positions"),
])
def test_unsupported_rope_is_a_config_error(rope, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        config_from_dict({**_raw(), **rope}, "config.json")


def test_dynamic_serves_exactly_the_range_where_hf_is_fixed():
    """Past max_position_embeddings HF rescales per forward call; graphcp's context stops there."""
    cfg = config_from_dict(_raw(rope_parameters={"rope_type": "dynamic", "factor": 4.0}), "config.json")
    assert cfg.max_positions == 2048 and cfg.rope_scaling["rope_type"] == "dynamic"


# End to end: logits and (rotated) KV equal HF, each prompt in two chunks on one rank (the model
# card's YaRN through graphs of one bucket, the others eager to keep the suite fast), CP 2 zigzag.
E2E = {
    "qwen3_card_yarn": ("qwen3", dict(rope_theta=1e6, max_position_embeddings=40960,
                                      rope_scaling=dict(QWEN3_CARD)),
                        dict(cuda_graph_buckets=[256])),
    "qwen3_moe_yarn_mscale": ("qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "mscale": 1.0,
                         "mscale_all_dim": 0.5, "original_max_position_embeddings": 64}),
        dict(disable_cuda_graph=True)),
    "qwen2_longrope": ("qwen2", dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0, "short_factor": _factors(16, 3),
        "long_factor": _factors(16, 4), "original_max_position_embeddings": 512}),
        dict(disable_cuda_graph=True)),
}


@pytest.fixture(scope="module")
def e2e_checkpoints(ckpt_dir):
    return {name: make_checkpoint(str(ckpt_dir / f"rope-{name}"), family, seed=7, **kwargs)
            for name, (family, kwargs, _) in E2E.items()}


@pytest.mark.parametrize("name", list(E2E))
def test_two_chunk_prefill_matches_hf(e2e_checkpoints, engines, oracle, name):
    path = e2e_checkpoints[name]
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["rope_parameters"]["rope_type"] in ("yarn", "longrope")     # as HF saved it
    s = Session(engines.get(path, **E2E[name][2]), oracle, path)
    ids = random_ids(280, VOCAB, 11)
    out = s.run([("a", ids[:170]), ("b", random_ids(40, VOCAB, 12))])
    s.run([("a", ids[170:])])                        # the second chunk over a cached prefix
    assert out.mode == ("graph" if name == "qwen3_card_yarn" else "eager"), out.eager_reason
    print(f"{name}: worst rel err {s.worst:.2e}")
    s.release_all()


def test_qwen3_card_yarn_at_cp2_zigzag(e2e_checkpoints, engines, oracle):
    from testkit.engines import cp_kwargs
    path = e2e_checkpoints["qwen3_card_yarn"]
    engine = engines.get(path, **cp_kwargs(2, "zigzag"), disable_cuda_graph=True)
    s = Session(engine, oracle, path)
    out = s.run([("a", random_ids(150, VOCAB, 13)), ("b", random_ids(61, VOCAB, 14))])
    assert out.cp_applied
    print(f"cp2 zigzag yarn: worst rel err {s.worst:.2e}")
    s.release_all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_forms_are_bit_equal_to_hf(dtype):
    """The torch forms graphcp runs on CPU (RoPE in four ops from the rotated sin, head-major or
    not; fp32 RMSNorm by torch's fused op) give HF's values bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from graphcp.kernels.torch_layers import rms_norm_torch, rope_torch, rotated_sin
    gen = torch.Generator().manual_seed(7)
    t, h, d = 37, 6, 32
    x = (torch.randn(t, h, d, generator=gen) * 3).to(dtype)
    angles = torch.arange(t)[:, None] * torch.rand(d // 2, generator=gen)[None] * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    # HF's layout: [B, H, T, D] with cos/sin [B, T, D] unsqueezed at the head dim
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    hf = hf[0].transpose(0, 1)
    for head_major in (False, True):
        for rot in (None, rotated_sin(sin[:, None])):
            ours = rope_torch(x, cos[:, None], sin[:, None], head_major=head_major, rot_sin=rot)
            assert torch.equal(ours, hf)
            assert ours.transpose(0, 1).is_contiguous() == head_major
    norm = LlamaRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=gen))
    norm = norm.to(dtype)
    for rows in (x.reshape(-1, d), x[:, 1]):                  # contiguous and strided rows
        assert torch.equal(rms_norm_torch(rows, norm.weight, 1e-6), norm(rows))

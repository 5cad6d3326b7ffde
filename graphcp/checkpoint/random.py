"""Write a random-weight HF checkpoint (config.json + model.safetensors) with graphcp's own code.

The demo, the benchmarks and the GPU check use it, so nothing downloads weights and transformers is
not needed at run time. Names and config fields follow the HF Llama/Qwen3 conventions the loader reads.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

DEMO_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=4096, hidden_size=256,
                  intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu")

# The embedded MoE model (``--demo-model qwen3_moe``): Qwen3-MoE, 8 experts, top-2, every layer sparse.
DEMO_QWEN3_MOE = dict(DEMO_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

LLAMA_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=2048,
                intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, hidden_act="silu")

# The long-prompt benchmarks' model (``graphcp bench --scale``): tiny layers, 128K positions, so attention's
# quadratic work shows at lengths two CPU cores reach.
LONG_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=128,
                  intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, hidden_act="silu")


def make_random_checkpoint(path: str, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Create ``path`` once; an existing checkpoint with the same config is reused."""
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(cfg_path) and os.path.isfile(os.path.join(path, "model.safetensors")):
        with open(cfg_path) as f:
            if json.load(f) == config:
                return path
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], h), "model.norm.weight": ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q)})
        tensors.update(_ffn(config, p + "mlp.", rand))
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            tensors[p + "self_attn.q_norm.weight"] = ones(hd)
            tensors[p + "self_attn.k_norm.weight"] = ones(hd)
        if config["model_type"] == "qwen2":
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                tensors[p + f"self_attn.{name}_proj.bias"] = 0.02 * torch.randn(n, generator=gen).to(dtype)
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(config["vocab_size"], h)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def _ffn(config: dict, p: str, rand) -> dict:
    """A dense gated MLP, or (Qwen3-MoE layers, as HF picks them) a router and per-expert MLPs."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    layer = int(p.split(".")[2])
    sparse = config["model_type"] == "qwen3_moe" and layer not in config["mlp_only_layers"] \
        and (layer + 1) % config["decoder_sparse_step"] == 0
    if not sparse:
        return {p + "gate_proj.weight": rand(inter, h), p + "up_proj.weight": rand(inter, h),
                p + "down_proj.weight": rand(h, inter)}
    inter = config["moe_intermediate_size"]
    out = {p + "gate.weight": rand(config["num_experts"], h)}
    for e in range(config["num_experts"]):
        out.update({f"{p}experts.{e}.gate_proj.weight": rand(inter, h),
                    f"{p}experts.{e}.up_proj.weight": rand(inter, h),
                    f"{p}experts.{e}.down_proj.weight": rand(h, inter)})
    return out


def demo_checkpoint(model: str = "qwen3") -> str:
    """The embedded default model, generated once with seed 0: a small Qwen3-architecture checkpoint,
    or its Qwen3-MoE variant (``model="qwen3_moe"``)."""
    config = DEMO_QWEN3_MOE if model == "qwen3_moe" else DEMO_QWEN3
    return make_random_checkpoint(os.path.join(_cache_root(), f"demo-{model}-random"), config, seed=0)


def long_context_checkpoint() -> str:
    """The long-prompt benchmarks' 2-layer Llama (``LONG_LLAMA``), generated once with seed 0."""
    return make_random_checkpoint(os.path.join(_cache_root(), "long-llama-random"), LONG_LLAMA, seed=0)


def _cache_root() -> str:
    return os.environ.get("GRAPHCP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "graphcp"))

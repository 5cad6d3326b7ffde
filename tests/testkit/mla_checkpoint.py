"""Tiny DeepSeek-V3 and Kimi-K2 checkpoints written the way the releases are: the released
config.json with its sizes shrunk (every other field kept, legacy ``rope_scaling`` YaRN included),
sharded safetensors with the index file, FP8 block-quantized projection weights with their
``weight_scale_inv`` (experts named per expert, as released), and DeepSeek-V3's multi-token-
prediction layer after the last one. Beside each, the dequantized twin HF runs as the oracle
(``model_type: deepseek_v3``: transformers converts per-expert weights by model type, and it does
not know Kimi-K2's ``kimi_k2``)."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from testkit.fp8_checkpoint import dequantize_blocks, quantize_blocks
from testkit.hf_reference import CachedHF

_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
             "AutoModel": "modeling_deepseek.DeepseekV3Model",
             "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}
# deepseek-ai/DeepSeek-V3 (and R1) config.json as released.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": _AUTO_MAP, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": _FP8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280}
# moonshotai/Kimi-K2-Instruct config.json as released.
KIMI_K2 = {
    **DEEPSEEK_V3, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "model_type": "kimi_k2", "n_group": 1,
    "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1,
    "transformers_version": "4.48.3", "vocab_size": 163840}
# The sizes shrunk; n_group / topk_group, top-8 routing, YaRN and the rest stay as released.
SHRUNK = dict(vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)
BLOCK = (16, 16)                 # FP8 blocks shrunk with the weights
_NOT_FP8 = ("norm", "mlp.gate.", "embed_tokens", "lm_head")   # as the releases keep them
_HF_ONLY = ("architectures", "auto_map", "model_type", "torch_dtype", "transformers_version",
            "quantization_config")


def widen_init(model) -> None:
    """Widen the tiny random init, and give the router a non-zero correction bias it uses."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.ndim > 1 else p.uniform_(0.8, 1.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)


def write_release(path: str, release: dict, seed: int, fp8: bool = True,
                  **sizes) -> tuple[str, str]:
    """(the checkpoint, HF's dequantized twin) under ``path``; ``sizes`` override ``SHRUNK``."""
    import transformers
    raw = {**release, **SHRUNK, **sizes}
    if fp8:
        raw["quantization_config"] = {**_FP8, "weight_block_size": list(BLOCK)}
    else:
        raw.pop("quantization_config", None)
    config = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k not in _HF_ONLY})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.float32)
    widen_init(model)
    source, ckpt, twin = (os.path.join(path, n) for n in ("hf-save", "release", "oracle"))
    model.save_pretrained(source, safe_serialization=True, max_shard_size="200KB")
    for dst, quantize in ((ckpt, fp8), (twin, False)):
        shutil.copytree(source, dst)
        _rewrite_shards(dst, quantize)
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    twin_raw = {k: v for k, v in raw.items() if k not in ("auto_map", "quantization_config")}
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump({**twin_raw, "model_type": "deepseek_v3"}, f, indent=2)
    if raw["num_nextn_predict_layers"]:
        _add_mtp_layer(ckpt, raw, fp8)
    return ckpt, twin


def _rewrite_shards(path: str, quantize: bool) -> None:
    """FP8 (or FP8 rounded back to float32 for the twin) every projection weight of every shard;
    each scale joins its weight's shard in the index."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(path, shard))
        out = {}
        for name, w in tensors.items():
            if w.ndim != 2 or any(k in name for k in _NOT_FP8):
                out[name] = w
                continue
            q, scale = quantize_blocks(w, BLOCK)
            if quantize:
                out[name], out[name + "_scale_inv"] = q, scale
                index["weight_map"][name + "_scale_inv"] = shard
            else:
                out[name] = dequantize_blocks(q, scale, BLOCK)
        save_file(out, os.path.join(path, shard), metadata={"format": "pt"})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def _add_mtp_layer(path: str, raw: dict, fp8: bool) -> None:
    """DeepSeek-V3's MTP module as layer ``num_hidden_layers`` in a shard of its own."""
    layer, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    prefix = f"model.layers.{layer}."
    gen = torch.Generator().manual_seed(layer)
    tensors = {prefix + name: torch.ones(hidden)
               for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    eh = torch.randn(hidden, 2 * hidden, generator=gen) * 0.05
    if fp8:
        tensors[prefix + "eh_proj.weight"], tensors[prefix + "eh_proj.weight_scale_inv"] = \
            quantize_blocks(eh, BLOCK)
    else:
        tensors[prefix + "eh_proj.weight"] = eh
    shard = "model-mtp.safetensors"
    save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


class MLAOracle(CachedHF):
    """HF in fp32: last-token logits and per layer (kv_latent, k_rope)."""

    def load(self, path: str):
        import transformers
        return transformers.DeepseekV3ForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa")

    def layers(self, out, model) -> list:
        return [(c.keys[0, 0], c.values[0, 0]) for c in out.past_key_values.layers]

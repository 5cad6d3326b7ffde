"""Tiny GLM-4.5-family checkpoints written the way the releases are: a released config.json with its
sizes shrunk (every other field kept; docs/configs/glm-4.7 and glm-4.5-air), sharded safetensors
with the index file, the multi-token-prediction layer after the last one, and for the FP8 releases
(GLM-4.5-FP8 and the like: compressed-tensors, llm-compressor's FP8_DYNAMIC scheme) every Linear
weight but the LM head in float8_e4m3fn with a per-channel ``weight_scale`` [N, 1] in bfloat16
beside it (experts per expert, as released). Beside an FP8 checkpoint, its exactly dequantized
float32 twin, which HF transformers runs as the oracle (transformers 5 reads no compressed-tensors
checkpoint without that package)."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from testkit.fp8_checkpoint import quantize_blocks
from testkit.mla_checkpoint import widen_init
from testkit.paths import REPO


def release_config(name: str) -> dict:
    """A released config.json kept in docs/configs (docs/configs/SOURCES.md says where from)."""
    with open(os.path.join(REPO, "docs", "configs", name, "config.json")) as f:
        return json.load(f)


# compressed-tensors' FP8_DYNAMIC scheme as llm-compressor writes it: per-channel symmetric FP8
# weights, activations quantized per token at run time; routers and the LM head left alone.
FP8_DYNAMIC = {
    "config_groups": {"group_0": {
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True,
                              "group_size": None, "num_bits": 8, "observer": None,
                              "observer_kwargs": {}, "strategy": "token", "symmetric": True,
                              "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": None, "num_bits": 8, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                    "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": None,
    "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}
# The sizes shrunk (the special token ids with the vocabulary); routing, partial RoPE, biases,
# norms and the rest stay as released.
SHRUNK = dict(vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
              num_experts_per_tok=2, max_position_embeddings=2048, pad_token_id=208,
              eos_token_id=[208, 209, 210])
# Fields of the released files that Glm4MoeConfig does not take as they are written.
_HF_ONLY = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
            "quantization_config")


def write_release(path: str, release: dict, seed: int, fp8: bool = False,
                  **sizes) -> tuple[str, str]:
    """(the checkpoint, the directory HF reads as its oracle) under ``path``: for bf16 the
    checkpoint itself, for FP8 its dequantized twin. ``sizes`` override ``SHRUNK``."""
    import transformers
    raw = {**release, **SHRUNK, **sizes}
    raw.pop("quantization_config", None)
    if fp8:
        raw["quantization_config"] = FP8_DYNAMIC
    config = transformers.Glm4MoeConfig(**{k: v for k, v in raw.items() if k not in _HF_ONLY})
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(config).to(torch.float32)
    widen_init(model)
    source, ckpt, twin = (os.path.join(path, n) for n in ("hf-save", "release", "oracle"))
    model.save_pretrained(source, safe_serialization=True, max_shard_size="100KB")
    shutil.copytree(source, ckpt)
    if fp8:
        shutil.copytree(source, twin)
        _rewrite_shards(ckpt, quantize=True)
        _rewrite_shards(twin, quantize=False)
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    if fp8:
        with open(os.path.join(twin, "config.json"), "w") as f:
            json.dump({k: v for k, v in raw.items() if k != "quantization_config"}, f, indent=2)
    _add_mtp_layers(ckpt, raw, fp8)
    return ckpt, twin if fp8 else ckpt


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """The Linear weights of the released model (experts per expert): not the LM head, the router,
    the embedding, norms or biases."""
    return (tensor.ndim == 2 and name.endswith("_proj.weight")) or name.endswith(".eh_proj.weight")


def _per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and its bfloat16 scale per output row (amax / 448)."""
    q, scale = quantize_blocks(w, (1, w.shape[1]))
    return q, scale.to(torch.bfloat16)


def _rewrite_shards(path: str, quantize: bool) -> None:
    """Every Linear weight of every shard as FP8 with its scale (or, for the twin, FP8 rounded back
    to float32); each scale joins its weight's shard in the index."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(path, shard))
        out = {}
        for name, w in tensors.items():
            if not _quantized(name, w):
                out[name] = w
                continue
            q, scale = _per_channel(w)
            if quantize:
                out[name], out[name + "_scale"] = q, scale
                index["weight_map"][name + "_scale"] = shard
            else:
                out[name] = q.float() * scale.float()
        save_file(out, os.path.join(path, shard), metadata={"format": "pt"})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def _add_mtp_layers(path: str, raw: dict, fp8: bool) -> None:
    """The release's MTP modules as layers ``num_hidden_layers`` on, in a shard of their own."""
    hidden, tensors = raw["hidden_size"], {}
    gen = torch.Generator().manual_seed(raw["num_hidden_layers"])
    for i in range(raw.get("num_nextn_predict_layers", 1)):
        prefix = f"model.layers.{raw['num_hidden_layers'] + i}."
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[prefix + name] = torch.ones(hidden)
        eh = torch.randn(hidden, 2 * hidden, generator=gen) * 0.05
        if fp8:
            q, scale = _per_channel(eh)
            tensors[prefix + "eh_proj.weight"], tensors[prefix + "eh_proj.weight_scale"] = q, scale
        else:
            tensors[prefix + "eh_proj.weight"] = eh
    if not tensors:
        return
    shard = "model-mtp.safetensors"
    save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)

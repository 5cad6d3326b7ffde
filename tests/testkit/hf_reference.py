"""Tiny random HF checkpoints and the HF transformers reference (the oracle nobody here wrote)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def make_checkpoint(path: str, family: str = "qwen3", seed: int = 0, **overrides) -> str:
    """Build a random checkpoint with transformers and save it as config.json + safetensors."""
    import transformers
    cfg_name, model_name = _CONFIGS[family]
    kwargs = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near zero
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


class HFReference:
    """HF model in fp32 on CPU; logits at the last token and past_key_values for a full sequence."""

    def __init__(self, path: str) -> None:
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, attn_implementation="sdpa").eval()

    @torch.no_grad()
    def run(self, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        out = self.model(torch.tensor([ids]), use_cache=True)
        pkv = out.past_key_values
        kv = []
        for layer in range(self.model.config.num_hidden_layers):
            if hasattr(pkv, "layers"):
                k, v = pkv.layers[layer].keys, pkv.layers[layer].values
            else:
                k, v = pkv[layer]
            kv.append((k[0].float(), v[0].float()))
        return out.logits[0, -1].float(), kv


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


class CachedHF:
    """HF transformers in fp32, one model per checkpoint and one pass per (checkpoint, ids):
    (last-token logits, ``layers(out, model)``, the per-layer caches a test compares)."""

    attn_implementation: str | None = "sdpa"

    def __init__(self) -> None:
        self.models: dict[str, object] = {}
        self.cache: dict[tuple, tuple] = {}

    def load(self, path: str):
        import transformers
        kw = {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)

    def layers(self, out, model) -> list:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, path: str, ids: list[int]) -> tuple:
        key = (path, tuple(ids))
        if key not in self.cache:
            if path not in self.models:
                self.models[path] = self.load(path).eval()
            model = self.models[path]
            out = model(torch.tensor([ids]), use_cache=True)
            self.cache[key] = (out.logits[0, -1].float(), self.layers(out, model))
        return self.cache[key]

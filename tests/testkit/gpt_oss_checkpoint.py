"""Tiny gpt-oss checkpoints written as the releases are, and their HF transformers oracle.

The config is the released gpt-oss-20b config.json (docs/configs/) with every field kept and the
sizes made tiny. The weights come from a random transformers model, rounded to bf16 (the releases'
dtype); the MXFP4 form quantizes each expert projection here (the tests' own quantizer: per block
of 32 the smallest power-of-two scale that fits the block's largest value within 6, each value
rounded to the nearest FP4 e2m1 value) and writes ``*_blocks`` / ``*_scales`` with the release's
names, dtypes and sharded index. The oracle is HF on those same files: transformers' own MXFP4
dequantizer (``Mxfp4Config(dequantize=True)``) reads the blocks, so the packing is checked against
code nobody here wrote.
"""
from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import save_file

from testkit.paths import REPO

RELEASE = os.path.join(REPO, "docs", "configs", "gpt-oss-20b", "config.json")
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
            experts_per_token=2, sliding_window=12, max_position_embeddings=2048,
            initial_context_length=64, pad_token_id=0, eos_token_id=1, swiglu_limit=2.0)


def release_config() -> dict:
    with open(RELEASE) as f:
        return json.load(f)


def tiny_config(layers: int = 2, quantized: bool = True, **overrides) -> dict:
    """The release's config.json, every field kept, with tiny sizes (``layers`` of its schedule:
    sliding, full, ...) and a YaRN original context of 64 (tables of 2048 positions)."""
    raw = release_config()
    raw.update(copy.deepcopy(TINY), num_hidden_layers=layers,
               layer_types=raw["layer_types"][:layers])
    raw["rope_scaling"]["original_max_position_embeddings"] = 64
    if not quantized:
        del raw["quantization_config"]
    raw.update(overrides)
    return raw


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows,
    cols / 32]): two e2m1 values per byte, the even column in the low nibble."""
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1).clamp_min(2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    nibble = (scaled.abs().unsqueeze(-1) - FP4_GRID).abs().argmin(-1)
    nibble = nibble | ((scaled < 0).long() << 3)
    packed = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def make_gpt_oss(path: str, layers: int = 2, quantized: bool = True, seed: int = 0,
                 **overrides) -> str:
    """A random gpt-oss checkpoint at ``path`` as released: bf16 tensors, experts as MXFP4 blocks
    and scales (where ``quantized`` and the config's modules_to_not_convert leave them), two
    safetensors shards and their index."""
    import transformers
    raw = tiny_config(layers, quantized, **overrides)
    config = transformers.GptOssConfig(**{k: v for k, v in raw.items()
                                          if k not in ("architectures", "quantization_config")})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():   # wider than HF's init, so routing, clamps and sinks all matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.5)
            else:
                p.normal_(0.0, 0.1 if p.ndim == 1 else 0.08 if "experts" not in name else 0.3)
    state = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    experts, others = {}, {}
    mxfp4 = _mxfp4_modules(raw, layers)
    for name, t in state.items():
        module, leaf = name.rsplit(".", 1)
        if module in mxfp4 and leaf in ("gate_up_proj", "down_proj"):
            # transformers holds [E, in, out]; the release blocks the rows of [E, out, in]
            experts[name + "_blocks"], experts[name + "_scales"] = quantize_mxfp4(
                t.transpose(1, 2).float())
        else:
            (experts if ".experts." in name else others)[name] = t.contiguous()
    os.makedirs(path, exist_ok=True)
    shards = {"model-00001-of-00002.safetensors": others,
              "model-00002-of-00002.safetensors": experts}
    for file, tensors in shards.items():
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for s in shards.values() for t in s.values())},
             "weight_map": {n: f for f, s in shards.items() for n in s}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return path


def _mxfp4_modules(raw: dict, layers: int) -> set[str]:
    """The experts modules transformers' MXFP4 integration converts (modules_to_not_convert)."""
    quant = raw.get("quantization_config")
    if not quant:
        return set()
    from transformers.quantizers.quantizers_utils import should_convert_module
    names = [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    return {n for n in names if should_convert_module(n, quant.get("modules_to_not_convert"))}


class GptOssHF:
    """HF transformers in fp32 (eager attention: sinks), MXFP4 experts through transformers' own
    dequantizer; one pass per (checkpoint, ids): (last-token logits, every layer's cached K/V: a
    sliding layer's last sliding_window - 1 tokens, as HF's cache keeps them)."""

    def __init__(self) -> None:
        self.models: dict[str, object] = {}
        self.cache: dict[tuple, tuple] = {}

    def load(self, path: str):
        import transformers
        kw = {}
        with open(os.path.join(path, "config.json")) as f:
            if "quantization_config" in json.load(f):
                kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", **kw).eval()

    @torch.no_grad()
    def __call__(self, path: str, ids: list[int]) -> tuple:
        key = (path, tuple(ids))
        if key not in self.cache:
            if path not in self.models:
                self.models[path] = self.load(path)
            out = self.models[path](torch.tensor([ids]), use_cache=True)
            kv = [(layer.keys[0].float(), layer.values[0].float()) for layer in out.cache.layers]
            self.cache[key] = (out.logits[0, -1].float(), kv)
        return self.cache[key]

"""The tests' own FP8 quantizer: block-quantized checkpoints (DeepSeek/Qwen format) made from the
tiny random HF ones, and their exactly dequantized twins, which HF transformers runs as the oracle.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int],
                    power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and float32 scale_inv per (rows x cols) block: amax / 448 (rounded up to
    a power of two for scale_fmt ue8m0, as DeepSeek V3.1 on); edge blocks partial."""
    (n, k), (bo, bi) = w.shape, block
    rows, cols = -(-n // bo), -(-k // bi)
    padded = torch.zeros(rows * bo, cols * bi)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, bo, cols, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * bo, cols * bi)
    return q[:n, :k].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[:n, :k]


def make_fp8_checkpoint(
    src: str,
    dst: str,
    dst_dequantized: str,
    block: tuple[int, int],
    skip: tuple[str, ...] = ("lm_head",),
    scale_fmt: str | None = None,
) -> tuple[str, str]:
    """Quantize every ``*_proj.weight`` and Gated DeltaNet ``in_proj_*.weight`` of ``src`` (MoE
    experts' too; not the router ``mlp.gate``) outside ``skip`` (module names, each covering the
    modules under it); write the FP8 checkpoint (with its quantization_config) and the dequantized
    float32 one (the plain config). ``scale_fmt`` "ue8m0": power-of-two scales, written in the
    config as the released files do."""
    weights = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in weights.items():
        module = name.rsplit(".", 1)[0]
        skipped = any(module == s or module.startswith(s + ".") for s in skip)
        projection = name.endswith("_proj.weight") or ".in_proj_" in name
        if projection and not skipped:
            q, s = quantize_blocks(w, block, scale_fmt == "ue8m0")
            quantized[name], quantized[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize_blocks(q, s, block)
        else:
            quantized[name] = dequantized[name] = w
    for path, tensors in ((dst, quantized), (dst_dequantized, dequantized)):
        shutil.copytree(src, path)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": list(skip),
        **({"scale_fmt": scale_fmt} if scale_fmt else {}),
    }
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst, dst_dequantized

"""HF transformers on the same checkpoint: the baseline graphcp benchmarks print beside theirs."""
from __future__ import annotations

import os
import time
from typing import Callable

import torch


class HFModel:
    """The checkpoint through ``transformers`` (sdpa attention; fp32 on CPU, bf16 on CUDA)."""

    def __init__(self, path: str, device: str) -> None:
        import transformers
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        kw = dict(dtype=dtype, attn_implementation="sdpa")
        if path.endswith(".gguf"):   # transformers dequantizes a GGUF (needs gguf, accelerate)
            kw["gguf_file"] = os.path.basename(path)
            path = os.path.dirname(os.path.abspath(path))
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
        except ValueError:      # an architecture without SDPA (DeepSeek V4): HF's eager attention
            kw["attn_implementation"] = "eager"
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
        self.model.eval()
        self.device = device

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> None:
        ids = torch.tensor(batch, device=self.device)
        self.model(ids, use_cache=True, logits_to_keep=1)
        if self.device == "cuda":
            torch.cuda.synchronize()


def time_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3

"""Attention kernels behind one contract: graphcp's Triton kernels and the flashinfer glue, each imported
lazily so the engine runs where Triton or flashinfer is absent."""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA GPUs, and on CPU in its interpreter (TRITON_INTERPRET=1, set before import)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return os.environ["TRITON_INTERPRET"] == "1"
    return device.type == "cuda"

"""MXFP4 checkpoints (gpt-oss as released, ``quantization_config: {quant_method: mxfp4}``) as
files: each quantized weight [out, in] is two uint8 tensors, ``<name>_blocks`` [..., out, in / 32,
16] (32 FP4 e2m1 values per block, two per byte, the low nibble first) and ``<name>_scales`` [...,
out, in / 32] (one e8m0 exponent byte per block); biases and every other tensor stay as stored.
Which weights are MXFP4 the config decides (the family's reader, as transformers' integration
does); here: their dtypes, checked before any allocation, and their scales, checked as read (the
e8m0 byte 0xFF is NaN). The packing itself (``kernels/mxfp4_torch.py``) is what the models read.
"""
from __future__ import annotations

import torch

from graphcp.errors import ConfigError
from graphcp.kernels.mxfp4_torch import SCALE_NAN

SUFFIXES = ("_blocks", "_scales")


def check_dtype(name: str, dtype: str) -> None:
    """A checkpoint tensor the model expects as MXFP4 blocks or scales must be uint8 (U8)."""
    if name.endswith(SUFFIXES) and dtype != "U8":
        raise ConfigError(f"--model-path: tensor {name} is {dtype}, but MXFP4 blocks and scales "
                          "are uint8 (U8)")


def has_nan(name: str, tensor: torch.Tensor) -> bool:
    """Whether MXFP4 scales read from ``name`` hold the NaN exponent."""
    return name.endswith("_scales") and tensor.dtype == torch.uint8 \
        and bool((tensor == SCALE_NAN).any())

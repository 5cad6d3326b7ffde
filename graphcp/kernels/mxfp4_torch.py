"""MXFP4 (OCP microscaling FP4) weights at call time: each byte packs two FP4 e2m1 values (the low
nibble first), 32 values share one e8m0 scale byte (the power of two ``2 ** (byte - 127)``). The
weights stay packed in memory; the torch form dequantizes the one expert a call needs, exactly
(every FP4 value times a power of two is exact in fp32 and bf16), as transformers' dequantizer does.
"""
from __future__ import annotations

import torch

BLOCK = 32                  # values per scale
# The e2m1 value of each nibble: bit 3 the sign, bits 0-2 an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
SCALE_NAN = 255             # the e8m0 byte that encodes NaN


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., K / 2], scales uint8 [..., K / 32] -> [..., K] in ``dtype``. ``lut``: the
    16 ``FP4_VALUES`` as a float32 tensor on the weights' device, made once at load (tensor ops only
    here, so a captured graph may hold the call)."""
    low = lut.index_select(0, (packed & 0x0F).reshape(-1).int())
    high = lut.index_select(0, (packed >> 4).reshape(-1).int())
    values = torch.stack((low, high), dim=-1).view(*scales.shape, BLOCK)
    exponents = scales.int() - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def fp4_table(device: torch.device | str) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)

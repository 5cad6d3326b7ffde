"""What graphcp's Triton kernels share: the offset width and the dot mode of a launch."""
from __future__ import annotations

import torch

LOG2E = 1.4426950408889634


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether an offset into one of ``tensors`` can reach 2**31 (its largest offset + 1). Kernels
    address in int32 otherwise: half the registers per offset, and no 64-bit multiplies."""
    largest = max(sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) for t in tensors)
    return largest + 1 >= 2**31


def dot_mode(x: torch.Tensor) -> tuple[bool, str | None]:
    """(DOT_F32, input_precision) of the dots over ``x``'s dtype. bf16/fp16 dots run on the tensor
    cores in that dtype with fp32 accumulation; Triton's interpreter multiplies bf16 operands as raw
    integers, so there they run in fp32 on the same bf16-rounded operands. fp32 stays exact (IEEE,
    no TF32)."""
    dot_f32 = x.device.type != "cuda" and x.dtype != torch.float32
    return dot_f32, "ieee" if x.dtype == torch.float32 or dot_f32 else None

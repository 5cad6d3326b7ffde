"""The per-channel FP8 GEMM (``kernels/fp8_rowwise.py``: per-token activations, row-wise scaled
``torch._scaled_mm``) against its float32 form and against the dequantized weight; torch's CPU
build runs ``_scaled_mm`` too, so the call itself is checked here, its speed on a GPU by
``profiles/gpu_check.py``."""
from __future__ import annotations

import torch

from graphcp.kernels.fp8_rowwise import quantize_rows, rowwise_linear, rowwise_linear_torch, rowwise_unusable
from graphcp.kernels.fp8_torch import dequantize_weight
from graphcp.kernels.fp8_types import FP8, FP8_MAX, WHOLE_ROW, Fp8Weight


def _weight(n: int, k: int, seed: int) -> Fp8Weight:
    """Per-channel FP8 as compressed-tensors writes it, rows mapped to their scales out of order
    (as a fused q/k/v or a shard maps them)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    scale = w.abs().amax(-1, keepdim=True) / FP8_MAX
    rows = torch.randperm(n, generator=gen)
    fp8 = (w / scale).to(FP8)[rows]
    return Fp8Weight(fp8, scale, rows.to(torch.int32), 0, (1, WHOLE_ROW))


def test_scaled_mm_equals_its_float32_form():
    w = _weight(48, 64, 0)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)) * 4
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2))
    got, want = rowwise_linear(x, w, bias), rowwise_linear_torch(x, w, bias)
    assert got.shape == (2, 7, 48)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_close_to_the_dequantized_weight_within_activation_rounding():
    """Only the activations' per-token rounding (e4m3: 3 mantissa bits) separates it from HF's
    arithmetic on the dequantized weight."""
    w = _weight(32, 128, 3)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4))
    exact = x @ dequantize_weight(w, torch.float32).t()
    err = ((rowwise_linear(x, w) - exact).abs().max() / exact.abs().max()).item()
    assert 1e-4 < err < 5e-2, err                   # rounded, and only by the activations
    xq, xs = quantize_rows(x)
    assert xq.dtype == FP8 and xs.shape == (9, 1)
    assert ((xq.float() * xs).abs().amax(-1) - x.abs().amax(-1)).abs().max() < 1e-5


def test_where_it_cannot_serve_it_says_why():
    w = _weight(48, 64, 0)
    assert "compute capability" in rowwise_unusable(torch.device("cpu"), torch.bfloat16, w)

"""The block-scaled FP8 grouped GEMM of the MoE experts (Triton's interpreter): equal to its torch
form (same activation rounding) on the loader's layout (gate rows then up rows over their own scale
rows, down's K an expert-TP slice starting inside a block, N and K not multiples of the block),
under expert parallelism with pairs routed elsewhere, empty experts and padding tiles; and within
the activations' FP8 rounding of the exact product with the dequantized weights."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest
import torch
from testkit.fp8_checkpoint import dequantize_blocks, quantize_blocks
from torch import nn

from graphcp.kernels import fp8_torch, moe_torch, registry
from graphcp.kernels.fp8_types import Fp8Experts

pytest.importorskip("triton")
from graphcp.kernels import triton_moe

BLOCK = (16, 32)


def _rows_of(first: int, count: int, block: int) -> torch.Tensor:
    return (torch.arange(first, first + count) // block - first // block).to(torch.int32)


def _experts(num: int, hidden: int, inter: int, lo: int, hi: int, gen: torch.Generator,
             block: tuple[int, int] = BLOCK) -> tuple[Fp8Experts, Fp8Experts, tuple]:
    """``num`` experts quantized whole (intermediate ``inter``), then this rank's expert-TP slice
    lo:hi taken as the loader takes it: gate rows lo:hi then up rows lo:hi, each over the scale
    rows covering them; down's columns lo:hi with the scale columns covering them (k_offset
    lo % block). Returns the FP8 experts and their dequantized fp32 weights."""
    bo, bi = block
    qgu, sgu, qd, sd, dense_gu, dense_d = [], [], [], [], [], []
    for _ in range(num):
        gate, up = (torch.randn(inter, hidden, generator=gen) * 0.2 for _ in range(2))
        down = torch.randn(hidden, inter, generator=gen) * 0.2
        parts = [quantize_blocks(w, block) for w in (gate, up, down)]
        rows = slice(lo // bo, -(-hi // bo))
        qgu.append(torch.cat([parts[0][0][lo:hi], parts[1][0][lo:hi]]))
        sgu.append(torch.cat([parts[0][1][rows], parts[1][1][rows]]))
        dense_gu.append(torch.cat([dequantize_blocks(*p[:2], block)[lo:hi] for p in parts[:2]]))
        qd.append(parts[2][0][:, lo:hi].contiguous())
        sd.append(parts[2][1][:, lo // bi: -(-hi // bi)].contiguous())
        dense_d.append(dequantize_blocks(*parts[2][:2], block)[:, lo:hi])
    half = _rows_of(lo, hi - lo, bo)
    gu_rows = torch.cat([half, half + len(range(lo // bo, -(-hi // bo)))])
    gate_up = Fp8Experts(torch.stack(qgu), torch.stack(sgu), gu_rows, 0, block)
    down = Fp8Experts(torch.stack(qd), torch.stack(sd), _rows_of(0, hidden, bo), lo % bi, block)
    return gate_up, down, (torch.stack(dense_gu), torch.stack(dense_d))


def _routing(rows: int, total: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    ids = torch.stack([torch.randperm(total, generator=gen)[:k] for _ in range(rows)])
    return ids, torch.rand(rows, k, generator=gen)


def _rounding(v: torch.Tensor) -> torch.Tensor:
    """How far FP8 rounding per token group may move each element: 2^-4 of itself (3 mantissa bits,
    round to nearest) or, below the normal range, half the subnormal step, 2^-10 of its group's
    scale (<= max|v| / 448)."""
    return v.abs() * 2.0**-4 + 2.0**-10 * v.abs().max() / 448.0


def _dense_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact fp32 math on the dequantized weights (no activation rounding), and per output how
    far rounding both projections' inputs to FP8 may move it: the input's rounding through |W|,
    through SiLU-gating (|silu'| <= 1.1), then the gated activations' own rounding."""
    out, bound, inter = torch.zeros_like(x), torch.zeros_like(x), down.shape[-1]
    for e in range(gate_up.shape[0]):
        w = (weights * (ids - first == e).to(weights.dtype)).sum(-1, keepdim=True)
        h, dh = x @ gate_up[e].t(), _rounding(x) @ gate_up[e].abs().t()
        (g, u), (dg, du) = h.split(inter, 1), dh.split(inter, 1)
        act = nn.functional.silu(g) * u
        dact = 1.1 * dg * (u.abs() + du) + nn.functional.silu(g).abs() * du
        out += act @ down[e].t() * w
        bound += (dact + _rounding(act.abs() + dact)) @ down[e].abs().t() * w
    return out, bound + 1e-5 * out.abs().max()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_kernel_matches_its_torch_form_under_expert_parallelism(dtype, tol):
    """Hidden 72 (K of gate_up: a partial K block; N of down: a partial row block), the expert-TP
    slice 20:58 of intermediate 64 (38 rows: partial row blocks; down's K starts 20 into a block).
    Six experts over two EP ranks: each rank sees the other's pairs, expert 4 gets no pair and 5
    many (tile boundaries), and most of the capacity is padding tiles."""
    gen = torch.Generator().manual_seed(0)
    gate_up, down, _ = _experts(3, 72, 64, 20, 58, gen)
    x = (torch.randn(21, 72, generator=gen) * torch.rand(21, 1, generator=gen) * 3).to(dtype)
    x[3] = 0.0                                            # an all-zero row stays finite
    ids, weights = _routing(21, 6, 3, gen)
    ids[ids == 4] = 5
    weights = weights.to(dtype)
    for first in (0, 3):
        for block_m in (None, 32, 64):
            got = triton_moe.triton_experts_fp8(x, ids, weights, gate_up, down, first, block_m)
            want = moe_torch.experts_fp8_torch(x, ids, weights, gate_up, down, first)
            assert got.dtype == dtype and want.abs().max() > 0
            assert _rel(got, want) <= tol, (first, block_m)
    # every pair routed to another rank's experts: nothing added, and no NaN from padding
    none = triton_moe.triton_experts_fp8(x, ids % 3 + 3, weights, gate_up, down, 0)
    assert torch.equal(none, torch.zeros_like(x))


def test_kernel_error_is_only_the_activation_rounding():
    """Against the exact product with the dequantized weights (what HF computes on the twin): every
    output within what FP8 rounding of the two projections' inputs allows, the error visible (the
    activations are rounded), and equal to the exact math on hand-rounded activations. Block 32x64
    on hidden 96 and the slice 0:80 (80 not a multiple of 64)."""
    gen = torch.Generator().manual_seed(1)
    block = (32, 64)
    gate_up, down, (dense_gu, dense_d) = _experts(4, 96, 80, 0, 80, gen, block)
    x = torch.randn(13, 96, generator=gen)
    ids, weights = _routing(13, 4, 2, gen)
    got = triton_moe.triton_experts_fp8(x, ids, weights, gate_up, down, 0)
    exact, bound = _dense_experts(x, ids, weights, dense_gu, dense_d, 0)
    assert ((got - exact).abs() <= bound).all()
    assert _rel(got, exact) > 1e-3
    # rounding the activations to FP8 but keeping the products exact reproduces the kernel
    inter = dense_d.shape[-1]
    hand = torch.zeros_like(x)
    for e in range(4):
        w = (weights * (ids == e)).sum(-1, keepdim=True)
        h = fp8_torch.rounded_activations(x, block[1]) @ dense_gu[e].t()
        act = fp8_torch.rounded_activations(nn.functional.silu(h[:, :inter]) * h[:, inter:],
                                            block[1])
        hand += act @ dense_d[e].t() * w
    assert _rel(got, hand) <= 1e-5


def test_grouped_gemm_padding_rows_and_tiles():
    """One projection on its own: live rows equal the torch form's rows; rows -1 inside a live tile
    and every row of a padding tile (which returns before reading a weight) are zeros."""
    gen = torch.Generator().manual_seed(2)
    gate_up, _, _ = _experts(2, 40, 48, 8, 40, gen)
    a = torch.randn(5, 40, generator=gen)
    rows = torch.tensor([0, 3, -1, -1] + [4, 1, 2, -1] + [-1] * 4)        # tiles of 4 rows
    tile_expert = torch.tensor([1, 0, -1])
    out = triton_moe.fp8_grouped_gemm(a, rows, gate_up, tile_expert)
    assert out.shape == (12, 64)
    xr = fp8_torch.rounded_activations(a, BLOCK[1])
    for r, (row, e) in enumerate(zip(rows.tolist(), tile_expert.repeat_interleave(4).tolist())):
        if row < 0:
            assert torch.equal(out[r], torch.zeros(64)), r
        else:
            want = xr[row] @ fp8_torch.dequantize_expert(gate_up, e, torch.float32).t()
            assert _rel(out[r], want) <= 1e-5, r


def test_start_up_check_keeps_the_kernel_and_drops_a_wrong_one(monkeypatch):
    """The registry's ``moe_experts_fp8`` op under the engine's start-up check (``KernelChoices``; here
    on CPU tensors in the interpreter): against ``experts_fp8_torch`` the kernel is kept in fp32 and
    bf16 and a kernel 1% off is dropped. The dequantized form without the activations' rounding is
    no oracle for it: in fp32 it would drop the right kernel."""
    gen = torch.Generator().manual_seed(3)
    gate_up, down, (dense_gu, dense_d) = _experts(2, 40, 48, 8, 40, gen)
    x = torch.randn(9, 40, generator=gen)
    ids, weights = torch.randint(0, 4, (9, 2), generator=gen), torch.rand(9, 2, generator=gen)
    choices = registry.KernelChoices()

    def check(dtype: torch.dtype, reference=moe_torch.experts_fp8_torch) -> bool:
        args = (x.to(dtype), ids, weights.to(dtype))
        return choices.probe("moe_experts_fp8", lambda fn: fn(*args, gate_up, down, 2),
                             lambda: reference(*args, gate_up, down, 2), dtype)

    for dtype in (torch.float32, torch.bfloat16):
        assert check(dtype) and choices.get("moe_experts_fp8") is triton_moe.triton_experts_fp8
    def dequantized(*args):
        return moe_torch.dense_experts_torch(*args[:3], dense_gu, dense_d, 2)

    assert not check(torch.float32, dequantized)

    def wrong(*args):
        return triton_moe.triton_experts_fp8(*args) * 1.01

    monkeypatch.setattr(triton_moe, "triton_experts_fp8", wrong)
    assert not check(torch.float32) and choices.get("moe_experts_fp8") is None

"""Part e: the block-scaled FP8 GEMM (Triton) against its torch form and the dequantized product,
and its TFLOP/s at the 1B model's FFN shapes next to bf16 torch.matmul; the FP8 grouped-GEMM MoE
experts against their torch form, timed next to the bf16 grouped GEMM on the same experts."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from .common import SkipPart, cuda_ms, device_of, rel_err

if TYPE_CHECKING:
    import torch

    from .report import Report

TITLE = "FP8 block-scaled GEMM (triton) vs torch, TFLOP/s"
FP8_GEMM_MODULE = "graphcp.kernels.triton_fp8_gemm"


def _fp8_case(m: int, n: int, k: int, offset: int, dtype: torch.dtype, device: str,
              seed: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """x [m, k], an FP8 weight [n, k] whose column 0 sits ``offset`` into its 128-block (a column
    shard), random block scales, and the weight dequantized in fp32 (the torch form it stands for).
    """
    import torch

    from graphcp.kernels import fp8_types as fp8
    gen = torch.Generator().manual_seed(seed)
    block = (128, 128)
    q = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(fp8.FP8)
    grid = (-(-n // block[0]), -(-(k + offset) // block[1]))
    scale = torch.rand(grid, generator=gen) * 1e-3 + 5e-4
    rows = (torch.arange(n) // block[0]).to(torch.int32)
    dense = q.float() * scale[rows.long()][:, (torch.arange(k) + offset) // block[1]]
    x = (torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 4 + 0.1)).to(dtype)
    dev = torch.device(device)
    w = fp8.Fp8Weight(q.to(dev), scale.to(dev), rows.to(dev), offset, block)
    return x.to(dev), w, dense.to(dev)


def run(rep: Report, workdir: str) -> str:
    import torch
    find = importlib.util.find_spec
    if find("triton") is None or find(FP8_GEMM_MODULE) is None:
        if rep.dry_run:
            raise SkipPart("triton or the FP8 GEMM is not installed")
        raise RuntimeError(f"cannot test the FP8 GEMM: triton or {FP8_GEMM_MODULE} is missing")
    from graphcp.kernels.fp8_torch import fp8_linear_torch
    from graphcp.kernels.triton_fp8_gemm import triton_fp8_linear
    device = device_of(rep)
    if not rep.dry_run and torch.cuda.get_device_capability() < (8, 9):
        raise SkipPart("no FP8 tensor cores (compute capability < 8.9): FP8 weights are dequantized per call")
    dtype = torch.float32 if rep.dry_run else torch.bfloat16
    # Against the torch form (same activation quantization): summation order, the output's rounding.
    tol_form = 1e-5 if rep.dry_run else 1e-2
    # Against the dequantized product: e4m3 activations carry 3 mantissa bits (each within 2^-4
    # of itself); over a K-long sum that averages to a few percent of the output (2-3% measured).
    tol_dense = 5e-2
    cases = ([(5, 192, 256, 0), (33, 192, 256, 80)] if rep.dry_run else
             [(512, 11264, 2048, 0), (2048, 2048, 5632, 0), (333, 1000, 1000, 80)])
    for i, (m, n, k, offset) in enumerate(cases):
        x, w, dense = _fp8_case(m, n, k, offset, dtype, device, seed=300 + i)
        got = triton_fp8_linear(x, w)
        form = fp8_linear_torch(x, w)
        exact = x.float() @ dense.t()
        name = f"fp8 gemm {m}x{n}x{k}" + (f" (K grid offset {offset})" if offset else "")
        rep.check("e", f"{name} vs torch form", "max rel err", rel_err(got, form), tol_form)
        rep.check("e", f"{name} vs dequantized", "max rel err", rel_err(got, exact), tol_dense)
        del x, w, dense, got, form, exact
    _experts(rep, dtype, device)
    if not rep.dry_run:
        _timings(rep, triton_fp8_linear, dtype)
    return ""


def _experts(rep: Report, dtype: torch.dtype, device: str) -> None:
    """Tokens routed top-8 over one EP rank's 16 of 128 experts (Qwen3-30B-A3B's hidden 2048 and
    intermediate 768; tiny on a dry run), FP8 experts in 128 x 128 blocks."""
    import torch

    from graphcp.kernels.fp8_types import FP8, Fp8Experts
    from graphcp.kernels.moe_torch import experts_fp8_torch
    from graphcp.kernels.triton_moe import triton_experts, triton_experts_fp8
    n, hidden, inter, local, block = ((9, 64, 48, 4, (16, 32)) if rep.dry_run else
                                      (4096, 2048, 768, 16, (128, 128)))
    gen, dev = torch.Generator().manual_seed(7), torch.device(device)

    def experts(rows: int, cols: int) -> Fp8Experts:
        q = (torch.randn(local, rows, cols, generator=gen) * 64).clamp(-448, 448).to(FP8)
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale = torch.rand(local, *grid, generator=gen) * 1e-3 + 5e-4
        scale_rows = (torch.arange(rows) // block[0]).to(torch.int32)
        return Fp8Experts(q.to(dev), scale.to(dev), scale_rows.to(dev), 0, block)

    gate_up, down = experts(2 * inter, hidden), experts(hidden, inter)
    x = torch.randn(n, hidden, generator=gen).to(dev, dtype)
    ids = torch.stack([torch.randperm(8 * local, generator=gen)[:8] for _ in range(n)]).to(dev)
    weights = torch.rand(n, 8, generator=gen).to(dev, dtype)
    args = (x, ids, weights, gate_up, down, 0)
    got, form = triton_experts_fp8(*args), experts_fp8_torch(*args)
    # bf16: the outputs' rounding, and rare FP8 rounding flips where the gated activations differ
    rep.check("e", f"FP8 grouped experts {n} tokens top-8, {local} local experts vs torch form",
              "max rel err", rel_err(got, form), 1e-5 if rep.dry_run else 2e-2)
    if rep.dry_run:
        return
    if rep.left() < 8:
        rep.cut("FP8 experts timings")
        return
    from graphcp.kernels.fp8_torch import dequantize_expert
    dense = [torch.stack([dequantize_expert(w, e, dtype) for e in range(local)])
             for w in (gate_up, down)]
    rep.info["moe_fp8_ms"] = ms = {
        "fp8": cuda_ms(lambda: triton_experts_fp8(*args), 3, 10),
        "bf16": cuda_ms(lambda: triton_experts(x, ids, weights, *dense, 0), 3, 10)}
    print(f"   FP8 experts {ms['fp8']:.3f} ms, bf16 grouped GEMM {ms['bf16']:.3f} ms", flush=True)


def _timings(rep: Report, triton_fp8_linear: Any, dtype: torch.dtype) -> None:
    import torch
    for m in (512, 2048, 8192):
        for label, n, k in (("gate_up", 11264, 2048), ("down", 2048, 5632)):
            if rep.left() < 8:
                rep.cut(f"fp8 timings from {label} M={m}")
                return
            x, w, dense = _fp8_case(m, n, k, 0, dtype, "cuda", seed=m + n)
            w_bf16 = dense.to(torch.bfloat16)
            flops = 2 * m * n * k
            fp8_ms = cuda_ms(lambda: triton_fp8_linear(x, w), 3, 10)
            bf16_ms = cuda_ms(lambda: torch.matmul(x, w_bf16.t()), 3, 10)
            row = {"shape": f"{label} {m}x{n}x{k}", "m": m, "fp8_ms": fp8_ms,
                   "fp8_tflops": flops / fp8_ms / 1e9, "bf16_ms": bf16_ms,
                   "bf16_tflops": flops / bf16_ms / 1e9}
            rep.fp8_perf.append(row)
            print(f"   {row['shape']}: fp8 {fp8_ms:.3f} ms = {row['fp8_tflops']:.0f} TFLOP/s, "
                  f"bf16 matmul {bf16_ms:.3f} ms = {row['bf16_tflops']:.0f} TFLOP/s", flush=True)

"""Part b: Triton attention TFLOP/s at 1k, 8k and 32k causal (CUDA events, median; FLOPs = 4 q kv heads
d / 2), with torch SDPA (flash) and flashinfer (when installed) alongside, and a sweep of Triton
tile shapes at head_dim 128 so the defaults in ``triton_attention.attention_tiles`` can follow measurements.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .common import cuda_ms, triton_ready
from .kernels import flashinfer_kernels, paged_case
from .report import PEAK_BF16_TFLOPS

if TYPE_CHECKING:
    from .report import Report

TITLE = "attention TFLOP/s (triton)"
TILE_SWEEP = ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
              (64, 32, 4, 3))
# 1K, 8K, 32K causal at head_dim 128 (and 8K/32K at 64). The sweep holds the tiles the engine chose before
# the kernel report (64x64 w4 s2, 128x64 w4/w8, 128x128 w8) beside today's (64x64 w4 s3, 128x64 w8 s3).
SHAPES = ((1024, 32, 8, 128), (8192, 32, 8, 128), (32768, 32, 8, 128), (8192, 32, 4, 64), (32768, 32, 4, 64))


def _tile_sweep(rep: Report, kernel: Callable[..., Any], args: tuple, reps: int,
                notes: list[str]) -> dict[str, float]:
    """ms per (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    results = {}
    for i, (bm, bn, warps, stages) in enumerate(TILE_SWEEP):
        if rep.left() < 8:
            rep.cut(f"tile sweep after {i} of {len(TILE_SWEEP)} configs")
            break
        try:
            ms = cuda_ms(lambda: kernel(*args, block_m=bm, block_n=bn, num_warps=warps,
                                        num_stages=stages), 1, reps)
        except Exception as e:
            notes.append(f"tiles {bm}x{bn} w{warps} s{stages}: {type(e).__name__}")
            continue
        results[f"{bm}x{bn} w{warps} s{stages}"] = ms
    return results


def run(rep: Report, workdir: str) -> str:
    import torch
    why = triton_ready()
    if why:
        raise RuntimeError(f"cannot time the Triton kernel: {why}")
    from graphcp.kernels.triton_attention import triton_paged_attention
    notes: list[str] = []
    for i, (tokens, hq, hkv, d) in enumerate(SHAPES):
        if rep.left() < 10:
            rep.cut(f"attention shapes {[s[0] for s in SHAPES[i:]]}")
            break
        q, kp, vp, cu, rows, lim = paged_case([tokens], [0], hq, hkv, d, 16, 0, torch.bfloat16,
                                              "cuda", seed=tokens)
        out = torch.empty_like(q)
        scale = d ** -0.5
        reps = 10 if tokens <= 8192 else 5
        args = (q, kp, vp, cu, rows, lim, 16, scale, 0, 0, out)     # 0, 0: the capturable call
        ms = cuda_ms(lambda: triton_paged_attention(*args), 2, reps)
        flops = 4 * tokens * tokens * hq * d / 2
        row = {"shape": f"causal {tokens} tokens, h{hq}/{hkv}, d{d}, page 16", "tokens": tokens,
               "head_dim": d, "triton_ms": ms, "triton_tflops": flops / ms / 1e9,
               "pct_peak": 100 * flops / ms / 1e9 / PEAK_BF16_TFLOPS}
        try:   # torch SDPA on contiguous K/V as a yardstick (kv heads expanded outside the timing)
            sq = q.transpose(0, 1)[None]
            kc = kp[:tokens].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None].contiguous()
            vc = vp[:tokens].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None].contiguous()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            s_ms = cuda_ms(lambda: sdpa(sq, kc, vc, is_causal=True, scale=scale), 2, reps)
            row.update(sdpa_ms=s_ms, sdpa_tflops=flops / s_ms / 1e9)
        except Exception as e:
            notes.append(f"SDPA yardstick failed: {type(e).__name__}")
        for fi_name, fi_fn in flashinfer_kernels(rep, torch.bfloat16, d):
            f_ms = cuda_ms(lambda: fi_fn(*args[:8], tokens, tokens, args[10]), 2, reps)   # into out
            row.update(flashinfer=fi_name, flashinfer_ms=f_ms, flashinfer_tflops=flops / f_ms / 1e9)
        if d == 128:
            row["tiles"] = _tile_sweep(rep, triton_paged_attention, args, reps, notes)
        rep.kernel_perf.append(row)
        print(f"   {row['shape']}: triton {ms:.3f} ms = {row['triton_tflops']:.1f} TFLOP/s "
              f"({row['pct_peak']:.1f}% of peak)", flush=True)
        del q, kp, vp, out
    return "; ".join(notes)

#!/usr/bin/env python
"""The Triton attention kernels on a GPU at every head dim the families use, and the dense MLA
prefill: what the CPU tests (Triton's interpreter) cannot show.

    python profiles/attention_cuda_check.py            # one GPU, ~1 minute with a cold cache

Per head dim (64, 80, 96, 128, 192, 256; bf16, fp32 at 256; a window + sinks at 64 and 256): the
Triton paged kernel against the torch reference in fp32 on a batch with a cached prefix, the
worst per-row relative error; its time beside the torch kernel's (the CUDA fallback it replaces);
one CUDA-graph capture replayed on new inputs; and that new row counts (other alignments) compile
nothing. The MLA prefill (DeepSeek-V3 widths, 16 heads) against both torch forms, timed, captured.
Prints one JSON line per check; exit 1 when any error is out of tolerance.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from graphcp.kernels.mla_torch import MLAArgs, MLADims, mla_attention  # noqa: E402
from graphcp.kernels.torch_ref import torch_paged_attention  # noqa: E402
from graphcp.kernels.torch_sdpa import torch_sdpa_attention  # noqa: E402
from graphcp.kernels.triton_attention import (  # noqa: E402
    _paged_attn_kernel,
    triton_paged_attention,
)
from graphcp.kernels.triton_mla import triton_mla_prefill  # noqa: E402

DEV, PS = torch.device("cuda"), 16
ROWS, PREFIX, ALIGNMENTS = (3000, 1100), 2500, (777, 1001, 2049)   # a CPU smoke test shrinks them
MLA_ROWS, MLA_PREFIX = (2048, 1024), 2048
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}     # as the start-up check (registry)
failed = []


def report(**row) -> None:
    if row.get("rel_err", 0) > row.get("tol", 1):
        failed.append(row)
    print(json.dumps(row), flush=True)


def row_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst per-row relative error (each query row against its own largest value)."""
    got, want = got.float().flatten(1), want.float().flatten(1)
    return float(((got - want).abs().amax(1) / want.abs().amax(1).clamp_min(1e-6)).max())


def batch(gen, rows, prefix, hq, hkv, d, dtype):
    kv = [rows[0] + prefix, rows[1]]
    pages = max(-(-n // PS) for n in kv)
    table = (torch.randperm(2 * pages, generator=gen) + 1).view(2, pages)
    limits = [prefix + i + 1 for i in range(rows[0])] + [i + 1 for i in range(rows[1])]
    pad = 8
    cu = torch.tensor([0, rows[0], sum(rows)])
    pool = ((2 * pages + 1) * PS, hkv, d)
    t = [torch.randn(sum(rows) + pad, hq, d, generator=gen), torch.randn(pool, generator=gen),
         torch.randn(pool, generator=gen)]
    meta = [cu, table, torch.tensor(limits + [0] * pad)]
    return [x.to(DEV, dtype) for x in t] + [m.to(DEV) for m in meta], max(kv)


def timed(fn, reps=5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_cache_size() -> int:
    caches = getattr(_paged_attn_kernel, "device_caches", None)
    if caches is None:
        return len(getattr(_paged_attn_kernel, "cache", {}).get(torch.cuda.current_device(), {}))
    return sum(len(entry[0]) for entry in caches.values())


def attention(d: int, dtype: torch.dtype, window: int, sinks: bool) -> None:
    gen = torch.Generator().manual_seed(d)
    (q, k, v, cu, table, lim), max_kv = batch(gen, ROWS, PREFIX, 16, 2, d, dtype)
    sink = torch.randn(16, generator=gen).to(DEV) if sinks else None
    scale = d ** -0.5
    out = torch.empty_like(q)
    want = torch_paged_attention(q.float(), k.float(), v.float(), cu, table, lim, PS, scale,
                                 ROWS[0], max_kv, torch.empty(q.shape, device=DEV), window=window,
                                 sinks=sink)

    def run():
        return triton_paged_attention(q, k, v, cu, table, lim, PS, scale, 0, 0, out,
                                      window=window, sinks=sink)
    err = row_err(run(), want)
    ms = timed(run)
    torch_ms = timed(lambda: torch_sdpa_attention(q, k, v, cu, table, lim, PS, scale, ROWS[0],
                                                  max_kv, torch.empty_like(q), window=window,
                                                  sinks=sink), reps=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn(q.shape, generator=gen).to(DEV, dtype))
    graph.replay()
    replay = out.clone()
    graph_err = row_err(replay, run())
    before = kernel_cache_size()
    for rows in ALIGNMENTS:                         # other alignments of T
        o = torch.empty_like(q[:rows])
        triton_paged_attention(q[:rows], k, v, cu.clamp_max(rows), table, lim[:rows], PS, scale,
                               0, 0, o, window=window, sinks=sink)
    report(check="attention", head_dim=d, dtype=str(dtype), window=window, sinks=sinks,
           rel_err=err, tol=TOL[dtype], triton_ms=round(ms, 3), torch_ms=round(torch_ms, 3),
           graph_replay_err=graph_err, new_compiles=kernel_cache_size() - before)
    if graph_err > 0:
        failed.append("graph replay differs")


def mla() -> None:
    gen, dims, heads = torch.Generator().manual_seed(1), MLADims(512, 64, 128, 128), 16
    (q, _, _, cu, table, lim), _ = batch(gen, MLA_ROWS, MLA_PREFIX, heads, 1, 192, torch.bfloat16)
    slots = (table.numel() + 1) * PS
    kv = torch.randn(slots, 576, generator=gen).to(DEV, torch.bfloat16)
    kv_b = (torch.randn(heads * 256, 512, generator=gen) * 0.05).to(DEV, torch.bfloat16)

    def args(dtype, out=None):
        return MLAArgs(q.to(dtype), kv.to(dtype), kv_b.to(dtype), cu, table, lim,
                       out if out is not None else torch.empty(q.shape[0], heads, 128, device=DEV,
                                                               dtype=dtype), PS, 192 ** -0.5, dims)
    out = torch.empty(q.shape[0], heads, 128, device=DEV, dtype=torch.bfloat16)
    a = args(torch.bfloat16, out)
    got = triton_mla_prefill(a).clone()
    for form in ("expanded", "absorbed"):
        report(check="mla_prefill", form=form, rel_err=row_err(
            got, mla_attention(args(torch.float32), form=form)), tol=TOL[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_mla_prefill(a)
    graph.replay()
    report(check="mla_prefill", triton_ms=round(timed(lambda: triton_mla_prefill(a)), 3),
           torch_ms=round(timed(lambda: mla_attention(args(torch.bfloat16)), reps=2), 3),
           graph_replay_err=row_err(out, got))


def main() -> int:
    for d in (64, 80, 96, 128, 192, 256):
        attention(d, torch.bfloat16, 0, False)
    attention(256, torch.float32, 0, False)
    attention(256, torch.bfloat16, 128, True)
    attention(64, torch.bfloat16, 128, True)
    mla()
    print(json.dumps({"failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

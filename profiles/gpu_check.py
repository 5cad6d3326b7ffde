#!/usr/bin/env python
"""The one-call GPU check: everything graphcp claims on a GPU, measured in one run on one H200.

    python profiles/gpu_check.py --out profiles/out          # on the GPU machine: < 8 minutes, no downloads
    python profiles/gpu_check.py --dry-run --out /tmp/gc     # on CPU: tiny shapes, CUDA parts skipped (CI)

Parts (each guarded: a failure is recorded as FAILED and the rest still runs):
  a. graphcp's Triton kernels (paged varlen attention, KV write) against the torch reference, bf16, up to 32k
     tokens: causal single sequences, and varlen batches with cached prefixes and padding rows.
  b. Triton attention TFLOP/s at 8k and 32k causal (CUDA events, median), with torch SDPA (flash) alongside.
  c. A ~1B random Llama checkpoint (made locally): graph replay vs eager logits and prefill latency at
     1x256, 8x128, 1x2048, 1x8192; HF transformers (sdpa) on the same weights and shapes.
  d. CP=2 zigzag as two processes sharing the GPU (gloo), graph mode, against the CP=1 logits.
  e. The block-scaled FP8 GEMM (Triton) against its torch form and the dequantized product, and its TFLOP/s
     at the 1B model's FFN shapes next to bf16 torch.matmul.
  f. Capture on a dirty pool (a subprocess): a large block is filled with a non-zero pattern and freed, then
     an engine with the torch attention kernel (a graph break that reads lengths on the host) captures its
     buckets; every batch must replay as a graph and equal eager.
  g. The DSA Triton kernels (indexer scoring, sparse MLA) and the grouped expert GEMM against their torch
     forms, with their times.

Every graph-vs-eager check also requires that the batch really replayed as a graph (a bucket that failed
capture would compare eager with eager); capture failures are recorded in the report.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and prints the tables. Exit code 1 when a part
failed or a correctness check is out of tolerance; performance aims are reported (met / not met) only.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Dense BF16 tensor-core peak assumed for the H200 (SXM; same GH100 tensor cores as H100 SXM), no sparsity.
PEAK_BF16_TFLOPS = 989.0
GPU_BUDGET_S = 450.0          # stop starting new work before 7.5 minutes
DRY_BUDGET_S = 80.0
TRITON_MODULE = "graphcp.kernels.triton_attention"
KV_WRITE_MODULE = "graphcp.kernels.triton_kv_write"
LAYER_OP_MODULES = ("graphcp.kernels.triton_rmsnorm", "graphcp.kernels.triton_rope")
FP8_GEMM_MODULE = "graphcp.kernels.triton_fp8_gemm"


class SkipPart(Exception):
    """A part that cannot run here for an expected reason (recorded as skipped, not FAILED)."""


class Report:
    """Results of every part, the time budget, and the markdown/JSON writers."""

    def __init__(self, dry_run: bool, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.dry_run, self.budget_s = dry_run, budget_s
        self.parts: dict[str, dict] = {}
        self.checks: list[dict] = []       # correctness: value vs tolerance
        self.kernel_perf: list[dict] = []
        self.timings: list[dict] = []      # prefill latency per shape
        self.cp: list[dict] = []
        self.fp8_perf: list[dict] = []
        self.aims: list[dict] = []
        self.info: dict = {}
        self.current: str | None = None    # the part running now (the watchdog marks it if it hangs)
        self.current_t0 = self.t0

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run_part(self, key: str, title: str, fn, *, needs_cuda: bool, min_left_s: float) -> None:  # noqa: ANN001
        print(f"\n== part {key}: {title}", flush=True)
        if (needs_cuda and self.dry_run) or (not self.dry_run and not _cuda()):
            note = "skipped: no CUDA" + (" (dry run)" if self.dry_run else "; on a CPU machine use --dry-run")
            print(f"   {note}")
            self.parts[key] = {"title": title, "status": "skipped", "note": note, "seconds": 0.0}
            return
        if self.left() < min_left_s:
            note = f"skipped: time budget ({self.left():.0f} s left, part needs ~{min_left_s:.0f} s)"
            print(f"   {note}")
            self.parts[key] = {"title": title, "status": "skipped", "note": note, "seconds": 0.0}
            return
        t = time.monotonic()
        self.parts[key] = {"title": title, "status": "running", "note": "", "seconds": 0.0}
        self.current, self.current_t0 = key, t
        try:
            note = fn(self) or ""
            status = "ok"
        except SkipPart as e:
            status, note = "skipped", f"skipped: {e}"
        except Exception as e:  # noqa: BLE001 - one part's failure must not stop the others
            status, note = "FAILED", f"{type(e).__name__}: {e}".splitlines()[0][:300]
            traceback.print_exc()
        finally:
            if _cuda():
                import torch
                torch.cuda.empty_cache()
        secs = time.monotonic() - t
        self.current = None
        self.parts[key] = {"title": title, "status": status, "note": note, "seconds": round(secs, 1)}
        print(f"   part {key}: {status} in {secs:.1f} s {('- ' + note) if note else ''}", flush=True)

    def check(self, part: str, name: str, metric: str, value: float, tol: float, **extra) -> None:
        ok = value <= tol
        self.checks.append({"part": part, "check": name, "metric": metric, "value": value, "tolerance": tol,
                            "ok": ok, **extra})
        print(f"   {'ok  ' if ok else 'FAIL'} {name}: {metric} {value:.3e} (tol {tol:.0e})"
              + "".join(f" {k}={v}" for k, v in extra.items()), flush=True)

    def aim(self, name: str, measured: float | None, target: float, unit: str, higher_is_better: bool = True) -> None:
        if measured is None:
            status = "n/a"
        elif self.dry_run:
            status = "n/a (dry run)"
        else:
            status = "met" if (measured >= target if higher_is_better else measured <= target) else "not met"
        self.aims.append({"aim": name, "measured": measured, "target": target, "unit": unit, "status": status})

    @property
    def failed(self) -> bool:
        return any(p["status"] == "FAILED" for p in self.parts.values()) or any(not c["ok"] for c in self.checks)

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "budget_s": self.budget_s, "elapsed_s": round(self.elapsed(), 1),
                "peak_bf16_tflops_assumed": PEAK_BF16_TFLOPS, "info": self.info, "parts": self.parts,
                "checks": self.checks, "kernel_perf": self.kernel_perf, "timings": self.timings, "cp": self.cp,
                "fp8_perf": self.fp8_perf, "aims": self.aims, "failed": self.failed}

    def markdown(self) -> str:
        i = self.info
        out = ["# graphcp GPU check", "",
               f"- device: {i.get('device')}; torch {i.get('torch')}; triton {i.get('triton')}; "
               f"transformers {i.get('transformers')}; flashinfer {i.get('flashinfer')}; "
               f"engine attention kernel {i.get('attention_kernel')}",
               f"- {'DRY RUN (CPU, tiny shapes; CUDA parts skipped)' if self.dry_run else 'full run'}; "
               f"elapsed {self.elapsed():.0f} s of a {self.budget_s:.0f} s budget; "
               f"bf16 peak assumed {PEAK_BF16_TFLOPS:.0f} TFLOP/s (H200 SXM dense)", "",
               "## Parts", "", "| part | what | status | s | note |", "|---|---|---|---:|---|"]
        for key, p in self.parts.items():
            out.append(f"| {key} | {p['title']} | {p['status']} | {p['seconds']} | {_md(p['note'])} |")
        out += ["", "## Correctness", "", "| part | check | metric | value | tolerance | result | detail |",
                "|---|---|---|---:|---:|---|---|"]
        for c in self.checks:
            extra = ", ".join(f"{k}={v}" for k, v in c.items()
                              if k not in ("part", "check", "metric", "value", "tolerance", "ok"))
            out.append(f"| {c['part']} | {c['check']} | {c['metric']} | {c['value']:.3e} | {c['tolerance']:.0e} | "
                       f"{'ok' if c['ok'] else 'FAILED'} | {_md(extra)} |")
        if self.kernel_perf:
            out += ["", "## Attention kernel throughput (causal, single sequence, bf16)", "",
                    "| shape | triton ms | triton TFLOP/s | % of peak | torch SDPA flash ms | SDPA TFLOP/s | "
                    "flashinfer TFLOP/s |", "|---|---:|---:|---:|---:|---:|---:|"]
            for k in self.kernel_perf:
                out.append(f"| {k['shape']} | {k['triton_ms']:.3f} | {k['triton_tflops']:.1f} | "
                           f"{k['pct_peak']:.1f} | {_fmt(k.get('sdpa_ms'), '.3f')} | "
                           f"{_fmt(k.get('sdpa_tflops'), '.1f')} | {_fmt(k.get('flashinfer_tflops'), '.1f')} |")
        sweeps = [k for k in self.kernel_perf if k.get("tiles")]
        if sweeps:
            names = [f"{bm}x{bn} w{w} s{st}" for bm, bn, w, st in TILE_SWEEP]
            out += ["", "## Triton tile sweep (ms; BLOCK_M x BLOCK_N, warps, stages)", "",
                    "| shape | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
            for k in sweeps:
                out.append(f"| {k['shape']} | " + " | ".join(_fmt(k["tiles"].get(n), ".3f") for n in names) + " |")
        if self.fp8_perf:
            out += ["", "## FP8 block-scaled GEMM (Triton, 1x128 activation groups, 128x128 weight blocks)", "",
                    "| shape (M x N x K) | fp8 ms | fp8 TFLOP/s | bf16 torch.matmul ms | bf16 TFLOP/s | fp8 / bf16 |",
                    "|---|---:|---:|---:|---:|---:|"]
            for f in self.fp8_perf:
                out.append(f"| {f['shape']} | {f['fp8_ms']:.3f} | {f['fp8_tflops']:.1f} | {f['bf16_ms']:.3f} | "
                           f"{f['bf16_tflops']:.1f} | {f['fp8_tflops'] / f['bf16_tflops']:.2f}x |")
        out += ["", "## Prefill latency (median ms; engine.prefill wall time incl. logits to host)", "",
                "| shape | graphcp eager | graphcp graph | HF transformers | graph speedup (eager/graph) | "
                "graphcp eager vs HF (HF/eager) | graph mode, bucket |", "|---|---:|---:|---:|---:|---:|---|"]
        for t in self.timings:
            out.append(f"| {t['shape']} | {_fmt(t.get('eager_ms'), '.2f')} | {_fmt(t.get('graph_ms'), '.2f')} | "
                       f"{_fmt(t.get('hf_ms'), '.2f')} | {_fmt(t.get('graph_speedup'), '.2f', 'x')} | "
                       f"{_fmt(t.get('eager_vs_hf'), '.2f', 'x')} | {t.get('mode')}, {t.get('bucket')} |")
        if self.cp:
            out += ["", "## CP=2 zigzag (two rank processes sharing one device) vs CP=1", "",
                    "| shape | mode | bucket | per-rank tokens | max rel err vs CP=1 | eager ms | graph ms |",
                    "|---|---|---:|---|---:|---:|---:|"]
            for c in self.cp:
                out.append(f"| {c['shape']} | {c['mode']} | {c['bucket']} | {c['per_rank_tokens']} | "
                           f"{c['rel_err']:.2e} | {_fmt(c.get('eager_ms'), '.2f')} | "
                           f"{_fmt(c.get('graph_ms'), '.2f')} |")
        out += ["", "## Aims", "", "| aim | measured | target | status |", "|---|---:|---:|---|"]
        for a in self.aims:
            out.append(f"| {a['aim']} | {_fmt(a['measured'], '.2f', a['unit'])} | {a['target']:g}{a['unit']} | "
                       f"{a['status']} |")
        out += ["", f"**Overall: {'FAILED' if self.failed else 'passed'}** (parts and correctness; aims are "
                "reported, not enforced)", ""]
        return "\n".join(out)


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _fmt(v, spec: str, unit: str = "") -> str:  # noqa: ANN001
    return "-" if v is None else f"{format(v, spec)}{unit}"


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _triton_ready() -> str | None:
    """None when graphcp's Triton kernels can run here, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    for mod in (TRITON_MODULE, KV_WRITE_MODULE, *LAYER_OP_MODULES):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} does not exist in this build"
    return None


# -- part a: Triton kernels vs the torch reference --------------------------------------------------
def _paged_case(q_lens: list[int], prefixes: list[int], hq: int, hkv: int, d: int, page_size: int, pad: int,
                dtype, device: str, seed: int):  # noqa: ANN001
    """Random paged pools, shuffled page tables (page 0 stays the dummy page), queries and row limits."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefixes, q_lens)]
    pages_per_row = max(-(-kv // page_size) for kv in kv_lens)
    num_pages = 1 + len(q_lens) * pages_per_row + 2
    ids = torch.randperm(num_pages - 1, generator=gen)[: len(q_lens) * pages_per_row] + 1
    page_rows = ids.view(len(q_lens), pages_per_row)
    shape = (num_pages * page_size, hkv, d)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64)
    limits = torch.cat([torch.arange(n, dtype=torch.int64) + p + 1 for p, n in zip(prefixes, q_lens)]
                       + [torch.zeros(pad, dtype=torch.int64)])
    q = torch.randn(int(cu[-1]) + pad, hq, d, generator=gen).to(dtype)
    dev = torch.device(device)
    return [t.to(dev) for t in (q, k_pool, v_pool, cu, page_rows, limits)]


def reference_attention(q, k_pool, v_pool, cu, page_rows, limits, page_size: int, scale: float,  # noqa: ANN001
                        max_bytes: int = 3 << 30):
    """torch_paged_attention in fp32, per sequence and in query chunks so 32k x 32k never materializes."""
    import torch

    from graphcp.kernels.torch_ref import torch_paged_attention
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qf, kf, vf = q.float(), k_pool.float(), v_pool.float()
    bounds = cu.tolist()
    hq = q.shape[1]
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        if b == a:
            continue
        kv = int(limits[b - 1])
        rows = max(1, min(b - a, max_bytes // (4 * 4 * hq * max(kv, 1))))
        for c in range(a, b, rows):
            e = min(b, c + rows)
            lim = limits[c:e]
            sub_cu = torch.tensor([0, e - c], dtype=cu.dtype, device=cu.device)
            torch_paged_attention(qf[c:e], kf, vf, sub_cu, page_rows[s:s + 1], lim, page_size, scale, e - c,
                                  int(lim.max()), out[c:e])
    return out


def part_a(rep: Report) -> str:
    import torch
    why = _triton_ready()
    if why:
        if rep.dry_run:
            raise SkipPart(why)
        raise RuntimeError(f"cannot test the Triton kernels: {why}")
    from graphcp.kernels.triton_attention import triton_paged_attention
    from graphcp.kernels.triton_kv_write import triton_kv_write
    device = "cpu" if rep.dry_run else "cuda"
    bf16 = torch.bfloat16
    if rep.dry_run:   # Triton's interpreter: tiny shapes
        cases = [("causal 1x40 h4/2 d64 p16 fp32", [40], [0], 4, 2, 64, 16, 0, torch.float32, 1e-5),
                 ("causal 1x40 h4/2 d64 p16 bf16", [40], [0], 4, 2, 64, 16, 0, bf16, 2e-2),
                 ("varlen [7,20,1]+prefix [0,5,33] h4/2 d64 p1 bf16", [7, 20, 1], [0, 5, 33], 4, 2, 64, 1, 3, bf16,
                  2e-2)]
    else:
        cases = [("causal 1x1024 h32/8 d128 p16", [1024], [0], 32, 8, 128, 16, 0, bf16, 2e-2),
                 ("causal 1x8192 h32/4 d64 p16", [8192], [0], 32, 4, 64, 16, 0, bf16, 2e-2),
                 ("causal 1x32768 h32/8 d128 p16", [32768], [0], 32, 8, 128, 16, 0, bf16, 2e-2),
                 ("varlen [1000,3000,17,4096]+prefix [0,2048,500,8192] h32/8 d128 p16",
                  [1000, 3000, 17, 4096], [0, 2048, 500, 8192], 32, 8, 128, 16, 37, bf16, 2e-2),
                 ("varlen [513,77,2048]+prefix [100,0,4000] h32/4 d64 p1", [513, 77, 2048], [100, 0, 4000], 32, 4, 64,
                  1, 5, bf16, 2e-2)]
    for i, (name, q_lens, prefixes, hq, hkv, d, ps, pad, dtype, tol) in enumerate(cases):
        if rep.left() < (5 if rep.dry_run else 60):
            return f"stopped early for the time budget after {i} attention cases"
        q, kp, vp, cu, rows, lim = _paged_case(q_lens, prefixes, hq, hkv, d, ps, pad, dtype, device, seed=100 + i)
        scale = d ** -0.5
        out = torch.full_like(q, float("nan"))
        triton_paged_attention(q, kp, vp, cu, rows, lim, ps, scale, 0, 0, out)   # 0, 0: capturable usage
        ref = reference_attention(q, kp, vp, cu, rows, lim, ps, scale)
        n = int(cu[-1])
        nan = bool(torch.isnan(out).any())
        pad_ok = bool((out[n:] == 0).all())
        err = float((out[:n].float() - ref[:n]).abs().max()) if not nan else float("inf")
        rep.check("a", f"triton attention {name}", "max abs err", err if pad_ok else float("inf"), tol,
                  padding_rows_zero=pad_ok)
        for fi_name, fi_fn in _flashinfer_kernels(rep, dtype, d):
            fi_out = torch.full_like(q, float("nan"))
            fi_fn(q, kp, vp, cu, rows, lim, ps, scale, max(q_lens), max(p + n for p, n in zip(prefixes, q_lens)),
                  fi_out)
            fi_err = float((fi_out[:n].float() - ref[:n]).abs().max())
            rep.check("a", f"{fi_name} attention {name}", "max abs err",
                      fi_err if bool((fi_out[n:] == 0).all()) else float("inf"), tol)
        del q, kp, vp, out, ref
    # KV write: scatter rows into shuffled slots; padding rows all point at the dummy slot 0.
    n_rows, pad, hkv, d, slots_total = ((30, 3, 2, 64, 64) if rep.dry_run else (32768, 64, 8, 128, 40000))
    gen = torch.Generator().manual_seed(7)
    slots = torch.cat([torch.randperm(slots_total - 16, generator=gen)[:n_rows] + 16,
                       torch.zeros(pad, dtype=torch.int64)]).to(device)
    k = torch.randn(n_rows + pad, hkv, d, generator=gen).to(bf16).to(device)
    v = torch.randn(n_rows + pad, hkv, d, generator=gen).to(bf16).to(device)
    kp = torch.zeros(slots_total, hkv, d, dtype=bf16, device=device)
    vp = torch.zeros_like(kp)
    triton_kv_write(kp, vp, slots, k, v)
    rk, rv = torch.zeros_like(kp), torch.zeros_like(vp)
    rk[slots[:n_rows]] = k[:n_rows]
    rv[slots[:n_rows]] = v[:n_rows]
    mismatch = float(((kp[1:] != rk[1:]).any() | (vp[1:] != rv[1:]).any()).item())
    rep.check("a", f"triton kv_write {n_rows}+{pad} pad rows h{hkv} d{d} bf16", "slots differing", mismatch, 0.0)
    _check_layer_ops(rep, device)
    return ""


def _check_layer_ops(rep: Report, device: str) -> None:
    """The Triton RMSNorm and rotary embedding against their torch forms, on hidden rows and on q heads
    sliced from a fused qkv output (strided, as the model passes them)."""
    import torch

    from graphcp.models.layers import rms_norm_torch, rope_torch
    from graphcp.kernels.triton_rmsnorm import triton_rms_norm
    from graphcp.kernels.triton_rope import triton_rope
    t, hidden, heads, d = (9, 64, 2, 64) if rep.dry_run else (8192, 4096, 32, 128)
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(t, hidden, generator=gen) * 4).to(bf16).to(device)
    w = torch.randn(hidden, generator=gen).to(bf16).to(device)
    qkv = torch.randn(t, 3 * heads * d, generator=gen).to(bf16).to(device)
    q, wd = qkv[:, : heads * d].view(t, heads, d), w[:d].contiguous()
    angles = (torch.rand(t, d // 2, generator=gen) * 100).to(device)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(bf16)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(bf16)
    res = (torch.randn(t, hidden, generator=gen) * 4).to(bf16).to(device)
    cases = (("rmsnorm rows", triton_rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)),
             ("rmsnorm + residual add rows", triton_rms_norm(x, w, 1e-6, res)[0], rms_norm_torch(res + x, w, 1e-6)),
             ("rmsnorm q heads of fused qkv", triton_rms_norm(q, wd, 1e-6), rms_norm_torch(q, wd, 1e-6)),
             ("rope q heads of fused qkv", triton_rope(q, cos, sin), rope_torch(q, cos[:, None], sin[:, None])))
    for name, got, ref in cases:
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        rep.check("a", f"triton {name} {tuple(ref.shape)} bf16", "max rel err", err, 2e-2 if rep.dry_run else 1e-2)


def _flashinfer_kernels(rep: Report, dtype, head_dim: int) -> list:  # noqa: ANN001
    """[(name, kernel)] for the flashinfer variant this GPU would use, when flashinfer is installed and fits."""
    import torch

    from graphcp.kernels import flashinfer_attention as fi
    if rep.dry_run or fi.unsupported_reason(torch.device("cuda"), dtype, head_dim, True) is not None:
        return []
    variant = fi.variant_for_capability(torch.cuda.get_device_capability())
    fn = fi.flashinfer_trtllm_attention if variant == "trtllm" else fi.flashinfer_paged_attention
    return [(f"flashinfer-{variant}", fn)]


# -- part b: attention TFLOP/s ------------------------------------------------------------------------
def _cuda_ms(fn, warmup: int, reps: int) -> float:  # noqa: ANN001
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


TILE_SWEEP = ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
              (64, 32, 4, 3))


def _tile_sweep(rep: Report, kernel, args: tuple, reps: int, notes: list) -> dict:  # noqa: ANN001
    """ms per (BLOCK_M, BLOCK_N, num_warps, num_stages), so defaults can follow measurements."""
    results = {}
    for bm, bn, warps, stages in TILE_SWEEP:
        if rep.left() < 45:
            notes.append("tile sweep cut short for the time budget")
            break
        try:
            ms = _cuda_ms(lambda: kernel(*args, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages), 1, reps)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one config
            notes.append(f"tiles {bm}x{bn} w{warps} s{stages}: {type(e).__name__}")
            continue
        results[f"{bm}x{bn} w{warps} s{stages}"] = ms
    return results


def part_b(rep: Report) -> str:
    import torch
    why = _triton_ready()
    if why:
        raise RuntimeError(f"cannot time the Triton kernel: {why}")
    from graphcp.kernels.triton_attention import triton_paged_attention
    notes = []
    for tokens, hq, hkv, d in ((8192, 32, 8, 128), (32768, 32, 8, 128), (8192, 32, 4, 64), (32768, 32, 4, 64)):
        if rep.left() < 40:
            notes.append("stopped early for the time budget")
            break
        q, kp, vp, cu, rows, lim = _paged_case([tokens], [0], hq, hkv, d, 16, 0, torch.bfloat16, "cuda", seed=tokens)
        out = torch.empty_like(q)
        scale = d ** -0.5
        reps = 10 if tokens <= 8192 else 5
        ms = _cuda_ms(lambda: triton_paged_attention(q, kp, vp, cu, rows, lim, 16, scale, 0, 0, out), 2, reps)
        flops = 4 * tokens * tokens * hq * d / 2
        row = {"shape": f"causal {tokens} tokens, h{hq}/{hkv}, d{d}, page 16", "tokens": tokens, "head_dim": d,
               "triton_ms": ms, "triton_tflops": flops / ms / 1e9,
               "pct_peak": 100 * flops / ms / 1e9 / PEAK_BF16_TFLOPS}
        try:   # torch SDPA on contiguous K/V as a yardstick (kv heads expanded outside the timing)
            sq = q.transpose(0, 1)[None]
            kc = kp[: tokens].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None].contiguous()
            vc = vp[: tokens].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None].contiguous()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            s_ms = _cuda_ms(lambda: sdpa(sq, kc, vc, is_causal=True, scale=scale), 2, reps)
            row.update(sdpa_ms=s_ms, sdpa_tflops=flops / s_ms / 1e9)
        except Exception as e:  # noqa: BLE001
            notes.append(f"SDPA yardstick failed: {type(e).__name__}")
        for fi_name, fi_fn in _flashinfer_kernels(rep, torch.bfloat16, d):
            f_ms = _cuda_ms(lambda: fi_fn(q, kp, vp, cu, rows, lim, 16, scale, tokens, tokens, out), 2, reps)
            row.update(flashinfer=fi_name, flashinfer_ms=f_ms, flashinfer_tflops=flops / f_ms / 1e9)
        if d == 128:
            row["tiles"] = _tile_sweep(rep, triton_paged_attention, (q, kp, vp, cu, rows, lim, 16, scale, 0, 0, out),
                                       reps, notes)
        rep.kernel_perf.append(row)
        print(f"   {row['shape']}: triton {ms:.3f} ms = {row['triton_tflops']:.1f} TFLOP/s "
              f"({row['pct_peak']:.1f}% of peak)", flush=True)
    return "; ".join(notes)


# -- part c: the 1B model, graphs vs eager vs HF -------------------------------------------------------
def _shapes(rep: Report) -> list[tuple[str, int, int]]:
    if rep.dry_run:
        return [("1x16", 1, 16), ("2x24", 2, 24)]
    return [("1x256", 1, 256), ("8x128", 8, 128), ("1x2048", 1, 2048), ("1x8192", 1, 8192)]


def _batch(vocab: int, n: int, length: int, tag: str, seed: int) -> list[tuple[str, list[int]]]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    return [(f"{tag}_{i}", torch.randint(0, vocab, (length,), generator=gen).tolist()) for i in range(n)]


def _prefill(engine, batch, force_eager: bool = False):  # noqa: ANN001
    from graphcp import Request
    out = engine.prefill([Request(rid, ids) for rid, ids in batch], force_eager=force_eager)
    for rid, _ in batch:
        engine.release(rid)
    return out


def _time_prefill(engine, batch, force_eager: bool, reps: int) -> float:  # noqa: ANN001
    _prefill(engine, batch, force_eager)               # warm: kernel specializations, allocator
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        _prefill(engine, batch, force_eager)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _rel_err(a, b) -> float:  # noqa: ANN001
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _checkpoint(rep: Report, workdir: str) -> str:
    import torch

    from graphcp.models.random_checkpoint import DEMO_QWEN3, LLAMA_1B, make_random_checkpoint
    if rep.dry_run:
        return make_random_checkpoint(os.path.join(workdir, "demo-qwen3"), DEMO_QWEN3, seed=0)
    t = time.monotonic()
    path = make_random_checkpoint(os.path.join(workdir, "llama-1b-random"), LLAMA_1B, seed=0, dtype=torch.bfloat16)
    rep.info["checkpoint_s"] = round(time.monotonic() - t, 1)
    return path


def _engine_args(rep: Report, path: str, **kw):  # noqa: ANN001
    from graphcp import EngineArgs
    if rep.dry_run:
        return EngineArgs(model_path=path, device="cpu", max_total_tokens=4096, cuda_graph_buckets=(16, 32, 64), **kw)
    return EngineArgs(model_path=path, device="cuda", max_total_tokens=65536,
                      cuda_graph_buckets=kw.pop("cuda_graph_buckets", (256, 1024, 2048, 8192)), **kw)


def part_c(rep: Report, state: dict) -> str:
    import torch

    from graphcp import Engine
    from graphcp.models import read_model_config
    path = state["checkpoint"] = _checkpoint(rep, state["workdir"])
    vocab = read_model_config(path).vocab_size
    reps = 3 if rep.dry_run else 5
    tol = 1e-4 if rep.dry_run else 2e-2       # bf16: padded GEMM shapes may pick other cuBLAS tilings
    notes = []
    t = time.monotonic()
    with Engine(_engine_args(rep, path)) as engine:
        rep.info["engine_start_s"] = round(time.monotonic() - t, 1)
        rep.info["graph_buckets"] = engine.stats()["graph_buckets"]
        rep.info["attention_kernel"] = engine.stats()["attention_kernel"]
        rep.info["capture_failures"] = engine.stats()["capture_failures"]
        for i, (shape, n, length) in enumerate(_shapes(rep)):
            if rep.left() < (5 if rep.dry_run else 45):
                notes.append(f"stopped at {shape} for the time budget")
                break
            batch = _batch(vocab, n, length, f"c{i}", seed=i)
            g = _prefill(engine, batch)
            e = _prefill(engine, batch, force_eager=True)
            state.setdefault("cp1_logits", {})[shape] = g.logits
            rep.check("c", f"graph vs eager logits {shape}", "max rel err", _rel_err(g.logits, e.logits), tol,
                      mode=g.mode, bucket=g.graph_bucket)
            _require_graph(rep, "c", shape, g)
            row = {"shape": shape, "mode": g.mode, "bucket": g.graph_bucket, "eager_reason": g.eager_reason}
            row["eager_ms"] = _time_prefill(engine, batch, True, reps)
            row["graph_ms"] = _time_prefill(engine, batch, False, reps)
            row["graph_speedup"] = row["eager_ms"] / row["graph_ms"]
            state.setdefault("eager_logits", {})[shape] = e.logits
            rep.timings.append(row)
            print(f"   {shape}: eager {row['eager_ms']:.2f} ms, graph {row['graph_ms']:.2f} ms "
                  f"({row['graph_speedup']:.2f}x), mode {g.mode} bucket {g.graph_bucket}", flush=True)
    if _cuda() and not rep.dry_run:
        torch.cuda.empty_cache()
    notes.append(_hf(rep, state, path, vocab, reps))
    return "; ".join(n for n in notes if n)


def _hf(rep: Report, state: dict, path: str, vocab: int, reps: int) -> str:
    import torch
    if importlib.util.find_spec("transformers") is None:
        return "HF skipped: transformers is not installed"
    if rep.left() < (10 if rep.dry_run else 45):
        return "HF skipped: time budget"
    import transformers
    rep.info["transformers"] = transformers.__version__
    device = "cpu" if rep.dry_run else "cuda"
    dtype = torch.float32 if rep.dry_run else torch.bfloat16
    auto = transformers.AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except TypeError:                                   # transformers < 4.56 spells it torch_dtype
        model = auto.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()

    @torch.inference_mode()
    def forward(ids: torch.Tensor) -> torch.Tensor:
        try:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        except TypeError:
            logits = model(input_ids=ids, use_cache=False).logits
        return logits[:, -1].float().cpu()              # same hand-off as engine.prefill: fp32 logits on host

    for i, (shape, n, length) in enumerate(_shapes(rep)):
        row = next((r for r in rep.timings if r["shape"] == shape), None)
        if row is None or rep.left() < (3 if rep.dry_run else 20):
            continue
        batch = _batch(vocab, n, length, f"c{i}", seed=i)
        ids = torch.tensor([ids for _, ids in batch], device=device)       # equal lengths: no padding
        logits = forward(ids)
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            forward(ids)
            times.append((time.perf_counter() - t) * 1e3)
        row["hf_ms"] = statistics.median(times)
        row["eager_vs_hf"] = row["hf_ms"] / row["eager_ms"]
        ref = state.get("eager_logits", {}).get(shape)
        if ref is not None:
            rep.check("c", f"graphcp eager vs HF logits {shape}", "max rel err", _rel_err(ref, logits),
                      1e-4 if rep.dry_run else 0.1, note="HF on the same weights" +
                      ("" if rep.dry_run else "; bf16, different kernels"))
        print(f"   {shape}: HF {row['hf_ms']:.2f} ms (graphcp eager is {row['eager_vs_hf']:.2f}x HF speed)", flush=True)
    return ""


# -- part d: CP=2 on one GPU ----------------------------------------------------------------------------
def part_d(rep: Report, state: dict) -> str:
    from graphcp import Engine
    from graphcp.models import read_model_config
    path = state.get("checkpoint") or _checkpoint(rep, state["workdir"])
    vocab = read_model_config(path).vocab_size
    shapes = [s for s in _shapes(rep) if s[0] in (("1x16", "2x24") if rep.dry_run else ("8x128", "1x2048"))]
    cp1 = dict(state.get("cp1_logits", {}))
    missing = [s for s in shapes if s[0] not in cp1]
    if missing:                                       # part c did not run: CP=1 reference here
        with Engine(_engine_args(rep, path)) as ref:
            for shape, n, length in missing:
                i = [s[0] for s in _shapes(rep)].index(shape)
                cp1[shape] = _prefill(ref, _batch(vocab, n, length, f"c{i}", seed=i)).logits
    cp_kw = dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag")
    if not rep.dry_run:
        cp_kw["cuda_graph_buckets"] = (512, 1024)
    tol = 1e-4 if rep.dry_run else 5e-2
    notes = []
    with Engine(_engine_args(rep, path, **cp_kw)) as engine:
        for shape, n, length in shapes:
            if rep.left() < (5 if rep.dry_run else 20):
                notes.append(f"stopped at {shape} for the time budget")
                break
            i = [s[0] for s in _shapes(rep)].index(shape)
            batch = _batch(vocab, n, length, f"c{i}", seed=i)
            out = _prefill(engine, batch)
            err = _rel_err(out.logits, cp1[shape])
            rep.check("d", f"CP=2 zigzag vs CP=1 logits {shape}", "max rel err", err, tol, mode=out.mode,
                      bucket=out.graph_bucket)
            _require_graph(rep, "d", shape, out)
            row = {"shape": shape, "mode": out.mode, "bucket": out.graph_bucket, "per_rank_tokens": out.per_rank_tokens,
                   "rel_err": err, "eager_reason": out.eager_reason}
            if rep.left() > (5 if rep.dry_run else 30):
                row["eager_ms"] = _time_prefill(engine, batch, True, 3)
                row["graph_ms"] = _time_prefill(engine, batch, False, 3)
            rep.cp.append(row)
            if out.mode != "graph":
                notes.append(f"{shape} ran {out.mode}: {out.eager_reason}")
    return "; ".join(notes)


# -- part e: the FP8 block-scaled GEMM ------------------------------------------------------------------
def _fp8_case(m: int, n: int, k: int, offset: int, dtype, device: str, seed: int):  # noqa: ANN001
    """x [m, k], an FP8 weight [n, k] whose column 0 sits ``offset`` into its 128-block (a column shard),
    random block scales, and the weight dequantized in fp32 (the torch form it stands for)."""
    import torch

    from graphcp.models import fp8
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


def part_e(rep: Report) -> str:
    import torch
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec(FP8_GEMM_MODULE) is None:
        if rep.dry_run:
            raise SkipPart("triton or the FP8 GEMM is not installed")
        raise RuntimeError("cannot test the FP8 GEMM: triton or graphcp.kernels.triton_fp8_gemm is missing")
    from graphcp.models.fp8 import fp8_linear_torch
    from graphcp.kernels.triton_fp8_gemm import triton_fp8_linear
    device = "cpu" if rep.dry_run else "cuda"
    if not rep.dry_run and torch.cuda.get_device_capability() < (8, 9):
        raise SkipPart("no FP8 tensor cores (compute capability < 8.9): graphcp dequantizes FP8 at load here")
    dtype = torch.float32 if rep.dry_run else torch.bfloat16
    # Against the torch form (same activation quantization): summation order, and the output's rounding.
    tol_form = 1e-5 if rep.dry_run else 1e-2
    # Against the dequantized product: e4m3 activations carry 3 mantissa bits (each element within 2^-4 of
    # itself); over a K-long sum that averages to a few percent of the output (2-3% measured on random data).
    tol_dense = 5e-2
    cases = ([(5, 192, 256, 0), (33, 192, 256, 80)] if rep.dry_run else
             [(512, 11264, 2048, 0), (2048, 2048, 5632, 0), (333, 1000, 1000, 80)])
    for i, (m, n, k, offset) in enumerate(cases):
        x, w, dense = _fp8_case(m, n, k, offset, dtype, device, seed=300 + i)
        got = triton_fp8_linear(x, w)
        form = fp8_linear_torch(x, w)
        exact = x.float() @ dense.t()
        name = f"fp8 gemm {m}x{n}x{k}" + (f" (K grid offset {offset})" if offset else "")
        rep.check("e", f"{name} vs torch form", "max rel err", _rel_err(got, form), tol_form)
        rep.check("e", f"{name} vs dequantized", "max rel err", _rel_err(got, exact), tol_dense)
        del x, w, dense, got, form, exact
    if rep.dry_run:
        return ""
    notes = []
    for m in (512, 2048, 8192):
        for label, n, k in (("gate_up", 11264, 2048), ("down", 2048, 5632)):
            if rep.left() < 30:
                notes.append("timings stopped for the time budget")
                return "; ".join(notes)
            x, w, dense = _fp8_case(m, n, k, 0, dtype, device, seed=m + n)
            w_bf16 = dense.to(torch.bfloat16)
            flops = 2 * m * n * k
            fp8_ms = _cuda_ms(lambda: triton_fp8_linear(x, w), 3, 10)
            bf16_ms = _cuda_ms(lambda: torch.matmul(x, w_bf16.t()), 3, 10)
            row = {"shape": f"{label} {m}x{n}x{k}", "m": m, "fp8_ms": fp8_ms, "fp8_tflops": flops / fp8_ms / 1e9,
                   "bf16_ms": bf16_ms, "bf16_tflops": flops / bf16_ms / 1e9}
            rep.fp8_perf.append(row)
            print(f"   {row['shape']}: fp8 {fp8_ms:.3f} ms = {row['fp8_tflops']:.0f} TFLOP/s, bf16 matmul "
                  f"{bf16_ms:.3f} ms = {row['bf16_tflops']:.0f} TFLOP/s", flush=True)
    return "; ".join(notes)


def part_g(rep: Report) -> str:
    """DSA and MoE kernels against their torch forms (the interpreter on a dry run)."""
    import torch

    from graphcp.kernels import dsa_torch
    from graphcp.kernels import triton_dsa
    from graphcp.models.moe import _experts_torch
    from graphcp.kernels.triton_moe import triton_experts
    dev, dtype = ("cpu", torch.float32) if rep.dry_run else ("cuda", torch.bfloat16)
    tol = 1e-5 if rep.dry_run else 2e-2
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    # Indexer: rows x heads x dim queries over a sequence's keys; sparse MLA over the top-k of them.
    rows, heads, dim, keys, topk = (6, 16, 32, 40, 8) if rep.dry_run else (4096, 64, 128, 8192, 2048)
    q, w, index_keys = rand(rows, heads, dim), torch.randn(rows, heads, generator=gen).to(dev), rand(keys, dim)
    slots = torch.randperm(keys, generator=gen).view(1, keys).to(dev)
    row_seq = torch.zeros(rows, dtype=torch.long, device=dev)
    limits = torch.linspace(keys // 2, keys, rows).long().to(dev)
    want = dsa_torch.indexer_scores(q, w, index_keys, slots, row_seq, limits)
    got = triton_dsa.indexer_scores(q, w, index_keys, slots, row_seq, limits)
    seen = torch.isfinite(want)
    rep.check("g", f"DSA indexer scores {rows}x{heads}x{dim} over {keys} keys", "max rel err",
              _rel_err(got[seen].float().cpu(), want[seen].float().cpu()), tol)
    selected, shown = dsa_torch.select_topk(want, slots, row_seq, limits, topk)
    mla_heads, latent, rope = (4, 32, 16) if rep.dry_run else (16, 512, 64)
    q_mla, kv = rand(rows, mla_heads, latent + rope), rand(keys, latent + rope)
    ref = dsa_torch.sparse_mla(q_mla, kv, selected, shown, 0.1, latent)
    out = triton_dsa.sparse_mla(q_mla, kv, selected, shown, 0.1, latent)
    rep.check("g", f"sparse MLA {rows}x{mla_heads} heads, top-{topk}", "max rel err",
              _rel_err(out.float().cpu(), ref.float().cpu()), tol)
    # Grouped experts: tokens routed top-k over this rank's experts.
    n, hidden, inter, experts, k = (9, 64, 32, 4, 2) if rep.dry_run else (4096, 2048, 1408, 8, 2)
    x, gate_up, down = rand(n, hidden), rand(experts, 2 * inter, hidden) * 0.05, rand(experts, hidden, inter) * 0.05
    ids = torch.randint(0, experts, (n, k), generator=gen).to(dev)
    weights = torch.rand(n, k, generator=gen).to(dev, dtype)
    ref = _experts_torch(x, ids, weights, gate_up, down, 0)
    out = triton_experts(x, ids, weights, gate_up, down, 0)
    rep.check("g", f"grouped experts {n} tokens top-{k} over {experts} experts", "max rel err",
              _rel_err(out.float().cpu(), ref.float().cpu()), 1e-4 if rep.dry_run else 3e-2)
    if rep.dry_run:
        return "interpreter, tiny shapes"
    ms = {"indexer": _cuda_ms(lambda: triton_dsa.indexer_scores(q, w, index_keys, slots, row_seq, limits), 2, 5),
          "sparse_mla": _cuda_ms(lambda: triton_dsa.sparse_mla(q_mla, kv, selected, shown, 0.1, latent), 2, 5),
          "experts": _cuda_ms(lambda: triton_experts(x, ids, weights, gate_up, down, 0), 2, 5),
          "experts_torch": _cuda_ms(lambda: _experts_torch(x, ids, weights, gate_up, down, 0), 1, 3)}
    rep.info["dsa_moe_kernel_ms"] = ms
    return ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())


def _require_graph(rep: Report, part: str, shape: str, out) -> None:  # noqa: ANN001
    """A check of graphs is void unless the batch replayed as one."""
    rep.check(part, f"replayed as a graph {shape}", "not graph (1) / graph (0)", float(out.mode != "graph"), 0.0,
              mode=out.mode, reason=out.eager_reason)


# -- part f: capture on a dirty pool, in a subprocess ---------------------------------------------------
def part_f(rep: Report, state: dict) -> str:
    import subprocess

    from graphcp.models.random_checkpoint import DEMO_QWEN3, make_random_checkpoint
    path = make_random_checkpoint(os.path.join(state["workdir"], "demo-qwen3"), DEMO_QWEN3)   # small: quick
    cmd = [sys.executable, os.path.abspath(__file__), "--dirty-pool-child", path]
    if rep.dry_run:
        cmd.append("--dry-run")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, rep.left()))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"dirty-pool child exited {proc.returncode}: {proc.stderr[-1500:]}")
    result = json.loads(lines[-1])
    rep.info["dirty_pool"] = result
    for row in result["batches"]:
        rep.check("f", f"dirty pool, torch kernel: graph vs eager {row['shape']}", "max rel err", row["rel_err"],
                  1e-4 if rep.dry_run else 2e-2, mode=row["mode"], bucket=row["bucket"])
        _require_graph(rep, "f", row["shape"], types.SimpleNamespace(mode=row["mode"], eager_reason=row["reason"]))
    return f"{result['dirty_bytes'] / 2**30:.1f} GiB dirtied; capture failures: {result['capture_failures'] or 'none'}"


def dirty_pool_child(path: str, dry_run: bool) -> int:
    """Fill and free a large block with a non-zero pattern (CUDA does not zero reused memory), then
    capture with the torch kernel, whose break reads host lengths computed by the captured segment."""
    import torch

    from graphcp import Engine, EngineArgs, Request
    from graphcp.models import read_model_config
    dirty = 0
    if not dry_run:
        free = torch.cuda.mem_get_info()[0]
        block = torch.empty(min(free // 4, 16 << 30), dtype=torch.uint8, device="cuda").fill_(0x7F)
        dirty = block.numel()
        del block
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    kw = dict(device="cpu", max_total_tokens=4096) if dry_run else dict(device="cuda", max_total_tokens=65536)
    buckets = (16, 64) if dry_run else (16, 64, 128)          # CI's dry run: fewer captures
    args = EngineArgs(model_path=path, attention_kernel="torch", cuda_graph_buckets=buckets, **kw)
    vocab = read_model_config(path).vocab_size
    rows = []
    with Engine(args) as engine:
        failures = engine.stats()["capture_failures"]
        for i, (n, length) in enumerate([(1, 12), (2, 24)] if dry_run else [(1, 12), (2, 40), (4, 30)]):
            batch = [Request(f"f{i}-{j}", [(7 * j + 3 * t + i) % vocab for t in range(length)]) for j in range(n)]
            g = engine.prefill(batch)
            for r in batch:
                engine.release(r.rid)
            e = engine.prefill(batch, force_eager=True)
            for r in batch:
                engine.release(r.rid)
            rows.append({"shape": f"{n}x{length}", "mode": g.mode, "bucket": g.graph_bucket,
                         "reason": g.eager_reason, "rel_err": _rel_err(g.logits, e.logits)})
    print(json.dumps({"dirty_bytes": dirty, "capture_failures": {str(k): v for k, v in failures.items()},
                      "batches": rows}), flush=True)
    return 0


# -- aims and main --------------------------------------------------------------------------------------
def add_aims(rep: Report) -> None:
    rows = {t["shape"]: t for t in rep.timings}
    rep.aim("graph >= 2x eager at 8x128", rows.get("8x128", {}).get("graph_speedup"), 2.0, "x")
    rep.aim("graph >= 1.1x eager at 1x2048", rows.get("1x2048", {}).get("graph_speedup"), 1.1, "x")
    perf = [k for k in rep.kernel_perf if k["tokens"] == 32768 and k["head_dim"] == 128]
    rep.aim(f"triton attention >= 40% of bf16 peak ({PEAK_BF16_TFLOPS:.0f} TFLOP/s) at 32k causal, d128",
            perf[0]["pct_peak"] if perf else None, 40.0, "%")
    for shape, _, _ in _shapes(rep):
        rep.aim(f"graphcp eager >= HF speed at {shape}", rows.get(shape, {}).get("eager_vs_hf"), 1.0, "x")
    big = [f["fp8_tflops"] / f["bf16_tflops"] for f in rep.fp8_perf if f["m"] == 8192]
    rep.aim("fp8 GEMM >= 1.3x bf16 torch.matmul at M=8192 (1B FFN shapes, worst)", min(big) if big else None,
            1.3, "x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "profiles", "out"), help="where the json/md go")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, CUDA parts skipped (CI)")
    parser.add_argument("--workdir", default=None, help="keep the generated checkpoint here (reused by a rerun); "
                        "default: a temporary directory removed at the end")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting work after this many seconds")
    parser.add_argument("--parts", default="abcdefg", help="subset of parts to run, e.g. 'ac'")
    parser.add_argument("--dirty-pool-child", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"          # before anything imports triton
    if ns.dirty_pool_child:
        return dirty_pool_child(ns.dirty_pool_child, ns.dry_run)
    import torch
    rep = Report(ns.dry_run, ns.budget_s or (DRY_BUDGET_S if ns.dry_run else GPU_BUDGET_S))
    if ns.dry_run:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    triton = importlib.util.find_spec("triton")
    device = torch.cuda.get_device_name(0) if _cuda() and not ns.dry_run else f"cpu ({platform.machine()})"
    rep.info.update(device=device,
                    torch=torch.__version__, triton=_version("triton") if triton else None,
                    transformers=_version("transformers"), flashinfer=_version("flashinfer-python"),
                    python=platform.python_version(),
                    started=datetime.datetime.now().isoformat(timespec="seconds"))
    os.makedirs(ns.out, exist_ok=True)
    workdir = ns.workdir or tempfile.mkdtemp(prefix="graphcp_gpu_check_")

    def cleanup() -> None:
        if ns.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    _watchdog(rep, ns.out, rep.budget_s + (10.0 if ns.dry_run else 25.0), cleanup)
    state: dict = {"workdir": workdir}
    try:
        if "a" in ns.parts:
            rep.run_part("a", "Triton kernels vs torch reference", part_a, needs_cuda=False,
                         min_left_s=5 if ns.dry_run else 90)
        if "b" in ns.parts:
            rep.run_part("b", "attention TFLOP/s (triton)", part_b, needs_cuda=True, min_left_s=60)
        if "e" in ns.parts:
            rep.run_part("e", "FP8 block-scaled GEMM (triton) vs torch, TFLOP/s", part_e, needs_cuda=False,
                         min_left_s=5 if ns.dry_run else 60)
        if "c" in ns.parts:
            rep.run_part("c", ("demo-size Qwen3" if ns.dry_run else "1B Llama") + ": graph vs eager vs HF",
                         lambda r: part_c(r, state), needs_cuda=False,
                         min_left_s=15 if ns.dry_run else 150)
        if "d" in ns.parts:
            rep.run_part("d", "CP=2 zigzag on one device vs CP=1", lambda r: part_d(r, state), needs_cuda=False,
                         min_left_s=15 if ns.dry_run else 75)
        if "g" in ns.parts:
            rep.run_part("g", "DSA and grouped-expert Triton kernels vs torch", part_g, needs_cuda=False,
                         min_left_s=5 if ns.dry_run else 45)
        if "f" in ns.parts:
            rep.run_part("f", "capture on a dirty pool (torch kernel, subprocess)", lambda r: part_f(r, state),
                         needs_cuda=False, min_left_s=15 if ns.dry_run else 50)
    finally:
        cleanup()
    return _finish(rep, ns.out)


def _finish(rep: Report, out_dir: str) -> int:
    add_aims(rep)
    md = rep.markdown()
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(rep.to_json(), f, indent=2, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    print(f"wrote {os.path.join(out_dir, 'gpu_check.json')} and gpu_check.md ({rep.elapsed():.0f} s)", flush=True)
    return 1 if rep.failed else 0


def _watchdog(rep: Report, out_dir: str, hard_limit_s: float, cleanup) -> None:  # noqa: ANN001
    """A part that hangs (a collective that never returns) must not eat the machine's time: past the hard
    limit, write what there is, mark the running part FAILED and exit. Rank processes notice their parent
    is gone and exit on their own."""
    import threading

    def fire() -> None:
        key = rep.current
        if key is not None:
            rep.parts[key].update(status="FAILED", note=f"still running at the hard limit of {hard_limit_s:.0f} s",
                                  seconds=round(time.monotonic() - rep.current_t0, 1))
        print(f"\ngpu_check: hard time limit {hard_limit_s:.0f} s reached; writing the partial report", flush=True)
        try:
            _finish(rep, out_dir)
            cleanup()
        finally:
            os._exit(1)

    timer = threading.Timer(hard_limit_s, fire)
    timer.daemon = True
    timer.start()


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())

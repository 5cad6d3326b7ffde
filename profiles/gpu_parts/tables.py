"""The markdown report: pre-flight, parts, correctness, throughput, latency, CP, aims, verdict."""
from __future__ import annotations

from typing import Any

from .report import PEAK_BF16_TFLOPS, Report


def _md(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{format(v, spec)}{unit}"


def _table(title: str, columns: list[str], rows: list[list[Any]],
           numeric_from: int = 99) -> list[str]:
    """A section: its title and a table; columns from ``numeric_from`` on are right-aligned."""
    align = ["---:" if i >= numeric_from else "---" for i in range(len(columns))]
    out = ["", f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    return out + ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]


def markdown(rep: Report) -> str:
    i = rep.info
    run = "DRY RUN (CPU, tiny shapes; not a GPU check)" if rep.dry_run else "full run"
    out = ["# graphcp GPU check", "",
           f"- device: {i.get('device')}; torch {i.get('torch')}; triton {i.get('triton')}; "
           f"transformers {i.get('transformers')}; flashinfer {i.get('flashinfer')}; "
           f"engine attention kernel {i.get('attention_kernel')}",
           f"- {run}; elapsed {rep.elapsed():.0f} s of a {rep.budget_s:.0f} s budget; "
           f"bf16 peak assumed {PEAK_BF16_TFLOPS:.0f} TFLOP/s (H200 SXM dense)"]
    out += _preflight(rep) + _parts(rep) + _checks(rep) + _kernels(rep) + _fp8(rep)
    out += _latency(rep) + _capture(rep) + _cp(rep) + _choices(rep) + _aims(rep)
    verdict, why = rep.reasons()
    out += ["", f"**Overall: {verdict}** (pre-flight, parts and correctness; aims are reported, "
            "not enforced)", ""]
    return "\n".join(out + [f"- {_md(w)}" for w in why]) + "\n"


def _preflight(rep: Report) -> list[str]:
    if rep.preflight is None:
        return ["", "## Pre-flight", "", "not run"]
    rows = [[r["item"], "ok" if r["found"] else "MISSING" if r["needed"] else
             "absent (not needed: dry run)", r["detail"]] for r in rep.preflight]
    return _table("Pre-flight", ["item", "result", "detail"], rows)


def _parts(rep: Report) -> list[str]:
    rows = [[k, p["title"], p["status"], p["seconds"], p["note"]] for k, p in rep.parts.items()]
    return _table("Parts (in the order run)", ["part", "what", "status", "s", "note"], rows)


def _checks(rep: Report) -> list[str]:
    skip = ("part", "check", "metric", "value", "tolerance", "ok")
    rows = [[c["part"], c["check"], c["metric"], f"{c['value']:.3e}", f"{c['tolerance']:.0e}",
             "ok" if c["ok"] else "FAILED",
             ", ".join(f"{k}={v}" for k, v in c.items() if k not in skip)] for c in rep.checks]
    return _table("Correctness", ["part", "check", "metric", "value", "tolerance", "result",
                                  "detail"], rows)


def _kernels(rep: Report) -> list[str]:
    if not rep.kernel_perf:
        return []
    rows = [[k["shape"], f"{k['triton_ms']:.3f}", f"{k['triton_tflops']:.1f}",
             f"{k['pct_peak']:.1f}",
             _fmt(k.get("sdpa_ms"), ".3f"), _fmt(k.get("sdpa_tflops"), ".1f"),
             _fmt(k.get("flashinfer_tflops"), ".1f")] for k in rep.kernel_perf]
    out = _table("Attention kernel throughput (causal, single sequence, bf16)",
                 ["shape", "triton ms", "triton TFLOP/s", "% of peak", "torch SDPA flash ms",
                  "SDPA TFLOP/s", "flashinfer TFLOP/s"], rows, 1)
    sweeps = [k for k in rep.kernel_perf if k.get("tiles")]
    names = list(dict.fromkeys(n for k in sweeps for n in k["tiles"]))
    if names:
        rows = [[k["shape"]] + [_fmt(k["tiles"].get(n), ".3f") for n in names] for k in sweeps]
        out += _table("Triton tile sweep (ms; BLOCK_M x BLOCK_N, warps, stages)", ["shape"] + names,
                      rows, 1)
    return out


def _fp8(rep: Report) -> list[str]:
    if not rep.fp8_perf:
        return []
    rows = [[f["shape"], f"{f['fp8_ms']:.3f}", f"{f['fp8_tflops']:.1f}", f"{f['bf16_ms']:.3f}",
             f"{f['bf16_tflops']:.1f}", f"{f['fp8_tflops'] / f['bf16_tflops']:.2f}x"]
            for f in rep.fp8_perf]
    return _table("FP8 block-scaled GEMM (Triton, 1x128 activation groups, 128x128 weight blocks)",
                  ["shape (M x N x K)", "fp8 ms", "fp8 TFLOP/s", "bf16 torch.matmul ms",
                   "bf16 TFLOP/s", "fp8 / bf16"], rows, 1)


def _latency(rep: Report) -> list[str]:
    rows = [[t["shape"], _fmt(t.get("eager_ms"), ".2f"), _fmt(t.get("graph_ms"), ".2f"),
             _fmt(t.get("hf_ms"), ".2f"), _fmt(t.get("graph_speedup"), ".2f", "x"),
             _fmt(t.get("eager_vs_hf"), ".2f", "x"), f"{t.get('mode')}, {t.get('bucket')}"]
            for t in rep.timings]
    return _table("Prefill latency (median ms; engine.prefill wall time incl. logits to host)",
                  ["shape", "graphcp eager", "graphcp graph", "HF transformers",
                   "graph speedup (eager/graph)", "graphcp eager vs HF (HF/eager)",
                   "graph mode, bucket"], rows, 1)


def _capture(rep: Report) -> list[str]:
    if not rep.capture:
        return []
    rows = [[c["part"], c["tokens"], f"{c['capture_s']:.2f}", f"{c['memory_bytes'] / 2**20:.1f}",
             c.get("error") or ""] for c in rep.capture]
    return _table("Graph capture per bucket (memory: this process's torch pool, not the device's)",
                  ["part", "bucket (CP-local tokens)", "capture s", "memory MiB", "error"], rows, 1)


def _cp(rep: Report) -> list[str]:
    if not rep.cp:
        return []
    rows = [[c["shape"], c["mode"], c["bucket"], c["per_rank_tokens"], f"{c['rel_err']:.2e}",
             _fmt(c.get("eager_ms"), ".2f"), _fmt(c.get("graph_ms"), ".2f")] for c in rep.cp]
    return _table("CP=2 zigzag (two rank processes sharing one device) vs CP=1",
                  ["shape", "mode", "bucket", "per-rank tokens", "max rel err vs CP=1", "eager ms",
                   "graph ms"], rows, 4)


def _choices(rep: Report) -> list[str]:
    """The kernel each engine's ops chose; a torch form standing in for a Triton one says why."""
    rows = [[c["part"], c["engine"], c["attention"],
             "; ".join(f"{op}: {why}" for op, why in c["ops"].items()) or "none probed (CPU)",
             ", ".join(str(b) for b in c.get("capture_failures", {})) or ""]
            for c in rep.kernel_choices]
    if not rows:
        return []
    return _table("Kernels chosen per engine (probed layer ops: triton, or torch and why)",
                  ["part", "engine", "attention", "layer ops", "buckets failed"], rows)


def _aims(rep: Report) -> list[str]:
    rows = [[a["aim"], _fmt(a["measured"], ".2f", a["unit"]), f"{a['target']:g}{a['unit']}",
             a["status"]] for a in rep.aims]
    return _table("Aims", ["aim", "measured", "target", "status"], rows, 1)

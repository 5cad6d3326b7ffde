"""The markdown report: pre-flight, parts, correctness, throughput, latency, CP, aims, the verdict."""
from __future__ import annotations

from typing import Any

from .report import PEAK_BF16_TFLOPS, Report


def _md(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{format(v, spec)}{unit}"


def markdown(rep: Report) -> str:
    i = rep.info
    out = ["# graphcp GPU check", "",
           f"- device: {i.get('device')}; torch {i.get('torch')}; triton {i.get('triton')}; "
           f"transformers {i.get('transformers')}; flashinfer {i.get('flashinfer')}; "
           f"engine attention kernel {i.get('attention_kernel')}",
           f"- {'DRY RUN (CPU, tiny shapes; not a GPU check)' if rep.dry_run else 'full run'}; "
           f"elapsed {rep.elapsed():.0f} s of a {rep.budget_s:.0f} s budget; "
           f"bf16 peak assumed {PEAK_BF16_TFLOPS:.0f} TFLOP/s (H200 SXM dense)", ""]
    out += _preflight(rep) + _parts(rep) + _checks(rep) + _kernels(rep) + _fp8(rep)
    out += _latency(rep) + _capture(rep) + _cp(rep) + _aims(rep)
    verdict, why = rep.reasons()
    out += ["", f"**Overall: {verdict}** (pre-flight, parts and correctness; aims are reported, not "
            "enforced)", ""]
    out += [f"- {_md(w)}" for w in why]
    return "\n".join(out) + "\n"


def _preflight(rep: Report) -> list[str]:
    if rep.preflight is None:
        return ["## Pre-flight", "", "not run", ""]
    out = ["## Pre-flight", "", "| item | result | detail |", "|---|---|---|"]
    for r in rep.preflight:
        result = "ok" if r["found"] else "MISSING" if r["needed"] else "absent (not needed: dry run)"
        out.append(f"| {r['item']} | {result} | {_md(r['detail'])} |")
    return out + [""]


def _parts(rep: Report) -> list[str]:
    out = ["## Parts (in the order run)", "", "| part | what | status | s | note |",
           "|---|---|---|---:|---|"]
    out += [f"| {k} | {p['title']} | {p['status']} | {p['seconds']} | {_md(p['note'])} |"
            for k, p in rep.parts.items()]
    return out


def _checks(rep: Report) -> list[str]:
    out = ["", "## Correctness", "", "| part | check | metric | value | tolerance | result | detail |",
           "|---|---|---|---:|---:|---|---|"]
    skip = ("part", "check", "metric", "value", "tolerance", "ok")
    for c in rep.checks:
        extra = ", ".join(f"{k}={v}" for k, v in c.items() if k not in skip)
        out.append(f"| {c['part']} | {c['check']} | {c['metric']} | {c['value']:.3e} | "
                   f"{c['tolerance']:.0e} | {'ok' if c['ok'] else 'FAILED'} | {_md(extra)} |")
    return out


def _kernels(rep: Report) -> list[str]:
    if not rep.kernel_perf:
        return []
    out = ["", "## Attention kernel throughput (causal, single sequence, bf16)", "",
           "| shape | triton ms | triton TFLOP/s | % of peak | torch SDPA flash ms | SDPA TFLOP/s | "
           "flashinfer TFLOP/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k in rep.kernel_perf:
        out.append(f"| {k['shape']} | {k['triton_ms']:.3f} | {k['triton_tflops']:.1f} | "
                   f"{k['pct_peak']:.1f} | {_fmt(k.get('sdpa_ms'), '.3f')} | "
                   f"{_fmt(k.get('sdpa_tflops'), '.1f')} | {_fmt(k.get('flashinfer_tflops'), '.1f')} |")
    sweeps = [k for k in rep.kernel_perf if k.get("tiles")]
    names = list(dict.fromkeys(n for k in sweeps for n in k["tiles"]))
    if names:
        out += ["", "## Triton tile sweep (ms; BLOCK_M x BLOCK_N, warps, stages)", "",
                "| shape | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        out += [f"| {k['shape']} | " + " | ".join(_fmt(k["tiles"].get(n), ".3f") for n in names) + " |"
                for k in sweeps]
    return out


def _fp8(rep: Report) -> list[str]:
    if not rep.fp8_perf:
        return []
    out = ["", "## FP8 block-scaled GEMM (Triton, 1x128 activation groups, 128x128 weight blocks)", "",
           "| shape (M x N x K) | fp8 ms | fp8 TFLOP/s | bf16 torch.matmul ms | bf16 TFLOP/s | fp8 / bf16 |",
           "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {f['shape']} | {f['fp8_ms']:.3f} | {f['fp8_tflops']:.1f} | {f['bf16_ms']:.3f} | "
            f"{f['bf16_tflops']:.1f} | {f['fp8_tflops'] / f['bf16_tflops']:.2f}x |" for f in rep.fp8_perf]
    return out


def _latency(rep: Report) -> list[str]:
    out = ["", "## Prefill latency (median ms; engine.prefill wall time incl. logits to host)", "",
           "| shape | graphcp eager | graphcp graph | HF transformers | graph speedup (eager/graph) | "
           "graphcp eager vs HF (HF/eager) | graph mode, bucket |", "|---|---:|---:|---:|---:|---:|---|"]
    for t in rep.timings:
        out.append(f"| {t['shape']} | {_fmt(t.get('eager_ms'), '.2f')} | {_fmt(t.get('graph_ms'), '.2f')} | "
                   f"{_fmt(t.get('hf_ms'), '.2f')} | {_fmt(t.get('graph_speedup'), '.2f', 'x')} | "
                   f"{_fmt(t.get('eager_vs_hf'), '.2f', 'x')} | {t.get('mode')}, {t.get('bucket')} |")
    return out


def _capture(rep: Report) -> list[str]:
    if not rep.capture:
        return []
    out = ["", "## Graph capture per bucket (memory: this process's torch pool, not the device's)", "",
           "| part | bucket (CP-local tokens) | capture s | memory MiB | error |", "|---|---:|---:|---:|---|"]
    out += [f"| {c['part']} | {c['tokens']} | {c['capture_s']:.2f} | {c['memory_bytes'] / 2**20:.1f} | "
            f"{_md(c.get('error') or '')} |" for c in rep.capture]
    return out


def _cp(rep: Report) -> list[str]:
    if not rep.cp:
        return []
    out = ["", "## CP=2 zigzag (two rank processes sharing one device) vs CP=1", "",
           "| shape | mode | bucket | per-rank tokens | max rel err vs CP=1 | eager ms | graph ms |",
           "|---|---|---:|---|---:|---:|---:|"]
    out += [f"| {c['shape']} | {c['mode']} | {c['bucket']} | {c['per_rank_tokens']} | {c['rel_err']:.2e} | "
            f"{_fmt(c.get('eager_ms'), '.2f')} | {_fmt(c.get('graph_ms'), '.2f')} |" for c in rep.cp]
    return out


def _aims(rep: Report) -> list[str]:
    out = ["", "## Aims", "", "| aim | measured | target | status |", "|---|---:|---:|---|"]
    out += [f"| {a['aim']} | {_fmt(a['measured'], '.2f', a['unit'])} | {a['target']:g}{a['unit']} | "
            f"{a['status']} |" for a in rep.aims]
    return out

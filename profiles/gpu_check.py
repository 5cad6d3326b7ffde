#!/usr/bin/env python
"""The one-call GPU check: everything graphcp claims on a GPU, measured in one run on one H200.

    python profiles/gpu_check.py --out profiles/out       # GPU machine: < 8 minutes, no downloads
    python profiles/gpu_check.py --dry-run --out /tmp/gc  # CPU, tiny shapes (CI): exit 2, INCOMPLETE

Needs torch, triton, numpy, safetensors and tqdm (the machine's own python; graphcp is imported from
this checkout); transformers, nvtx, pynvml and gguf are used where installed. Sets HF_HUB_OFFLINE=1.

First a pre-flight (CUDA, and what Triton needs to build its launcher: a C compiler, Python.h,
libcuda, a writable cache, one tiny kernel); then the parts, most informative first, each in its own
process under its own time budget (``gpu_parts/__init__.py``): f dirty-pool capture, a Triton
kernels, c 1B model graph vs eager vs HF, d CP=2, h a tiny engine per family, g DSA/MoE kernels,
e FP8 GEMM, i Gated DeltaNet rule, b attention TFLOP/s. A hard watchdog ends the run before 8
minutes. Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.

Exit code: 0 passed (the pre-flight passed, every part ran whole and every check is within
tolerance); 1 FAILED (a pre-flight item missing, a part failed, crashed or hung, or a check out of
tolerance); 2 INCOMPLETE (nothing failed, but a part did not run or was cut short: dry run, time
budget, --parts). Performance aims are reported (met / not met), not enforced.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"        # before anything imports huggingface_hub: no downloads
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)                # graphcp from this checkout, installed or not


def _require(modules: tuple[str, ...]) -> None:
    """Say what this python lacks, in one line, instead of a raw ModuleNotFoundError later."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"gpu_check: {sys.executable} lacks {', '.join(missing)}: run it with the GPU "
                 f"machine's own python (it has a CUDA torch and triton), or install them: "
                 f"pip install {' '.join(missing)} (a CUDA build of torch on a GPU machine)")


_require(("torch", "numpy", "safetensors", "tqdm"))
from gpu_parts import PART_KEYS  # noqa: E402
from gpu_parts.report import INCOMPLETE, PEAK_BF16_TFLOPS, Report  # noqa: E402

GPU_BUDGET_S, GPU_HARD_LIMIT_S = 455.0, 470.0   # no part runs past the budget; the watchdog: all
DRY_BUDGET_S, DRY_HARD_LIMIT_S = 860.0, 890.0   # part h starts engines of seven families


def add_aims(rep: Report) -> None:
    rows = {t["shape"]: t for t in rep.timings}
    rep.aim("graph >= 2x eager at 8x128", rows.get("8x128", {}).get("graph_speedup"), 2.0, "x")
    rep.aim("graph >= 1.1x eager at 1x2048", rows.get("1x2048", {}).get("graph_speedup"), 1.1, "x")
    perf = [k for k in rep.kernel_perf if k["tokens"] == 32768 and k["head_dim"] == 128]
    rep.aim(f"triton attention >= 40% of bf16 peak ({PEAK_BF16_TFLOPS:.0f} TFLOP/s) at 32k causal, "
            "d128", perf[0]["pct_peak"] if perf else None, 40.0, "%")
    for shape in rows:
        rep.aim(f"graphcp eager >= HF speed at {shape}", rows[shape].get("eager_vs_hf"), 1.0, "x")
    big = [f["fp8_tflops"] / f["bf16_tflops"] for f in rep.fp8_perf if f["m"] == 8192]
    rep.aim("fp8 GEMM >= 1.3x bf16 torch.matmul at M=8192 (1B FFN shapes, worst)",
            min(big) if big else None, 1.3, "x")


def _versions(dry_run: bool) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available() and not dry_run
              else f"cpu ({platform.machine()})")
    return dict(device=device, torch=torch.__version__, triton=ver("triton"),
                transformers=ver("transformers"), flashinfer=ver("flashinfer-python"),
                python=platform.python_version(),
                started=datetime.datetime.now().isoformat(timespec="seconds"))


def write_report(rep: Report, out_dir: str) -> int:
    from gpu_parts.tables import markdown
    add_aims(rep)
    md = markdown(rep)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(rep.to_json(), f, indent=2, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    print(f"wrote {os.path.join(out_dir, 'gpu_check.json')} and gpu_check.md "
          f"({rep.elapsed():.0f} s); exit {rep.exit_code} ({rep.verdict})", flush=True)
    return rep.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", default=os.path.join(ROOT, "profiles", "out"), help="where the json/md go")
    add("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter (CI)")
    add("--workdir", default=None, help="keep the generated checkpoints here (reused by a rerun); "
        "default: a temporary directory removed at the end")
    add("--budget-s", type=float, default=None, help="no part runs past this many seconds")
    add("--parts", default=PART_KEYS, help="subset of parts to run, e.g. 'ac' (INCOMPLETE)")
    add("--part", default=None, help=argparse.SUPPRESS)       # a child process: run this part
    add("--result", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"          # before anything imports triton
    if ns.part:
        from gpu_parts.orchestrate import child_main
        return child_main(ns.part, ns.dry_run, ns.workdir, ns.budget_s, ns.result)
    from gpu_parts.orchestrate import run_parts, start_watchdog, title
    from gpu_parts.preflight import run_preflight, stop_message
    budget = ns.budget_s
    if budget is None:
        budget = DRY_BUDGET_S if ns.dry_run else GPU_BUDGET_S
    hard = max(DRY_HARD_LIMIT_S if ns.dry_run else GPU_HARD_LIMIT_S, budget + 15.0)
    rep = Report(ns.dry_run, budget)
    workdir = ns.workdir or tempfile.mkdtemp(prefix="graphcp_gpu_check_")
    os.makedirs(workdir, exist_ok=True)

    def finish() -> int:
        try:
            return write_report(rep, ns.out)
        finally:
            if ns.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)

    watchdog = start_watchdog(rep, hard, finish)
    rep.info.update(_versions(ns.dry_run))
    print("== pre-flight", flush=True)
    rep.preflight = run_preflight(ns.dry_run)
    for row in rep.preflight:
        print(f"   {'ok     ' if row['found'] else 'MISSING' if row['needed'] else 'absent '} "
              f"{row['item']}: {row['detail']}", flush=True)
    stop = stop_message(rep.preflight)
    if stop is None:
        run_parts(rep, ns.parts, os.path.abspath(__file__), workdir, budget)
    else:
        print(stop, file=sys.stderr, flush=True)
        for key in PART_KEYS:
            rep.set_part(key, title(key), INCOMPLETE, "not run: the pre-flight stopped the run")
    watchdog.cancel()
    return finish()


if __name__ == "__main__":
    sys.exit(main())

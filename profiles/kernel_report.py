#!/usr/bin/env python
"""Registers, spills and shared memory of every Triton kernel graphcp launches on CUDA, no GPU.

    python profiles/kernel_report.py --arch sm_90a --out profiles/out/kernels
    python profiles/kernel_report.py --arch sm_90a --out /tmp/kr --sample   # first config a kernel

Triton compiles for a target it is told (no driver needed) and its bundled ptxas assembles the PTX;
``ptxas -v`` reports registers and spills. Configurations come from the kernels' own tile-choice
functions (``attention_tiles``, ``gemm_tiles``, ...) evaluated over the default CUDA bucket ladder
and the model shapes graphcp serves (``kernel_cases.py``), so the report follows the engine's rules,
never a copy of them.
The kernels' argument specialisation (which ints are 1, which are multiples of 16) is Triton's own,
from its binder, on the arguments the launch wrappers pass at those shapes.

Writes ``DIR/<name>.ptx`` per kernel, ``DIR/report.json`` (one entry per compiled kernel) and
``DIR/configs.json`` (every enumerated configuration per family), and prints a table.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"          # compile, not interpret: before triton is imported

import argparse
import json
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

from profiles import kernel_cases  # noqa: E402

FAMILIES = ("attention", "kv_write", "fp8_gemm", "moe", "moe_fp8", "moe_gated", "dsa_index",
            "dsa_mla", "mla_prefill", "delta_rule", "rmsnorm", "rope")


@dataclass
class Case:
    """One kernel launch to compile: the JIT function, its arguments and launch options."""
    family: str
    fn: object                       # triton JITFunction
    config: dict                     # what the report shows: tiles, warps, stages, dtype, shape
    args: dict                       # kernel argument name -> value (MockTensor for tensors)
    options: dict = field(default_factory=dict)   # num_warps, num_stages

    @property
    def name(self) -> str:
        slug = "-".join(f"{k}{v}" for k, v in self.config.items())
        return re.sub(r"[^A-Za-z0-9_.-]", "", f"{self.family}-{self.fn.__name__}-{slug}")


def target_for(arch: str) -> GPUTarget:
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    if not match:
        raise SystemExit(f"--arch {arch!r}: expected sm_<capability>, e.g. sm_90a")
    return GPUTarget("cuda", int(match.group(1)), 32)


def compile_case(case: Case, target: GPUTarget):
    """Triton's own launch path up to the compile, without a driver: its binder specialises the
    arguments as a launch would (ints equal to 1 become constants, multiples of 16 get divisibility
    hints), then ``triton.compile`` builds for ``target``."""
    backend = make_backend(target)
    binder = create_function_from_signature(case.fn.signature, case.fn.params, backend)
    bound, specialization, _ = binder(**case.args, **case.options)
    options, signature, constexprs, attrs = case.fn._pack_args(backend, case.options, bound,
                                                               specialization, case.options)
    return triton.compile(ASTSource(case.fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def ptxas_usage(ptx_path: str, arch: str) -> dict:
    """Registers and spill bytes as ptxas reports them for ``arch`` (with Triton's own flags)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path
    cmd = [ptxas, "-v", "-lineinfo", "--regAllocOptLevel=2", f"--gpu-name={arch}", ptx_path,
           "-o", os.devnull]
    log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    if regs is None:
        raise RuntimeError(f"no register count in the ptxas output:\n{log}")
    return {"registers": int(regs.group(1)),
            "spill_store_bytes": int(stores.group(1)) if stores else 0,
            "spill_load_bytes": int(loads.group(1)) if loads else 0}


def enumerate_cases() -> dict[str, list[Case]]:
    """Every configuration per family, deduplicated (shapes with the same tiles compile once)."""
    out = {}
    for family in FAMILIES:
        seen, cases = set(), []
        for config, fn, args, options in getattr(kernel_cases, family)(MockTensor):
            key = (fn.__name__, tuple(config.items()))
            if key not in seen:
                seen.add(key)
                cases.append(Case(family, fn, config, args, options))
        out[family] = cases
    return out


def run(arch: str, out_dir: str, sample: bool = False,
        families: tuple[str, ...] = FAMILIES) -> list[dict]:
    """Compile the enumerated cases of ``families`` (with ``sample``, the first of each kernel)."""
    target = target_for(arch)
    os.makedirs(out_dir, exist_ok=True)
    cases = enumerate_cases()
    with open(os.path.join(out_dir, "configs.json"), "w") as f:
        json.dump({fam: [c.config | {"kernel": c.fn.__name__} for c in cs]
                   for fam, cs in cases.items()}, f, indent=1)
    rows, sampled = [], set()
    for family in families:
        for case in cases[family]:
            if sample and (family, case.fn.__name__) in sampled:
                continue
            sampled.add((family, case.fn.__name__))
            t0 = time.monotonic()
            kernel = compile_case(case, target)
            ptx = os.path.join(out_dir, case.name + ".ptx")
            with open(ptx, "w") as f:
                f.write(kernel.asm["ptx"])
            rows.append({"family": family, "kernel": case.fn.__name__, "config": case.config,
                         "ptx": os.path.basename(ptx), **ptxas_usage(ptx, arch),
                         "shared_bytes": int(kernel.metadata.shared),
                         "compile_s": round(time.monotonic() - t0, 2)})
            print(_row(rows[-1]), flush=True)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def _row(r: dict) -> str:
    config = " ".join(f"{k}={v}" for k, v in r["config"].items())
    return (f"{r['family']:<10} {r['kernel']:<22} {r['registers']:>4} {r['spill_store_bytes']:>6} "
            f"{r['spill_load_bytes']:>6} {r['shared_bytes']:>7}  {config}")


def summary(rows: list[dict]) -> str:
    lines = ["| family | configs | max registers | spilled configs | max spill (bytes) "
             "| max shared (KiB) |", "|---|---|---|---|---|---|"]
    for family in FAMILIES:
        fam = [r for r in rows if r["family"] == family]
        if fam:
            spilled = sum(1 for r in fam if r["spill_store_bytes"] or r["spill_load_bytes"])
            spill = max(max(r["spill_store_bytes"], r["spill_load_bytes"]) for r in fam)
            shared = max(r["shared_bytes"] for r in fam) / 1024
            regs = max(r["registers"] for r in fam)
            lines.append(f"| {family} | {len(fam)} | {regs} | {spilled} | {spill} | {shared:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sample", action="store_true",
                    help="compile only the first configuration of each kernel")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    args = ap.parse_args()
    print(f"{'family':<10} {'kernel':<22} {'regs':>4} {'st':>6} {'ld':>6} {'smem':>7}  config")
    rows = run(args.arch, args.out, args.sample, tuple(args.families))
    print("\n" + summary(rows))
    spilled = [r for r in rows if r["spill_store_bytes"] or r["spill_load_bytes"]]
    print(f"\n{len(rows)} kernels, {len(spilled)} with spills; report in {args.out}/report.json")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())

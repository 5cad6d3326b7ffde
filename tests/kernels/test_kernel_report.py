"""profiles/kernel_report.py on CPU: Triton compiles graphcp's kernels for sm_90a (no GPU) and its
bundled ptxas reports registers and spills. The test compiles the first configuration of each
kernel; the full report (every configuration, a few minutes) is run by hand."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from testkit.paths import REPO

triton = pytest.importorskip("triton")

FAMILIES = {"attention", "kv_write", "fp8_gemm", "moe", "moe_fp8", "moe_gated", "dsa_index",
            "dsa_mla", "mla_prefill", "delta_rule", "rmsnorm", "rope"}
FIELDS = {"family", "kernel", "config", "ptx", "registers", "spill_store_bytes", "spill_load_bytes",
          "shared_bytes"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(bundled):
        pytest.skip("this triton has no bundled NVIDIA toolchain")
    out = tmp_path_factory.mktemp("kernel_report")
    env = dict(os.environ, PYTHONPATH=REPO, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "profiles", "kernel_report.py"),
                           "--arch", "sm_90a", "--out", str(out), "--sample"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "report.json") as f, open(out / "configs.json") as g:
        return out, json.load(f), json.load(g), proc.stdout


def test_every_kernel_compiles_without_spills(report):
    out, rows, configs, stdout = report
    assert {r["family"] for r in rows} == FAMILIES
    kernels = {(fam, c["kernel"]) for fam, cs in configs.items() for c in cs}
    assert {(r["family"], r["kernel"]) for r in rows} == kernels        # the first of each kernel
    for r in rows:
        assert set(r) >= FIELDS
        assert 0 < r["registers"] <= 255 and r["spill_store_bytes"] == r["spill_load_bytes"] == 0, r
        with open(out / r["ptx"]) as f:
            ptx = f.read()
        assert ".target sm_90a" in ptx and f".entry {r['kernel']}" in ptx
    assert "| attention |" in stdout and "with spills" in stdout


def test_configs_come_from_the_tile_functions(report):
    """The enumeration is the kernels' own tile choice over the CUDA bucket ladder, not a copy."""
    from graphcp.graph.runner import DEFAULT_BUCKETS
    from graphcp.kernels.triton_attention import attention_tiles
    from graphcp.kernels.triton_fp8_gemm import gemm_tiles
    _, _, configs, _ = report
    assert set(configs) == FAMILIES and all(configs.values())
    attention = {(c["dtype"], c["head_dim"], c["block_m"], c["block_n"], c["num_warps"],
                  c["num_stages"]) for c in configs["attention"]}
    for rows in DEFAULT_BUCKETS["cuda"]:
        for d in (32, 64, 80, 96, 128, 192, 256):       # every family's full-attention head dim
            for dtype, windowed in itertools.product((torch.bfloat16, torch.float16,
                                                      torch.float32), (False, True)):
                key = (str(dtype).removeprefix("torch."), d,
                       *attention_tiles(rows, d, dtype, windowed))
                assert key in attention
    from graphcp.kernels.triton_mla import mla_prefill_tiles
    mla = {(c["dtype"], c["block_h"], c["block_t"], c["block_n"]) for c in configs["mla_prefill"]}
    for heads in (8, 16, 32, 64, 128):                   # DeepSeek-V3's 128 heads over TP 1..16
        for dtype in (torch.bfloat16, torch.float32):
            t = mla_prefill_tiles(heads, dtype)
            assert (str(dtype).removeprefix("torch."), t.block_h, t.block_t, t.block_n) in mla
    gemm = {(c["block_m"], c["block_n"]) for c in configs["fp8_gemm"]
            if c["kernel"] == "_fp8_gemm_kernel"}
    assert gemm == {gemm_tiles(m)[:2] for m in DEFAULT_BUCKETS["cuda"]} | {gemm_tiles(65536)[:2]}
    from graphcp.kernels.triton_delta_rule import delta_rule_tiles
    release = delta_rule_tiles(128, 128)         # Qwen3-Next / Qwen3.5's linear heads
    assert {(c["block_v"], c["num_warps"]) for c in configs["delta_rule"]
            if c["kernel"] == "_state_kernel" and c["dk"] == 128} == {release[:2]}

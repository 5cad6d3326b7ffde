"""Profiling tools: ``graphcp profile`` writes a kernel summary and a timeline; the GPU check's dry run passes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from graphcp.tools.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_profile_cp1_writes_summary_and_timeline(checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "profile"
    rc = cli_main(["profile", "--model-path", checkpoint, "--device", "cpu", "--tp", "1", "--attn-cp-size", "1",
                   "--tokens", "48", "--batches", "2", "--cuda-graph-buckets", "16", "64",
                   "--max-total-tokens", "1024", "--out", str(out)])
    assert rc == 0
    text = (out / "kernel_summary.md").read_text()
    assert "| # | name | calls | total time (ms) | share % |" in text
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| `[^`]+` \| \d+ \| [\d.]+ \| [\d.]+ \|$", line)]
    assert len(rows) >= 5, text
    assert "**all ops, rank 0**" in text
    # 48 tokens replay the 64 bucket; the profiler sees graphcp's NVTX ranges through record_function.
    assert "mode: graph (bucket 64)" in text
    assert "`prefill` | 2 |" in text and "`graph_replay:64` | 2 |" in text
    assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    trace = json.loads((out / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"prefill", "graph_replay:64"} <= names


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "profiles", "gpu_check.py"), "--dry-run",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=170, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and not report["failed"]
    assert report["parts"]["b"]["status"] == "skipped" and "no CUDA" in report["parts"]["b"]["note"]
    assert all(p["status"] in ("ok", "skipped") for p in report["parts"].values()), report["parts"]
    assert report["parts"]["c"]["status"] == "ok"
    assert all(c["ok"] for c in report["checks"]) and report["checks"]
    assert {t["shape"] for t in report["timings"]} == {"1x16", "2x24"}
    assert (tmp_path / "gpu_check.md").read_text().startswith("# graphcp GPU check")

"""Profiling tools: ``graphcp profile`` writes a kernel summary and a timeline; the GPU check's dry
run runs every CPU part and passes them, and still reports INCOMPLETE."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from testkit.paths import REPO

from graphcp.tools.cli import main as cli_main

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
    """Every part but the GPU-only one runs on CPU and passes; the run still exits 2 (INCOMPLETE):
    a dry run is not a GPU check."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "profiles", "gpu_check.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=950, env=env, cwd=REPO)
    assert proc.returncode == 2, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "exit 2 (INCOMPLETE)" in proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["verdict"] == "INCOMPLETE" and not report["failed"]
    assert report["why"] == ["part b: not run: needs CUDA (dry run)"]
    assert list(report["parts"]) == ["f", "a", "c", "d", "h", "g", "e", "i", "b"]  # dirty pool first
    assert all(p["status"] == "ok" for k, p in report["parts"].items() if k != "b"), report["parts"]
    assert all(c["ok"] for c in report["checks"]) and report["checks"]
    names = {c["check"] for c in report["checks"]}
    for cp in ("CP1", "CP2"):   # padded buckets and cached prefixes, graph vs eager
        assert {f"bucket padded {cp} 1x{12 if cp == 'CP1' else 20}"} <= names
        assert any(n.startswith(f"graph vs eager logits {cp} 2nd chunk") for n in names)
        assert any(n.startswith(f"replayed as a graph {cp}") and n.endswith("(first chunk)")
                   for n in names)
    assert any("-inf past the causal limit" in n for n in names)
    assert any("vs fp32" in n for n in names)
    assert {t["shape"] for t in report["timings"]} == {"1x16", "2x24"}
    assert {c["part"] for c in report["capture"]} == {"c", "d", "f"}
    assert {c["part"] for c in report["kernel_choices"]} == {"c", "d", "h"}
    assert any(n.startswith("graph pool dirtied") for n in names)
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# graphcp GPU check") and "**Overall: INCOMPLETE**" in md

"""The command line: graphcp bench writes its JSON and plot; graphcp demo prints its table and the CP=2 vs
CP=1 comparison."""
from __future__ import annotations

import json

from graphcp.tools.cli import main


def test_bench_json_and_plot(checkpoint, tmp_path, capsys):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--model-path", checkpoint, "--tp", "1", "--attn-cp-size", "1", "--cases", "1x40", "3x24",
               "--reps", "2", "--max-total-tokens", "1024", "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["tokens_per_s"]) == {"graphcp_eager", "graphcp_graph", "hf"}
    assert all(v > 0 for v in report["tokens_per_s"].values())
    ops = report["host_ops_per_forward"]
    assert ops["graph"] < ops["eager"]
    assert [c["case"] for c in report["cases"]] == ["1x40", "3x24"]
    assert all(c["graph_mode"] == "graph" for c in report["cases"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "graph / eager" in capsys.readouterr().out


def test_demo_table_and_cp_comparison(checkpoint, capsys):
    rc = main(["demo", "--random-model", "--model-path", checkpoint, "--batches", "2", "--max-total-tokens", "4096"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "request" in printed and "tokens/s" in printed and "graph" in printed
    assert "CP=2 vs CP=1 logits" in printed and "greedy tokens identical" in printed


def test_bad_flag_is_a_clear_error(checkpoint, capsys):
    assert main(["bench", "--model-path", checkpoint, "--cp-strategy", "ring", "--tp", "2", "--attn-cp-size", "2",
                 "--enable-prefill-cp"]) == 2
    assert "--cp-strategy" in capsys.readouterr().err


def test_bench_scale_table_and_plot(tmp_path, monkeypatch, capsys):
    """``graphcp bench --scale`` at tiny lengths: it writes its long-context checkpoint itself (no
    --model-path), times each length beside HF, prints the table and writes the log-log PNG."""
    monkeypatch.setenv("GRAPHCP_CACHE", str(tmp_path / "cache"))
    out, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    rc = main(["bench", "--scale", "--lengths", "48", "96", "--cp", "1", "--reps", "1", "--json", str(out),
               "--plot", str(plot)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["cp"]) for r in rows] == [(48, 1), (96, 1)]
    assert all(r["ms"] > 0 and r["hf_ms"] > 0 and min(r["peak_rss_bytes_per_rank"]) > 0 for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "peak RSS/rank MiB" in printed and "vs HF" in printed
    assert json.loads((tmp_path / "cache" / "long-llama-random" / "config.json").read_text())[
        "max_position_embeddings"] >= 131072


def test_bench_scale_refuses_lengths_past_the_model(checkpoint, capsys):
    assert main(["bench", "--scale", "--model-path", checkpoint, "--lengths", "1000000", "--no-hf"]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_generate_without_a_tokenizer_says_so_in_one_line(checkpoint, capsys):
    """An HF checkpoint without tokenizer files: one line naming the cause, exit 2, no traceback
    (transformers would build an empty tokenizer from config.json; nothing is prefilled)."""
    assert main(["generate", "--model-path", checkpoint, "--prompt", "hi", "--tp", "1",
                 "--attn-cp-size", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer" in err[0] and "Traceback" not in err[0]


def test_help_lists_every_command_with_a_line(capsys):
    from graphcp.tools.cli import COMMANDS
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(f"  {name} " in printed for name in COMMANDS)
    import argparse

    from graphcp.config import EngineArgs
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert [a.option_strings for a in parser._actions if not a.help] == []


def test_bench_writes_no_png_unasked(checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model-path", checkpoint, "--tp", "1", "--attn-cp-size", "1", "--cases",
                 "1x24", "--reps", "1", "--no-hf", "--max-total-tokens", "1024"]) == 0
    assert list(tmp_path.iterdir()) == []

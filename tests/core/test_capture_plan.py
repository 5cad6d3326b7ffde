"""capture/warmup.py writes a plan; an engine started from it captures exactly its buckets and replays them;
a plan made for another configuration is refused with a ConfigError."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
from testkit.parity import Session, random_ids
from testkit.paths import REPO

from graphcp import ConfigError, Engine, EngineArgs, Request


def _warmup():
    spec = importlib.util.spec_from_file_location("warmup", os.path.join(REPO, "capture", "warmup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_warmup_plan_roundtrip(checkpoint, oracle, tmp_path):
    plan_path = str(tmp_path / "plan.json")
    flags = ["--model-path", checkpoint, "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
             "--cp-strategy", "zigzag", "--max-total-tokens", "2048"]
    assert _warmup().main(flags + ["--cuda-graph-buckets", "16", "32", "64", "--out", plan_path]) == 0
    plan = json.load(open(plan_path))
    assert [b["tokens"] for b in plan["buckets"]] == [16, 32, 64]
    assert all(b["replay_matches_eager"] and b["capture_s"] > 0 for b in plan["buckets"])
    assert plan["config"]["cp_strategy"] == "zigzag" and plan["created"]
    # Keep only two buckets validated: the engine must capture exactly those.
    plan["buckets"][2]["replay_matches_eager"] = False
    json.dump(plan, open(plan_path, "w"))
    with Engine(EngineArgs.from_cli(flags + ["--capture-plan", plan_path])) as engine:
        assert engine.stats()["graph_buckets"] == [16, 32]
        out = Session(engine, oracle, checkpoint).run([("p", random_ids(50, 211, 1))])
        assert out.mode == "graph" and out.graph_bucket == 32
        out = engine.prefill([Request("q", random_ids(100, 211, 2))])
        assert out.mode == "eager" and "no captured bucket" in out.eager_reason
    with pytest.raises(ConfigError, match="another configuration: tp_size"):
        Engine(EngineArgs(model_path=checkpoint, capture_plan=plan_path, max_total_tokens=2048))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not a graphcp capture plan"):
        Engine(EngineArgs(model_path=checkpoint, capture_plan=str(bad), max_total_tokens=2048))

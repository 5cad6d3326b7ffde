"""PD for gpt-oss (sliding and full layers, attention sinks, MXFP4 experts): a CP 2 zigzag prefill
worker sends every layer's KV through Mooncake to graphcp's KVReceiver; the receiver holds the
whole history for every layer (a PD worker keeps its sliding layers' pages whole: no halo), and
its last sliding_window - 1 tokens of a sliding layer are HF's sliding cache."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine is not importable: pip install "
                    "'graphcp[pd]' and apt-get install libibverbs1 librdmacm1 libnuma1 (README, PD section)")

from testkit.engines import cp_kwargs
from testkit.gpt_oss_checkpoint import GptOssHF, make_gpt_oss
from testkit.hf_reference import rel_err
from testkit.parity import TOL, random_ids

from graphcp import Request
from graphcp.pd import KVReceiver

VOCAB = 211


def test_gpt_oss_transfer_matches_hf(ckpt_dir, engines):
    path = make_gpt_oss(str(ckpt_dir / "gpt-oss-pd"), layers=2, seed=6)
    window = json.load(open(os.path.join(path, "config.json")))["sliding_window"]
    engine = engines.get(path, **cp_kwargs(2, disaggregation_mode="prefill",
                                           cuda_graph_buckets=[64]))
    hf, history = GptOssHF(), {"a": random_ids(40, VOCAB, 1)}
    with KVReceiver(path, max_tokens=256, max_requests=2) as rx:
        engine.prefill([Request("a", history["a"])])
        chunk = random_ids(31, VOCAB, 2)                # a second chunk past the window
        out = engine.prefill([Request("a", chunk)])
        history["a"] += chunk
        logits, ref = hf(path, history["a"])
        assert rel_err(out.logits[0], logits) <= TOL
        engine.transfer_kv("a", rx.destination("a"))
        got, n, worst = rx.kv("a"), len(history["a"]), 0.0
        assert len(got) == len(ref) == 2
        for (k, v), (k_ref, v_ref) in zip(got, ref):
            assert k.shape[1] == n                                  # every token, both layers
            kept = k_ref.shape[1]                                   # HF: window - 1 or n
            assert kept in (n, window - 1)
            worst = max(worst, rel_err(k[:, n - kept:], k_ref), rel_err(v[:, n - kept:], v_ref))
        assert worst <= TOL, f"received KV rel err {worst:.2e}"
        assert {k_ref.shape[1] for k_ref, _ in ref} == {n, window - 1}      # both kinds checked
        engine.release("a")
        rx.free("a")

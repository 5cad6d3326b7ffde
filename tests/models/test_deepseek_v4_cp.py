"""DeepSeek V4 under interleave CP (real gloo groups), with EP for its MoE layers: at CP 2, 4 and 8
the engine's logits and every cache part equal HF for batches of several requests, cached prefixes
and a 200-token request; each layer gathers its new rows (K = V, the compressors' kv | gate) in one
all-gather; hash-routed layers get their token ids through either MoE token flow. CP 2 also runs as
a PD prefill worker with LayerSplit (each CP rank keeps its own layers) and sends the caches to a
KVReceiver, whose copy equals the engine's bitwise and HF's. Three multi-rank engines in all."""
from __future__ import annotations

import json
import os

import pytest
from testkit.deepseek_v4_reference import BATCHES, V4Oracle, release_all, run_batches, v4_checkpoint

from graphcp import Engine, EngineArgs
from graphcp.checkpoint.config import read_model_config

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")     # as graphcp sets it before importing mooncake
CP_BATCHES = BATCHES[:2]        # several requests, a cached prefix, a 200-token one
LAYERS = 3
# per token, fp32: CSA K = V 32, its rows 128, entry 32, indexer rows 64, key 16; sliding 32;
# HCA 32, its rows 64, entry 32
TOKEN_BYTES = 4 * ((32 + 128 + 32 + 64 + 16) + 32 + (32 + 64 + 32))


def interleave(cp: int, **extra) -> dict:
    return dict(tp_size=cp, attn_cp_size=cp, enable_prefill_cp=True, cp_strategy="interleave",
                **extra)


@pytest.fixture(scope="module")
def v4(ckpt_dir):
    return v4_checkpoint(ckpt_dir)


@pytest.fixture(scope="module")
def v4_oracle():
    return V4Oracle()


def _run_cp(engine, oracle: V4Oracle, path: str, batches: list) -> float:
    """The batches at interleave CP: HF parity on every request and cache part, the new tokens
    spread evenly over the ranks, one all-gather per layer and forward."""
    before = engine.collective_counts()["all_gathers"]
    worst, outs = run_batches(engine, oracle, path, batches)
    assert engine.collective_counts()["all_gathers"] - before == LAYERS * len(batches)
    for out, batch in zip(outs, batches):
        counts = out.per_rank_tokens
        assert out.cp_applied and len(counts) == engine.args.cp_size
        assert sum(counts) == sum(len(ids) for _, ids in batch) and max(counts) - min(counts) <= 1
    return worst


@pytest.fixture(scope="module")
def receiver(v4):
    pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine is not importable "
                        "(README, PD section)")
    from graphcp.pd import KVReceiver
    with KVReceiver(v4, max_tokens=256, max_requests=2) as rx:
        yield rx


def test_cp2_ep2_layer_split_and_pd_transfer(engines, v4, v4_oracle, receiver):
    """CP 2, EP 2 (gather / reduce-scatter token flow), LayerSplit in prefill mode; the 200-token
    request's caches sent over Mooncake (tcp) by both CP ranks."""
    engine = engines.get(v4, **interleave(2, ep_size=2), disaggregation_mode="prefill",
                         enable_dsa_cache_layer_split=True, disaggregation_transfer_timeout_s=5.0)
    worst = _run_cp(engine, v4_oracle, v4, CP_BATCHES)
    report = engine.transfer_kv("one", json.loads(json.dumps(receiver.destination("one"))))
    assert report["bytes"] == 200 * TOKEN_BYTES and report["ranks"] == 2
    got, ours = receiver.kv("one"), engine.kv_cache("one")
    assert len(got) == len(ours) == LAYERS
    for layer, (theirs, mine) in enumerate(zip(got, ours)):
        for a, b in zip(theirs, mine):
            assert (a is None) == (b is None) and (a is None or a.equal(b)), f"layer {layer}"
    moe = engine.stats()["moe_traffic_per_rank"]
    assert all(r["bytes"]["all_gather"] > 0 for r in moe)         # the "none" token flow ran
    print(f"CP 2: worst rel err vs HF (logits and caches) {worst:.2e}")
    release_all(engine, ["a", "b", "c", "one"])


def test_cp4_ep4_all_to_all(engines, v4, v4_oracle):
    """CP 4, EP 4 with the all-to-all token flow: hash-routed rows dispatched by the ranks that hold
    them, with their token ids."""
    engine = engines.get(v4, **interleave(4, ep_size=4, moe_a2a_backend="all_to_all"))
    worst = _run_cp(engine, v4_oracle, v4, CP_BATCHES)
    moe = engine.stats()["moe_traffic_per_rank"]
    assert all(r["pairs_sent"] > 0 for r in moe)
    print(f"CP 4: worst rel err vs HF (logits and caches) {worst:.2e}")
    release_all(engine, ["a", "b", "c", "one"])


def test_cp8_expert_tp(v4, v4_oracle):
    """CP 8 (each rank a few tokens of each request), EP 4 with expert TP 2: one batch, then a
    second chunk of one request beside a fresh one."""
    assert read_model_config(v4).num_hidden_layers == LAYERS
    batches = [BATCHES[0], [BATCHES[1][0], BATCHES[1][1]]]
    # used once: closed here rather than kept among the suite's shared engines (8 rank processes)
    args = EngineArgs(model_path=v4, max_total_tokens=4096, **interleave(8, ep_size=4))
    with Engine(args) as engine:
        worst = _run_cp(engine, v4_oracle, v4, batches)
        release_all(engine, ["a", "b", "c"])
    print(f"CP 8: worst rel err vs HF (logits and caches) {worst:.2e}")

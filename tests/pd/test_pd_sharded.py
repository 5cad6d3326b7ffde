"""PD with KV sharding: each CP rank of a sharded CP 2 zigzag engine sends the pages it owns of
every layer, so the receiver gets the whole cache (equal to HF and to the engine's gathered cache),
also after a second chunk over the sharded prefix; a request longer than one rank's pool travels
whole."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytest.importorskip("mooncake.engine",
                    reason="the Mooncake Transfer Engine is not importable: pip install "
                    "'graphcp[pd]' and apt-get install libibverbs1 librdmacm1 libnuma1 (README, "
                    "PD section)")

from testkit.engines import cp_kwargs
from testkit.hf_reference import rel_err
from testkit.parity import TOL, random_ids

from graphcp import Request
from graphcp.pd import KVReceiver

VOCAB = 211


def _kv_bytes(tokens: int) -> int:
    return 2 * 2 * tokens * 2 * 32 * 4      # layers x (k, v) x tokens x kv_heads x head_dim x 4 B


def test_sharded_ranks_send_their_pages(checkpoint, engines, oracle):
    flags = cp_kwargs(2, disaggregation_mode="prefill", cuda_graph_buckets=[64, 128],
                      enable_kv_cache_sharding=True, max_total_tokens=128)
    engine = engines.get(checkpoint, **flags)
    history = {"a": random_ids(100, VOCAB, 1), "b": random_ids(20, VOCAB, 2)}
    with KVReceiver(checkpoint, max_tokens=256, max_requests=2) as rx:
        engine.prefill([Request(rid, ids) for rid, ids in history.items()])
        chunk = random_ids(70, VOCAB, 3)       # "a" grows to 170 tokens: more than one rank's pool
        out = engine.prefill([Request("a", chunk)])
        assert out.cp_applied and out.mode == "graph", out.eager_reason
        history["a"] += chunk
        for rid, ids in history.items():
            report = engine.transfer_kv(rid, rx.destination(rid))
            assert report["bytes"] == _kv_bytes(len(ids))
            assert report["ranks"] == 2                    # each rank sent its own pages
            got, ours = rx.kv(rid), engine.kv_cache(rid)
            _, ref = oracle(checkpoint, ids)
            for layer, ((k, v), (k_ref, v_ref), (k_ours, v_ours)) in enumerate(zip(got, ref, ours)):
                assert k.shape == k_ref.shape, f"{rid} layer {layer}"
                assert max(rel_err(k, k_ref), rel_err(v, v_ref)) <= TOL, f"{rid} layer {layer}"
                assert k.equal(k_ours) and v.equal(v_ours), f"{rid} layer {layer}: not the pool's"
            rx.free(rid)
    for rid in history:
        engine.release(rid)
    assert engine.stats()["kv_pages_used_per_rank"] == [0, 0]

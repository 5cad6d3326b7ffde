"""CP composed with pipeline stages, attention TP and data-parallel attention: equal to HF, with each rank
holding only its shard of the weights."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from testkit.parity import Session, random_ids

from graphcp import ConfigError, Engine, EngineArgs
from graphcp.distributed.topology import rank_info, rank_map

VOCAB = 211
LAYOUTS = {
    "pp2-cp2": dict(tp_size=2, pp_size=2, attn_cp_size=2),
    "cp2-ffn-with-attention": dict(tp_size=2, attn_cp_size=2, ffn_tp_size=1, disable_cuda_graph=True),
    # graphs for attention TP inside CP: tests/models/test_moe.py (the seed's layout)
    "tp4-cp2-attn_tp2": dict(tp_size=4, attn_cp_size=2, disable_cuda_graph=True),
    "dp2-cp2-tp4": dict(tp_size=4, dp_size=2, attn_cp_size=2),
}


def test_rank_map():
    # The topology reads sizes only.
    args = SimpleNamespace(tp_size=4, dp_size=2, pp_size=2, cp_size=2, attn_tp_size=1, world_size=8)
    info = [rank_info(args, r) for r in range(8)]
    assert [(i.pp_rank, i.dp_rank, i.cp_rank, i.attn_tp_rank) for i in info[:4]] == \
        [(0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0), (0, 1, 1, 0)]
    assert info[5].pp_rank == 1 and info[5].cp_rank == 1
    assert "rank map" in rank_map(args)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composition_matches_hf(checkpoint, engines, oracle, name):
    engine = engines.get(checkpoint, enable_prefill_cp=True, cp_strategy="zigzag", **LAYOUTS[name])
    s = Session(engine, oracle, checkpoint)
    out = s.run([("a", random_ids(37, VOCAB, 1)), ("b", random_ids(9, VOCAB, 2)), ("c", random_ids(20, VOCAB, 3))])
    assert out.mode == "eager" and out.eager_reason and out.cp_applied
    s.run([("b", random_ids(12, VOCAB, 4)), ("d", random_ids(30, VOCAB, 5))])      # chunked + new
    s.run([("short", random_ids(2, VOCAB, 6))])                                        # unsharded fallback
    stats = engine.stats()
    per_rank = stats["weight_bytes_per_rank"]
    one = engines.get(checkpoint, disable_cuda_graph=True).stats()["weight_bytes"]
    # Each rank loads only its shard: the FFN is split over the TP world everywhere; heads and vocabulary over
    # attention TP; layers over stages. With DP x CP only the attention weights stay whole.
    if name == "cp2-ffn-with-attention":
        assert per_rank == [one, one]                   # --ffn-tp-size 1: the FFN stays whole per CP rank
    else:
        assert max(per_rank) < (0.8 if name == "dp2-cp2-tp4" else 0.5) * one, (per_rank, one)
    s.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_attention_tp_beyond_kv_heads_replicates_them(checkpoint, engines, oracle):
    """--tp 4 over 2 KV heads: each KV head on two ranks (as SGLang), in graphs and chunked; the
    engine's kv_cache holds each head once; every rank caches one head."""
    engine = engines.get(checkpoint, tp_size=4, cuda_graph_buckets=[64])
    one = engines.get(checkpoint, disable_cuda_graph=True)
    s = Session(engine, oracle, checkpoint)
    out = s.run([("a", random_ids(37, VOCAB, 1)), ("b", random_ids(9, VOCAB, 2))])
    assert out.mode == "graph", out.eager_reason
    s.run([("a", random_ids(20, VOCAB, 3)), ("c", random_ids(14, VOCAB, 4))])       # chunked + new
    assert s.worst <= 1e-4
    assert [k.shape[0] for k, _ in engine.kv_cache("a")] == [2] * len(engine.kv_cache("a"))
    # per rank: a quarter of the q heads and o_proj, half of k/v (one of two heads)
    stats, whole = engine.stats(), one.stats()["weight_bytes"]
    assert max(stats["weight_bytes_per_rank"]) < 0.5 * whole
    per_token = [st["kv_bytes_per_rank"][0] / st["kv_tokens_total"] for st in (stats, one.stats())]
    assert per_token[0] * 2 == per_token[1], per_token
    s.release_all()
    with pytest.raises(ConfigError, match="PD transfer"):
        Engine(EngineArgs(model_path=checkpoint, tp_size=4, disaggregation_mode="prefill"))


@pytest.mark.parametrize("kwargs,flag", [
    (dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag", ffn_tp_size=3), "--ffn-tp-size"),
    (dict(tp_size=3), "--tp"),                                   # 3 ranks over 2 KV heads, 4 q heads
    (dict(tp_size=2, pp_size=3, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag"), "--pp"),
])
def test_invalid_compositions(checkpoint, kwargs, flag, monkeypatch):
    """Refused from the flags and the model's config alone, before any rank process starts."""
    import subprocess

    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank process was started for flags that cannot work")
    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(ConfigError, match=flag):
        Engine(EngineArgs(model_path=checkpoint, max_total_tokens=1024, **kwargs))


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True,
                                                          cp_strategy="zigzag")], ids=["tp2", "cp2_ffn_tp2"])
def test_row_split_biases_match_hf(ckpt_dir, oracle, layout):
    """Biases of row-split layers are added once, after the sum: o_proj and down_proj split over attention TP
    (all-reduce), and down_proj behind the layer communicator (reduce-scatter)."""
    from testkit.hf_reference import make_checkpoint
    from testkit.parity import Session, random_ids
    path = make_checkpoint(str(ckpt_dir / "llama-biases-tp"), "llama", seed=5, attention_bias=True, mlp_bias=True)
    with Engine(EngineArgs(model_path=path, max_total_tokens=2048, **layout)) as engine:
        s = Session(engine, oracle, path)
        s.run([("a", random_ids(33, 211, 1)), ("b", random_ids(70, 211, 2))])
        s.run([("a", random_ids(12, 211, 3))])

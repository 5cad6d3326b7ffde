"""KV sequence sharding over MLA caches: Kimi-K2 (dense MLA) at zigzag CP 2 in graphs and GLM-5
(DSA: MLA rows and indexer keys, a shared-indexer layer) at interleave CP 2, equal to HF (logits,
and the latent / RoPE / indexer caches gathered from their owners) in chunked prefill over a
sharded prefix; and sliding-window layers beside full ones (Qwen3 with ``layer_types``), whose
window-only caches come back as HF keeps them."""
from __future__ import annotations

import pytest
from testkit.dsa_checkpoint import INTERLEAVE, DSAOracle, make_dsa_checkpoint
from testkit.engines import cp_kwargs
from testkit.hf_reference import make_checkpoint, rel_err
from testkit.mla_checkpoint import KIMI_K2, MLAOracle, write_release
from testkit.parity import TOL, Session, random_ids

from graphcp import Request

VOCAB = 211
FIRST = [("a", random_ids(30, VOCAB, 1)), ("b", random_ids(19, VOCAB, 2))]
SECOND = [("a", random_ids(13, VOCAB, 3)), ("c", random_ids(25, VOCAB, 4))]   # a: cached prefix
THIRD = [("a", random_ids(5, VOCAB, 5))]
SHARDED = dict(tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, max_total_tokens=64)


def _check(engine, oracle, path: str, batches) -> list:
    """Each request against HF on its whole history: logits and every cached part (None parts:
    a shared indexer layer, or dense MLA's missing indexer). Releases every rid."""
    history, worst, outs = {}, 0.0, []
    for batch in batches:
        out = engine.prefill([Request(rid, ids) for rid, ids in batch])
        outs.append(out)
        for i, (rid, ids) in enumerate(batch):
            history[rid] = history.get(rid, []) + ids
            logits, ref = oracle(path, history[rid])
            errs = [rel_err(out.logits[i], logits)]
            ours = engine.kv_cache(rid)
            assert len(ours) == len(ref)
            for layer, (mine, theirs) in enumerate(zip(ours, ref)):
                for a, b in zip(mine, theirs):
                    assert (a is None) == (b is None), f"{rid} layer {layer}"
                    if b is not None:
                        assert a.shape == b.shape, f"{rid} layer {layer}: {a.shape} vs {b.shape}"
                        errs.append(rel_err(a, b))
            assert max(errs) <= TOL, f"{rid}: rel err {max(errs):.2e} ({out.mode})"
            worst = max(worst, *errs)
    for rid in history:
        engine.release(rid)
    print(f"worst rel err {worst:.2e}")
    return outs


def test_mla_cp2_zigzag_sharded_in_graphs(engines, ckpt_dir):
    ckpt, twin = write_release(str(ckpt_dir / "kimi-k2-shard"), KIMI_K2, seed=32,
                               num_hidden_layers=2, n_routed_experts=16)
    engine = engines.get(ckpt, enable_prefill_cp=True, cp_strategy="zigzag",
                         cuda_graph_buckets=[32], **SHARDED)
    assert engine.stats()["kv_tokens_total"] == 2 * 64
    outs = _check(engine, MLAOracle(), twin, [FIRST, SECOND, THIRD])
    assert [o.mode for o in outs[:2]] == ["graph", "graph"], outs[0].eager_reason
    stats = engine.stats()
    assert stats["kv_pages_used_per_rank"] == [0, 0] and stats["kv_prefix_gathered_bytes"] > 0


def test_dsa_cp2_interleave_sharded(engines, ckpt_dir):
    path = make_dsa_checkpoint(str(ckpt_dir / "glm5-shard"), "GlmMoeDsa", seed=22, n_group=1,
                               topk_group=1, mlp_layer_types=["dense", "sparse", "sparse"],
                               indexer_types=["full", "shared", "full"])
    engine = engines.get(path, **INTERLEAVE, **SHARDED)
    outs = _check(engine, DSAOracle(), path, [FIRST, SECOND])
    assert all(o.cp_applied for o in outs)
    assert engine.stats()["kv_pages_used_per_rank"] == [0, 0]


def test_sliding_window_layers_sharded_cp2_zigzag(engines, oracle, ckpt_dir):
    """Sliding layers gather every row under sharding (no halo-only path): the owners need them."""
    path = make_checkpoint(str(ckpt_dir / "qwen3-w8-shard"), "qwen3", num_hidden_layers=3,
                           use_sliding_window=True, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    engine = engines.get(path, **cp_kwargs(2, enable_kv_cache_sharding=True, max_total_tokens=128,
                                           cuda_graph_buckets=[64]))
    s = Session(engine, oracle, path)
    out = s.run([("a", random_ids(70, VOCAB, 1)), ("b", random_ids(30, VOCAB, 2))])
    assert out.mode == "graph", out.eager_reason
    s.run([("a", random_ids(90, VOCAB, 3))])            # "a": 160 tokens, past one rank's pool
    s.release_all()
    assert engine.collective_counts()["gathered_layers"].get("sliding", 0) == 0
    assert engine.stats()["kv_pages_used_per_rank"] == [0, 0]


@pytest.mark.parametrize("kind", ["gated_deltanet", "deepseek_v4_csa"])
def test_unsharded_kinds_are_refused(kind):
    import types

    from graphcp import ConfigError
    from graphcp.checkpoint.config import check_sharded_kinds
    with pytest.raises(ConfigError, match=f"--enable-kv-cache-sharding.*{kind}"):
        check_sharded_kinds(types.SimpleNamespace(attention_kinds=["gqa", kind]))

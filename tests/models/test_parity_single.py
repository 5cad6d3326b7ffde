"""One rank, eager and graph: logits and KV equal HF transformers on Llama, Mistral, Qwen2, Qwen3."""
from __future__ import annotations

import pytest
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, graph_and_eager, random_ids

VOCAB = 211

ARCHS = {
    "llama": dict(family="llama"),
    "llama3_rope_tied": dict(family="llama", tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(family="mistral", num_key_value_heads=1),
    "qwen2_bias": dict(family="qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
    "llama_biases": dict(family="llama", attention_bias=True, mlp_bias=True),       # q/k/v/o and gate/up/down
    "qwen3_attention_bias": dict(family="qwen3", attention_bias=True),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_checkpoint(request, ckpt_dir):
    spec = dict(ARCHS[request.param])
    return make_checkpoint(str(ckpt_dir / request.param), spec.pop("family"), seed=3, **spec)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_mixed_lengths_match_hf(arch_checkpoint, engines, oracle, graphs):
    engine = engines.get(arch_checkpoint, disable_cuda_graph=not graphs)
    s = Session(engine, oracle, arch_checkpoint)
    out = s.run([("a", random_ids(1, VOCAB, 1)), ("b", random_ids(37, VOCAB, 2)), ("c", random_ids(150, VOCAB, 3))])
    assert out.mode == ("graph" if graphs else "eager")
    assert out.cp_applied is False and out.per_rank_tokens == [188]
    s.release_all()


def test_qwen3_long_and_chunked(checkpoint, engines, oracle):
    """A few hundred tokens, then the same request extended in three chunks (chunked prefill = cached prefix)."""
    engine = engines.get(checkpoint)
    s = Session(engine, oracle, checkpoint)
    s.run([("long", random_ids(300, VOCAB, 4)), ("one", random_ids(1, VOCAB, 5))])
    ids = random_ids(90, VOCAB, 6)
    for chunk in (ids[:40], ids[40:41], ids[41:]):
        s.run([("chunked", chunk)])
    assert engine.kv_cache("chunked")[0][0].shape[1] == 90
    s.release_all()


def test_graph_equals_eager_bitwise(checkpoint, engines):
    from graphcp import Request
    engine = engines.get(checkpoint)
    for seed, lens in enumerate([[5], [3, 17, 30], [60, 1, 2, 9], [120, 100]]):
        batch = [Request(f"r{i}", random_ids(n, VOCAB, 10 * seed + i)) for i, n in enumerate(lens)]
        graph, eager = graph_and_eager(engine, batch)
        assert graph.mode == "graph" and eager.mode == "eager", graph.eager_reason
        assert eager.eager_reason == "eager forced by the caller (force_eager=True)"
        assert (graph.logits - eager.logits).abs().max().item() <= 1e-6


def test_stats_and_page_accounting(checkpoint, engines):
    from graphcp import Request
    engine = engines.get(checkpoint)
    stats = engine.stats()
    assert stats["world_size"] == 1 and stats["graph_buckets"]
    total, free = stats["kv_tokens_total"], stats["kv_tokens_free"]
    assert total == 8192 and free == total
    engine.prefill([Request("x", random_ids(17, VOCAB, 1))])
    assert engine.stats()["kv_tokens_free"] == free - 32            # 17 tokens take two pages of 16
    engine.prefill([Request("x", random_ids(15, VOCAB, 2))])         # 32 tokens: still two pages
    assert engine.stats()["kv_tokens_free"] == free - 32
    engine.prefill([Request("x", random_ids(1, VOCAB, 3))])
    assert engine.stats()["kv_tokens_free"] == free - 48
    engine.release("x")
    assert engine.stats()["kv_tokens_free"] == free


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_other_page_sizes(checkpoint, engines, oracle, page_size):
    engine = engines.get(checkpoint, page_size=page_size, cuda_graph_buckets=[32, 64])
    s = Session(engine, oracle, checkpoint)
    out = s.run([("p", random_ids(45, VOCAB, 1)), ("q", random_ids(7, VOCAB, 2))])
    assert out.mode == "graph"
    s.run([("p", random_ids(30, VOCAB, 3))])
    s.release_all()


def test_bfloat16_runs_close_to_fp32(checkpoint, engines):
    from graphcp import Request
    ids = random_ids(60, VOCAB, 4)
    fp32 = engines.get(checkpoint).prefill([Request("x", ids)]).logits
    engines.get(checkpoint).release("x")
    bf16_engine = engines.get(checkpoint, dtype="bfloat16")
    bf16 = bf16_engine.prefill([Request("x", ids)]).logits
    bf16_engine.release("x")
    assert bf16.dtype == fp32.dtype == __import__("torch").float32
    assert float((bf16 - fp32).abs().max() / fp32.abs().max()) < 5e-2


def test_sharded_checkpoint_with_index(ckpt_dir, engines, oracle):
    import os

    import transformers
    path = str(ckpt_dir / "qwen2_sharded")
    src = make_checkpoint(str(ckpt_dir / "qwen2_unsharded"), "qwen2", seed=9)
    transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(path, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    engine = engines.get(path, disable_cuda_graph=True)
    s = Session(engine, oracle, path)
    s.run([("s", random_ids(33, VOCAB, 1))])
    s.release_all()

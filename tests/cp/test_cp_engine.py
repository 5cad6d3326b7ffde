"""Context-parallel prefill over real gloo ranks: every CP size, both strategies, both attention paths
equal HF transformers; zigzag falls back unsharded on short requests; one K/V all-gather per layer."""
from __future__ import annotations

import pytest
from testkit.engines import cp_kwargs
from testkit.parity import Session, graph_and_eager, random_ids

from graphcp import Request
from graphcp.cp import build_layout

VOCAB = 211
LAYERS = 2

CASES = [
    (2, "zigzag", "trtllm_mha"), (2, "zigzag", "flashattention"), (2, "interleave", "auto"),
    (3, "zigzag", "trtllm_mha"), (3, "interleave", "auto"),
    (4, "zigzag", "flashattention"), (4, "zigzag", "trtllm_mha"), (4, "interleave", "auto"),
]


@pytest.mark.parametrize("cp,strategy,backend", CASES, ids=[f"cp{c}-{s}-{b}" for c, s, b in CASES])
def test_cp_matches_hf(checkpoint, engines, oracle, cp, strategy, backend):
    engine = engines.get(checkpoint, **cp_kwargs(cp, strategy, attention_backend=backend))
    s = Session(engine, oracle, checkpoint)
    before = engine.collective_counts()["all_gathers"]
    ext = [8 * cp + 3, 45, 2 * cp, 101]
    out = s.run([(f"r{i}", random_ids(n, VOCAB, 100 + i)) for i, n in enumerate(ext)])
    assert out.cp_applied is True
    assert engine.collective_counts()["all_gathers"] - before == LAYERS      # one collective per layer
    assert out.per_rank_tokens == build_layout(strategy, cp, 0, ext).per_rank_tokens
    if strategy == "zigzag" and backend == "trtllm_mha":
        assert out.mode == "graph", out.eager_reason
    else:
        assert out.mode == "eager" and out.eager_reason
    # Cached prefixes: extend two requests (chunked prefill) next to a fresh one.
    out = s.run([("r1", random_ids(33, VOCAB, 7)), ("fresh", random_ids(4 * cp, VOCAB, 8)),
                 ("r3", random_ids(2 * cp + 1, VOCAB, 9))])
    assert out.cp_applied is True
    # Too short for zigzag: the batch runs unsharded and is still exact.
    out = s.run([("short", random_ids(2 * cp - 1, VOCAB, 10)), ("r0", random_ids(5, VOCAB, 11))])
    if strategy == "zigzag":
        assert out.cp_applied is False and out.per_rank_tokens == [2 * cp + 4] * cp
        if backend == "trtllm_mha":
            assert out.mode == "eager" and "zigzag needs every request" in out.eager_reason
    else:
        assert out.cp_applied is True
    s.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_cp2_graph_equals_eager(checkpoint, engines):
    engine = engines.get(checkpoint, **cp_kwargs(2))
    for seed, lens in enumerate([[16], [9, 30, 17], [200, 4, 60], [64] * 8]):
        batch = [Request(f"g{i}", random_ids(n, VOCAB, 40 * seed + i)) for i, n in enumerate(lens)]
        graph, eager = graph_and_eager(engine, batch)
        assert graph.mode == "graph", graph.eager_reason
        assert (graph.logits - eager.logits).abs().max().item() <= 1e-6

"""Adaptive CP (--enable-adaptive-cp): short requests whole on one CP rank, long ones zigzag; logits and
KV equal HF for all-short, mixed and all-long batches, graph and eager, each token counted once."""
from __future__ import annotations

import pytest
import torch

from conftest import cp_kwargs
from graphcp import ConfigError, EngineArgs, Request
from graphcp.cp.adaptive import AdaptiveZigzagStrategy
from parity import Session, graph_and_eager, random_ids

VOCAB, THRESHOLD = 211, 48


def test_placement_covers_every_token_once():
    strategy = AdaptiveZigzagStrategy(3, THRESHOLD)
    ext, prefix = [5, 100, 30, 1, 47, 60, 9], [0, 3, 10, 0, 2, 0, 40]
    placed = strategy.for_batch(ext, prefix)
    assert [w == 0 for w in placed.whole_on] == [n >= THRESHOLD for n in ext]
    counts, cap = placed.per_rank_tokens(ext), strategy.layout(ext, prefix, 0).local_cap
    assert sum(counts) == sum(ext)
    lens, pre = torch.tensor(ext), torch.tensor(prefix)
    pages = torch.arange(len(ext) * 160).view(len(ext), 160)
    seen, owners = [], torch.zeros(len(ext), dtype=torch.long)
    for rank in range(3):
        meta = placed.metadata(lens, pre, pages, rank, cap, 1, torch.tensor(placed.whole_on))
        valid = meta.valid.bool()
        assert int(valid.sum()) == counts[rank]
        seen += meta.token_index[valid].tolist()
        owners += meta.logit_owner
        last = meta.token_index[meta.logit_rows][meta.logit_owner.bool()]     # each owned row is a last token
        ends = torch.cumsum(lens, 0) - 1
        assert last.tolist() == ends[meta.logit_owner.bool()].tolist()
    assert sorted(seen) == list(range(sum(ext))) and owners.tolist() == [1] * len(ext)


def _engine(engines, path):
    return engines.get(path, **cp_kwargs(2, "zigzag", enable_adaptive_cp=True, adaptive_cp_threshold=THRESHOLD,
                                         cuda_graph_buckets=[32, 64, 128]))


BATCHES = {"all_short": [5, 30, 1, 47, 12, 20], "mixed": [100, 9, 30, 60, 3, 40], "all_long": [64, 100, 50]}


@pytest.mark.parametrize("name", list(BATCHES))
def test_adaptive_matches_hf(checkpoint, engines, oracle, name):
    engine = _engine(engines, checkpoint)
    s = Session(engine, oracle, checkpoint)
    lens = BATCHES[name]
    batch = [(f"{name}{i}", random_ids(n, VOCAB, 60 + i)) for i, n in enumerate(lens)]
    out = s.run(batch)
    assert out.mode == "graph" and out.cp_applied, out.eager_reason
    counts = out.per_rank_tokens
    assert sum(counts) == sum(lens) and max(counts) <= 1.3 * sum(counts) / len(counts), counts
    out = s.run([(batch[0][0], random_ids(7, VOCAB, 70)), ("new", random_ids(55, VOCAB, 71))])   # chunked
    assert out.cp_applied
    s.release_all()
    graph, eager = graph_and_eager(engine, [Request(rid, ids) for rid, ids in batch])
    assert graph.mode == "graph" and eager.mode == "eager"
    assert (graph.logits - eager.logits).abs().max().item() <= 1e-6


def test_adaptive_needs_zigzag_cp(checkpoint):
    with pytest.raises(ConfigError, match="--enable-adaptive-cp"):
        EngineArgs(model_path=checkpoint, **cp_kwargs(2, "interleave", enable_adaptive_cp=True))
    with pytest.raises(ConfigError, match="--adaptive-cp-threshold"):
        EngineArgs(model_path=checkpoint, adaptive_cp_threshold=10)


def test_threshold_from_the_cost_model():
    from graphcp.cp.adaptive import CostModel
    # Splitting saves (1 - 1/C) w(n) and costs n g: with C = 2, g = 3, a = 1, b = 0.01 -> n > 2 * 5 / 0.01.
    assert CostModel(1.0, 0.01, per_gather_token=3.0).split_from(2) == 1000
    assert CostModel(1.0, 0.01, per_gather_token=0.1).split_from(2) == 4      # cheap gathers: always split


def test_calibrated_at_start(checkpoint, engines, oracle):
    engine = engines.get(checkpoint, **cp_kwargs(2, "zigzag", enable_adaptive_cp=True, cuda_graph_buckets=[64, 128]))
    model = engine.stats()["adaptive_cp"]
    assert model["threshold"] >= 4 and model["per_token_s"] > 0 and model["per_pair_s"] > 0
    assert model["per_gather_token_s"] > 0
    s = Session(engine, oracle, checkpoint)
    out = s.run([(f"c{i}", random_ids(n, VOCAB, 80 + i)) for i, n in enumerate(BATCHES["mixed"])])
    assert sum(out.per_rank_tokens) == sum(BATCHES["mixed"]) and out.cp_applied
    s.release_all()

"""Sliding-window models served past the window, equal to HF transformers (fp32, rel err <= 1e-4).

Which layers attend through the window is read as transformers 5 reads the config (checked against
transformers' own config classes). The engine runs 116-token requests (7x a 16-token window) in
chunks, at CP 1, 2 and 4, zigzag (graphs) and interleave, graph and eager. Compared with HF on each
request's whole history: the last token's logits, and per layer the K/V the cache holds: every
token's for full layers, the last W - 1 tokens' for sliding layers (HF's DynamicSlidingWindowLayer
keeps exactly those; ``engine.kv_cache`` returns the same, which is all a later chunk reads).
"""
from __future__ import annotations

import pytest
import transformers
from testkit.engines import cp_kwargs
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, graph_and_eager, random_ids

from graphcp import ConfigError, Request
from graphcp.models.llama.config import sliding_layers

WINDOW, VOCAB, LONG = 16, 211, 116
SLIDING = "sliding_attention"
QWEN3_TYPES = [SLIDING, "full_attention", SLIDING]


def _hf_sliding(raw: dict, arch: str, layers: int) -> tuple:
    """What transformers' modeling files window: Mistral and Qwen3-MoE every layer when the
    config's (post-init) sliding_window is set; Qwen2/Qwen3 the layer_types marked sliding."""
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        num_hidden_layers=layers, **raw)
    if arch in ("MistralForCausalLM", "Qwen3MoeForCausalLM"):
        return (config.sliding_window, tuple(range(layers))) if config.sliding_window else (None, ())
    sliding = tuple(i for i, t in enumerate(config.layer_types) if t == SLIDING)
    return (config.sliding_window, sliding) if sliding else (None, ())


@pytest.mark.parametrize("raw,arch", [
    ({"sliding_window": 4096}, "MistralForCausalLM"),
    ({"sliding_window": None}, "MistralForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": False, "max_window_layers": 0}, "Qwen2ForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, "Qwen2ForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3}, "Qwen2ForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": True, "layer_types": QWEN3_TYPES},
     "Qwen3ForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, "Qwen3ForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
     "Qwen3MoeForCausalLM"),
    ({"sliding_window": 64, "use_sliding_window": False}, "Qwen3MoeForCausalLM"),
])
def test_sliding_layers_are_transformers(raw, arch):
    assert sliding_layers(dict(raw), arch, 3) == _hf_sliding(raw, arch, 3)


def test_llama_has_none_and_bad_layer_types_are_refused():
    assert sliding_layers({"sliding_window": 64}, "LlamaForCausalLM", 2) == (None, ())
    # transformers cannot run a sliding layer without a window (its mask raises): refused by name
    with pytest.raises(ConfigError, match="layer_types"):
        sliding_layers({"sliding_window": 64, "layer_types": QWEN3_TYPES}, "Qwen3ForCausalLM", 3)
    with pytest.raises(ConfigError, match="layer_types"):
        sliding_layers({"sliding_window": 8, "use_sliding_window": True,
                        "layer_types": [SLIDING]}, "Qwen2ForCausalLM", 3)
    with pytest.raises(ConfigError, match="sliding_window"):
        sliding_layers({"sliding_window": 0}, "MistralForCausalLM", 3)


@pytest.fixture(scope="module")
def mistral(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "mistral-w16"), "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen3(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "qwen3-w16"), "qwen3", num_hidden_layers=3,
                           use_sliding_window=True, sliding_window=WINDOW, layer_types=QWEN3_TYPES)


def _serve(engine, oracle, path, graph: bool) -> None:
    """Three requests: one whole (116 tokens), one in chunks of 50 + 66, one shorter than the
    window then extended past it; then a third chunk on a request's window-only cache."""
    s = Session(engine, oracle, path)
    ids = [random_ids(LONG, VOCAB, seed) for seed in range(3)]
    out = s.run([("a", ids[0][:50]), ("b", ids[1][:9]), ("c", ids[2])])
    assert out.mode == ("graph" if graph else "eager"), out.eager_reason
    s.run([("a", ids[0][50:]), ("b", ids[1][9:])])
    s.run([("b", random_ids(2 * WINDOW + 3, VOCAB, 7))])
    s.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


@pytest.mark.parametrize("model", ["mistral", "qwen3"])
def test_one_rank_serves_past_the_window(request, engines, oracle, model):
    path = request.getfixturevalue(model)
    engine = engines.get(path, cuda_graph_buckets=[32, 64, 128, 256])
    assert not engine.stats()["capture_failures"]
    _serve(engine, oracle, path, graph=True)
    batch = [Request(f"g{i}", random_ids(n, VOCAB, 20 + i)) for i, n in enumerate([LONG, 40])]
    graph, eager = graph_and_eager(engine, batch)
    assert graph.mode == "graph" and (graph.logits - eager.logits).abs().max() <= 1e-6


CP_CASES = [("mistral", 2, "zigzag"), ("mistral", 4, "interleave"),
            ("qwen3", 4, "zigzag"), ("qwen3", 2, "interleave")]


@pytest.mark.parametrize("model,cp,strategy", CP_CASES, ids=[f"{m}-cp{c}-{s}" for m, c, s in CP_CASES])
def test_context_parallel_serves_past_the_window(request, engines, oracle, model, cp, strategy):
    """Zigzag's blocks (14-15 tokens at CP 4: under the window, so a block's window reaches
    back over several ranks' blocks) and interleave's strided rows, chunked over cached prefixes."""
    path = request.getfixturevalue(model)
    engine = engines.get(path, **cp_kwargs(cp, strategy, cuda_graph_buckets=[32, 64, 128, 256]))
    _serve(engine, oracle, path, graph=strategy == "zigzag")
    if strategy == "zigzag":
        batch = [Request(f"g{i}", random_ids(n, VOCAB, 30 + i)) for i, n in enumerate([LONG, 4 * cp])]
        graph, eager = graph_and_eager(engine, batch)
        assert graph.mode == "graph" and (graph.logits - eager.logits).abs().max() <= 1e-6

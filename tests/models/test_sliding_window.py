"""Sliding-window models: graphcp has no windowed kernels, so it caps the context at the window, where full
causal attention is exact, and refuses longer requests instead of answering them wrongly."""
from __future__ import annotations

import pytest
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, random_ids

from graphcp import Request, RequestError
from graphcp.models.llama.config import sliding_window

WINDOW = 24


@pytest.mark.parametrize("raw,arch,window", [
    ({"sliding_window": 4096}, "MistralForCausalLM", 4096),
    ({"sliding_window": None}, "MistralForCausalLM", None),
    ({"sliding_window": 64}, "LlamaForCausalLM", None),
    ({"sliding_window": 64, "use_sliding_window": False, "max_window_layers": 0}, "Qwen2ForCausalLM", None),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, "Qwen2ForCausalLM", 64),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, "Qwen2ForCausalLM", None),
    ({"sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]}, "Qwen3ForCausalLM", 64),
    ({"sliding_window": 64, "layer_types": ["full_attention", "full_attention"]}, "Qwen3ForCausalLM", None),
])
def test_which_configs_use_a_window(raw, arch, window):
    assert sliding_window(raw, arch, 2) == window


@pytest.fixture(scope="module")
def windowed(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "mistral-window"), "mistral", sliding_window=WINDOW)


def test_requests_within_the_window_match_hf_and_longer_ones_are_refused(engines, oracle, windowed):
    engine = engines.get(windowed, device="cpu")
    # Buckets that no batch within the capped context can fill are skipped at capture (served eagerly), not
    # a failed start.
    failures = engine.stats()["capture_failures"]
    assert 512 in failures and "context limit 24" in str(failures[512]) and engine.stats()["graph_buckets"]
    session = Session(engine, oracle, windowed)
    # Logits only: HF's sliding-window cache keeps just the last window - 1 keys, graphcp's keeps them all.
    session.run([("a", random_ids(WINDOW, 211, 1)), ("b", random_ids(9, 211, 2))], check_kv=False)
    session.run([("b", random_ids(WINDOW - 9, 211, 3))], check_kv=False)   # chunked up to the window exactly
    with pytest.raises(RequestError, match=f"context limit of {WINDOW}"):
        engine.prefill([Request("c", random_ids(WINDOW + 1, 211, 4))])
    with pytest.raises(RequestError, match=f"context limit of {WINDOW}"):
        engine.prefill([Request("a", [5])])                                  # one token past it
    session.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]

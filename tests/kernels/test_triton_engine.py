"""The engine with graphcp's Triton kernel (Triton interpreter on CPU) at CP=2 equals HF transformers."""
from __future__ import annotations

import pytest
from testkit.engines import cp_kwargs
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, random_ids

pytest.importorskip("triton")
VOCAB = 211


@pytest.fixture(scope="module")
def hd64_checkpoint(ckpt_dir):
    # A power-of-two head_dim (no padded tile); keep the model one layer deep for the interpreter.
    return make_checkpoint(str(ckpt_dir / "llama_hd64"), "llama", seed=5, hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1, num_hidden_layers=1)


@pytest.mark.parametrize("strategy,backend", [("zigzag", "trtllm_mha"), ("zigzag", "flashattention"),
                                              ("interleave", "auto")])
def test_triton_kernel_cp2_matches_hf(hd64_checkpoint, engines, oracle, strategy, backend):
    engine = engines.get(hd64_checkpoint, **cp_kwargs(2, strategy, attention_kernel="triton",
                                                      attention_backend=backend, cuda_graph_buckets=[16, 32]))
    assert engine.stats()["attention_kernel"] == "triton"
    s = Session(engine, oracle, hd64_checkpoint)
    out = s.run([("a", random_ids(21, VOCAB, 1)), ("b", random_ids(8, VOCAB, 2))])
    assert out.cp_applied
    if strategy == "zigzag" and backend == "trtllm_mha":
        assert out.mode == "graph"
    s.run([("a", random_ids(6, VOCAB, 3))])          # cached prefix
    s.release_all()

"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``) equal to HF transformers on tiny checkpoints written
as released (``tests/testkit/glm_checkpoint.py``: released config.json shrunk, sharded, MTP layer;
GLM-4.5-Air in bf16 with two expert groups, GLM-4.7 in compressed-tensors FP8 per channel): last-
token logits and every layer's K/V (after partial RoPE) in chunked prefill, at one rank (graphs and
eager), zigzag CP 2 in graphs with attention TP 2, EP 2 and expert TP 2 inside it, interleave CP 2;
FP8 weights stay FP8 and each rank reads its slice; a bad FP8 checkpoint is refused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.glm_checkpoint import release_config, write_release
from testkit.hf_reference import rel_err
from testkit.parity import Session, graph_and_eager, random_ids
from testkit.paths import REPO

from graphcp import ConfigError, Engine, EngineArgs, Request
from graphcp.checkpoint.config import read_model_config
from graphcp.kernels.fp8_types import FP8
from graphcp.models.glm4_moe.config import Glm4MoeConfig

VOCAB = 211
FIRST = [("a", random_ids(30, VOCAB, 1)), ("b", random_ids(9, VOCAB, 2)),
         ("c", random_ids(20, VOCAB, 3))]                                   # 59 tokens
SECOND = [("b", random_ids(12, VOCAB, 4)), ("d", random_ids(30, VOCAB, 5))]   # b: cached prefix
ONE_RANK = dict(cuda_graph_buckets=[64])        # each batch fits; CP 2: 32 per rank
ZIGZAG = dict(enable_prefill_cp=True, cp_strategy="zigzag", cuda_graph_buckets=[32])


@pytest.fixture(scope="module")
def air(ckpt_dir):
    """GLM-4.5-Air as released (bf16, q/k/v biases, no q/k norm, half the head rotated, one dense
    layer), 8 experts in two groups of which one is kept, top-2."""
    return write_release(str(ckpt_dir / "glm-4.5-air"), release_config("glm-4.5-air"), seed=41,
                         num_hidden_layers=2, n_group=2, topk_group=1)


@pytest.fixture(scope="module")
def fp8(ckpt_dir):
    """GLM-4.7 (as GLM-4.5/4.6: q/k norm, routed scaling 2.5) in compressed-tensors FP8 as the FP8
    releases are; three layers, the first dense."""
    return write_release(str(ckpt_dir / "glm-4.7-fp8"), release_config("glm-4.7"), seed=42,
                         fp8=True, num_hidden_layers=3, first_k_dense_replace=1)


def _run(engine, oracle, path: str, batches, modes: list[str]) -> float:
    """``batches`` in a Session (each rid against HF on its whole history); their modes."""
    s = Session(engine, oracle, path)
    for batch, mode in zip(batches, modes):
        out = s.run(batch)
        assert out.mode == mode, out.eager_reason
    s.release_all()
    print(f"worst rel err {s.worst:.2e}")
    return s.worst


def _graph_equals_eager(engine) -> None:
    batch = [Request("g", random_ids(29, VOCAB, 9)), Request("h", random_ids(14, VOCAB, 10))]
    graph, eager = graph_and_eager(engine, batch)
    assert graph.mode == "graph" and eager.mode == "eager", graph.eager_reason
    assert rel_err(graph.logits, eager.logits) <= 1e-6


def test_config_as_hf_builds_it(air, fp8):
    """The MoE layers, the rotary part and the routing as transformers builds them, the releases'
    MTP layers named as unused."""
    import transformers
    for path in (air[0], fp8[1]):
        cfg = read_model_config(path)
        with torch.device("meta"):
            hf = transformers.Glm4MoeForCausalLM(transformers.AutoConfig.from_pretrained(path))
        moe = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
        assert cfg.moe_layers == moe and len(moe) == cfg.num_hidden_layers - 1
        assert Glm4MoeConfig.of(cfg).rotary_dim == hf.model.rotary_emb.inv_freq.numel() * 2 == 16
    g = Glm4MoeConfig.of(read_model_config(air[0])).routing
    assert (g.n_group, g.topk_group, g.routed_scaling_factor, g.n_shared_experts) == (2, 1, 1.0, 1)
    released = read_model_config(os.path.join(REPO, "docs", "configs", "glm-4.7"))
    assert released.moe_layers == tuple(range(3, 92)) and released.qk_norm and released.qkv_bias
    assert Glm4MoeConfig.of(released).rotary_dim == 64 and not released.o_bias


def test_air_one_rank_in_graphs(engines, oracle, air):
    """Chunked prefill (a cached prefix) in graphs, then eager; graph equal to eager."""
    engine = engines.get(air[0], **ONE_RANK)
    assert _run(engine, oracle, air[1], [FIRST, SECOND], ["graph", "graph"]) <= 1e-4
    out = Session(engine, oracle, air[1]).run([("e", random_ids(21, VOCAB, 6))], force_eager=True)
    assert out.mode == "eager"
    engine.release("e")
    _graph_equals_eager(engine)


def test_fp8_one_rank_in_graphs(engines, oracle, fp8):
    """The forward equals HF on the dequantized twin, and the FP8 rounding did change the model."""
    engine = engines.get(fp8[0], **ONE_RANK)
    assert _run(engine, oracle, fp8[1], [FIRST, SECOND], ["graph", "graph"]) <= 1e-4
    ids = FIRST[0][1]
    assert rel_err(oracle(fp8[1].replace("oracle", "hf-save"), ids)[0], oracle(fp8[1], ids)[0]) \
        > 1e-4


def test_fp8_cp2_zigzag_attention_tp2_ep2_in_graphs(engines, oracle, fp8):
    """--tp 4 --attn-cp-size 2 --ep 2: zigzag CP 2 in graphs with attention TP 2 inside it (heads
    and the vocabulary split), the dense FFN and the shared experts over the 4 ranks, each EP rank
    holding 4 of the 8 FP8 experts, each of them split over 2 expert-TP ranks (o_proj and down_proj
    split along the inputs of their per-channel-scaled rows). Graph equal to eager."""
    engine = engines.get(fp8[0], tp_size=4, ep_size=2, attn_cp_size=2, **ZIGZAG)
    assert _run(engine, oracle, fp8[1], [FIRST, SECOND], ["graph", "graph"]) <= 1e-4
    _graph_equals_eager(engine)
    one = engines.get(fp8[0], **ONE_RANK).stats()["weight_bytes"]
    assert max(engine.stats()["weight_bytes_per_rank"]) < 0.6 * one


def test_air_cp2_interleave(engines, oracle, air):
    engine = engines.get(air[0], tp_size=2, attn_cp_size=2, enable_prefill_cp=True,
                         cp_strategy="interleave", disable_cuda_graph=True)
    s = Session(engine, oracle, air[1])
    out = s.run(FIRST)
    assert out.cp_applied and out.per_rank_tokens == [30, 29]
    s.run(SECOND)
    s.release_all()
    print(f"worst rel err {s.worst:.2e}")


@pytest.mark.parametrize("damage,match", [
    ("missing_scale", "lacks 1 tensors.*'model.layers.1.mlp.experts.3.up_proj.weight_scale'"),
    ("wrong_scale", "model.layers.0.self_attn.o_proj.weight_scale has shape \\[64, 2\\].*"
                    "\\[64, 1\\]"),
    ("stray_mtp", "does not use.*'model.layers.4.eh_proj.weight'"),
])
def test_bad_fp8_checkpoint_refused(fp8, tmp_path, damage, match):
    """Errors name the tensors as the checkpoint does (``weight_scale``)."""
    d = str(shutil.copytree(fp8[0], tmp_path / damage))
    index_path = os.path.join(d, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    name = {"missing_scale": "model.layers.1.mlp.experts.3.up_proj.weight_scale",
            "wrong_scale": "model.layers.0.self_attn.o_proj.weight_scale",
            "stray_mtp": "model.layers.0.self_attn.o_proj.weight"}[damage]
    shard = index["weight_map"][name]
    tensors = load_file(os.path.join(d, shard))
    if damage == "missing_scale":
        del tensors[name], index["weight_map"][name]
    elif damage == "wrong_scale":
        tensors[name] = torch.ones(64, 2, dtype=torch.bfloat16)
    else:       # a layer past the one MTP layer the config declares
        tensors["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
        index["weight_map"]["model.layers.4.eh_proj.weight"] = shard
    save_file(tensors, os.path.join(d, shard))
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(ConfigError, match=match):
        Engine(EngineArgs(model_path=d, max_total_tokens=1024, disable_cuda_graph=True))


def test_fp8_weights_held_as_released(fp8):
    """Every Linear weight but the LM head is FP8 in graphcp's model, the bytes of the file."""
    from graphcp.checkpoint.loader import load_model
    model = load_model(fp8[0], torch.float32, torch.device("cpu"))
    stored = {}
    for f in os.listdir(fp8[0]):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(fp8[0], f)))
    attn = model.model.layers["0"].self_attn
    assert attn.o_proj.weight.dtype == FP8 and attn.o_proj.weight_scale_inv.shape == (64, 1)
    assert torch.equal(attn.o_proj.weight.view(torch.uint8),
                       stored["model.layers.0.self_attn.o_proj.weight"].view(torch.uint8))
    assert torch.equal(attn.o_proj.weight_scale_inv,
                       stored["model.layers.0.self_attn.o_proj.weight_scale"].float())
    experts = model.model.layers["2"].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj_scale_inv.shape == (8, 64, 1)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers["2"].mlp.gate.weight.dtype == torch.float32

"""Qwen3-MoE with expert parallelism under CP: equal to HF transformers on tiny random checkpoints,
for both token flows (gather / reduce-scatter and all-to-all), in graph mode, with each rank loading
only its experts; the Triton grouped expert GEMM against the per-expert torch form (interpreter)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from testkit.hf_reference import make_checkpoint, rel_err
from testkit.parity import Session, graph_and_eager, random_ids

from graphcp import ConfigError, Engine, EngineArgs, Request
from graphcp.checkpoint.config import read_model_config
from graphcp.checkpoint.loader import load_model
from graphcp.distributed.shards import EPInfo
from graphcp.kernels.moe_torch import dense_experts_torch

VOCAB = 211
FIRST = [("a", random_ids(37, VOCAB, 1)), ("b", random_ids(9, VOCAB, 2)),
         ("c", random_ids(20, VOCAB, 3))]                                  # 66 tokens
SECOND = [("b", random_ids(12, VOCAB, 4)), ("d", random_ids(30, VOCAB, 5))]  # 42 tokens
CP2_EP2 = dict(tp_size=2, ep_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag",
               cuda_graph_buckets=[32, 64])
TP4_EP4_CP2 = dict(tp_size=4, ep_size=4, attn_cp_size=2, enable_prefill_cp=True,
                   cp_strategy="zigzag", moe_a2a_backend="all_to_all", cuda_graph_buckets=[64])


@pytest.fixture(scope="module")
def moe6(ckpt_dir):
    """6 experts (3 per EP rank at ep 2), top-2 unnormalised, a dense middle layer."""
    return make_checkpoint(str(ckpt_dir / "qwen3-moe-6"), "qwen3_moe", seed=11,
                           num_hidden_layers=3, moe_intermediate_size=48, num_experts=6,
                           num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe8(ckpt_dir):
    """8 experts, top-3 renormalised."""
    return make_checkpoint(str(ckpt_dir / "qwen3-moe-8"), "qwen3_moe", seed=12,
                           num_hidden_layers=2, moe_intermediate_size=40, num_experts=8,
                           num_experts_per_tok=3, norm_topk_prob=True)


def _pairs_sent(engine) -> list[int]:
    return [t["pairs_sent"] for t in engine.stats()["moe_traffic_per_rank"]]


def test_moe_layers_as_hf_decides(tmp_path):
    """mlp_only_layers and decoder_sparse_step pick the same MoE layers as transformers builds."""
    import transformers
    for i, extra in enumerate([dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2),
                               dict(decoder_sparse_step=2, mlp_only_layers=[3])]):
        cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                          num_hidden_layers=4, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=8, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=8, **extra)
        with torch.device("meta"):
            hf = transformers.Qwen3MoeForCausalLM(cfg)
        want = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
        cfg.save_pretrained(tmp_path / str(i))
        assert read_model_config(str(tmp_path / str(i))).moe_layers == want, extra


@pytest.mark.parametrize("name", ["moe6", "moe8"])
def test_single_rank_matches_hf(request, engines, oracle, name):
    path = request.getfixturevalue(name)
    engine = engines.get(path, cuda_graph_buckets=[32, 64, 128])
    s = Session(engine, oracle, path)
    out = s.run([("a", random_ids(37, VOCAB, 1)), ("b", random_ids(9, VOCAB, 2))])
    assert out.mode == "graph", out.eager_reason
    s.run([("a", random_ids(12, VOCAB, 4))])                                    # chunked prefill
    s.run([("e", random_ids(21, VOCAB, 6))], force_eager=True)
    s.release_all()


@pytest.mark.parametrize("backend", ["none", "all_to_all"])
def test_cp2_ep2_matches_hf_in_graphs(moe6, engines, oracle, backend):
    engine = engines.get(moe6, moe_a2a_backend=backend, **CP2_EP2)
    s = Session(engine, oracle, moe6)
    sent = _pairs_sent(engine)
    out = s.run(FIRST)
    assert out.mode == "graph" and out.cp_applied, out.eager_reason
    now = _pairs_sent(engine)
    if backend == "all_to_all":
        # Only real rows are dispatched (the bucket holds 64 rows per rank, 33 of them real): each
        # real token's top-2 pairs in each of the two MoE layers, from the rank holding the token.
        assert sum(now) - sum(sent) == 66 * 2 * 2, (sent, now)
        assert all(n > s for n, s in zip(now, sent)), (sent, now)
    else:
        assert now == sent == [0, 0]
    out = s.run(SECOND)                                                 # chunked + new
    assert out.mode == "graph"
    before = engine.stats()["moe_traffic_per_rank"]
    eager = s.run([("d", random_ids(16, VOCAB, 7)), ("f", random_ids(25, VOCAB, 8))],
                  force_eager=True)
    assert eager.mode == "eager"
    # Traffic measured in the communicator: each rank's two MoE layer calls, the bytes it handed to
    # the flow's collectives, and the expert load of the real tokens (41 x top-2 x 2 layers).
    after = engine.stats()["moe_traffic_per_rank"]
    keys = ("all_to_all_dispatch", "all_to_all_combine") if backend == "all_to_all" \
        else ("all_gather", "reduce_scatter")
    for b, a in zip(before, after):
        assert a["layer_calls"] - b["layer_calls"] == 2
        assert sorted(a["bytes"]) == sorted(keys)
        assert all(a["bytes"][k] > b["bytes"].get(k, 0) for k in keys)
    load = [sum(a["pairs_per_ep_rank"][i] - b["pairs_per_ep_rank"][i]
                for b, a in zip(before, after)) for i in range(2)]
    assert sum(load) == 41 * 2 * 2 and min(load) > 0, load
    s.release_all()
    # Each rank holds 3 of the 6 experts (the dense layer's FFN is split over the TP world too).
    one = engines.get(moe6, cuda_graph_buckets=[32, 64, 128]).stats()["weight_bytes"]
    assert max(engine.stats()["weight_bytes_per_rank"]) < 0.75 * one


def test_cp2_ep2_graph_equals_eager(moe6, engines):
    engine = engines.get(moe6, moe_a2a_backend="all_to_all", **CP2_EP2)
    batch = [Request("g", random_ids(29, VOCAB, 9)), Request("h", random_ids(14, VOCAB, 10))]
    graph, eager = [], []
    for force_eager, outs in ((False, graph), (True, eager)):
        outs.append(engine.prefill(batch, force_eager=force_eager))
        for r in batch:
            engine.release(r.rid)
    assert graph[0].mode == "graph" and eager[0].mode == "eager"
    assert rel_err(graph[0].logits, eager[0].logits) <= 1e-6


def test_expert_tp2_matches_hf(moe8, engines, oracle):
    """--ep 1 at tp 2: every expert split over both ranks; each pair goes to both halves."""
    engine = engines.get(moe8, tp_size=2, attn_cp_size=2, enable_prefill_cp=True,
                         cp_strategy="zigzag", moe_a2a_backend="all_to_all",
                         cuda_graph_buckets=[64])
    s = Session(engine, oracle, moe8)
    sent = sum(_pairs_sent(engine))
    assert s.run(FIRST).mode == "graph"
    assert sum(_pairs_sent(engine)) - sent == 66 * 3 * 2 * 2
    s.release_all()


def test_tp4_ep4_attention_tp2_matches_hf(moe8, engines, oracle):
    """The seed's layout, attention TP 2 inside CP 2, in graphs from its first batch (buckets per
    CP rank; the attention-TP collectives are breaks on gloo); the all-to-all dispatches each
    attention-TP group's rows once. Graph equals eager."""
    engine = engines.get(moe8, **TP4_EP4_CP2)
    s = Session(engine, oracle, moe8)
    sent = sum(_pairs_sent(engine))
    out = s.run(FIRST)  # zigzag padding rows on every rank
    assert out.mode == "graph" and out.graph_bucket == 64 and out.cp_applied, out.eager_reason
    s.run(SECOND)       # a chunked second prefill of "b", and a new rid (eager: 24 rows pad 64)
    assert sum(_pairs_sent(engine)) - sent == (66 + 42) * 3 * 2
    s.release_all()
    batch = [Request("g", random_ids(40, VOCAB, 9)), Request("h", random_ids(30, VOCAB, 10))]
    graph, eager = graph_and_eager(engine, batch)
    assert graph.mode == "graph" and eager.mode == "eager"
    assert rel_err(graph.logits, eager.logits) <= 1e-6


def test_each_rank_loads_only_its_experts(moe6):
    """EP rank 1 of 2 holds experts 3..5; expert-TP rank 1 of 2 holds the upper half of each
    expert's intermediate rows (gate and up) and columns (down)."""
    with safe_open(os.path.join(moe6, "model.safetensors"), framework="pt") as f:
        def tensor(e: int, proj: str) -> torch.Tensor:
            return f.get_tensor(f"model.layers.2.mlp.experts.{e}.{proj}.weight")
        model = load_model(moe6, torch.float32, torch.device("cpu"), ep=EPInfo(2, 1, 1, 0))
        experts = model.model.layers["2"].mlp.experts
        assert experts.gate_up_proj.shape == (3, 96, 64)
        assert torch.equal(experts.gate_up_proj[0, :48], tensor(3, "gate_proj"))
        assert torch.equal(experts.gate_up_proj[2, 48:], tensor(5, "up_proj"))
        assert torch.equal(experts.down_proj[1], tensor(4, "down_proj"))
        model = load_model(moe6, torch.float32, torch.device("cpu"), ep=EPInfo(1, 0, 2, 1))
        experts = model.model.layers["2"].mlp.experts
        assert experts.gate_up_proj.shape == (6, 48, 64)
        assert torch.equal(experts.gate_up_proj[5, :24], tensor(5, "gate_proj")[24:])
        assert torch.equal(experts.gate_up_proj[5, 24:], tensor(5, "up_proj")[24:])
        assert torch.equal(experts.down_proj[5], tensor(5, "down_proj")[:, 24:])


@pytest.mark.parametrize("block_m", [None, 32, 64])          # None: moe_row_tile's choice (16)
def test_triton_grouped_experts_match_torch_form(block_m):
    from graphcp.kernels.triton_moe import triton_experts
    g = torch.Generator().manual_seed(0)
    rows, hidden, inter, k = 21, 32, 24, 3
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(rows)])
    ids[ids == 4] = 5                     # expert 4 gets no rows, 5 gets many (a tile-boundary mix)
    weights = torch.rand(rows, k, generator=g)
    gate_up = torch.randn(3, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(3, hidden, inter, generator=g) * 0.1
    for first in (0, 3):        # this rank holds experts 0..2, then 3..5: other pairs add nothing
        got = triton_experts(x, ids, weights, gate_up, down, first, block_m=block_m)
        want = dense_experts_torch(x, ids, weights, gate_up, down, first)
        assert want.abs().max() > 0 and rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("kwargs,flag", [
    (dict(tp_size=4, ep_size=3), "--ep"),
    (dict(moe_a2a_backend="deepep"), "--moe-a2a-backend 'deepep' is not one of: none, all_to_all"),
])
def test_bad_moe_flags(moe6, kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(model_path=moe6, **kwargs)


def test_experts_not_divisible_by_ep(moe6, tmp_path):
    """5 experts cannot split over 2 EP ranks: named before any weight is read."""
    with open(os.path.join(moe6, "config.json")) as f:
        config = json.load(f)
    config["num_local_experts"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    os.symlink(os.path.join(moe6, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="--ep 2 must divide the model's num_experts=5"):
        Engine(EngineArgs(model_path=str(tmp_path), tp_size=2, ep_size=2, max_total_tokens=1024))


def test_fused_expert_checkpoint_loads_the_same(moe6, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj / experts.down_proj) loads too."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(moe6, "model.safetensors"))
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        w = [[tensors.pop(f"{p}.{e}.{n}_proj.weight") for e in range(6)]
             for n in ("gate", "up", "down")]
        tensors[f"{p}.gate_up_proj"] = torch.cat([torch.stack(w[0]), torch.stack(w[1])], dim=1)
        tensors[f"{p}.down_proj"] = torch.stack(w[2])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(moe6, "config.json")).read())
    for ep in (EPInfo(2, 1, 1, 0), EPInfo(1, 0, 2, 1)):
        fused = load_model(str(tmp_path), torch.float32, torch.device("cpu"), ep=ep).state_dict()
        split = load_model(moe6, torch.float32, torch.device("cpu"), ep=ep).state_dict()
        assert fused.keys() == split.keys()
        assert all(torch.equal(fused[n], split[n]) for n in split)

"""DSA models (DeepSeek V3.2, GLM-5) equal HF transformers on tiny random checkpoints: last-token
logits and all three caches (MLA latent, RoPE part, indexer keys), with ``index_topk`` well below
the prompt lengths so the top-k selection decides the result; one rank, interleave CP 2 (with EP 2)
and CP 4, in chunked prefill. 16 indexer heads keep exact score ties (ReLU zeros on every head) out
of the tests."""
from __future__ import annotations

import pytest
import torch
from testkit.dsa_checkpoint import INTERLEAVE, TOPK, VOCAB, DSAOracle, make_dsa_checkpoint
from testkit.hf_reference import rel_err
from testkit.parity import TOL, random_ids

from graphcp import ConfigError, Engine, EngineArgs, Request
from graphcp.models.deepseek.config import check_dsa_flags

FIRST = [("a", random_ids(30, VOCAB, 1)), ("b", random_ids(19, VOCAB, 2))]
SECOND = [("a", random_ids(13, VOCAB, 3)), ("c", random_ids(25, VOCAB, 4))]     # a: cached prefix


@pytest.fixture(scope="module")
def v32(ckpt_dir):
    """Grouped routing (4 groups, 2 kept), one dense first layer, half-split indexer RoPE."""
    return make_dsa_checkpoint(str(ckpt_dir / "dsv32"), "DeepseekV32", seed=21, n_group=4,
                               topk_group=2, first_k_dense_replace=1)


@pytest.fixture(scope="module")
def glm5(ckpt_dir):
    """A "shared" middle layer reusing layer 0's top-k, mlp_layer_types, interleaved indexer
    RoPE."""
    return make_dsa_checkpoint(str(ckpt_dir / "glm5"), "GlmMoeDsa", seed=22, n_group=1,
                               topk_group=1,
                               mlp_layer_types=["dense", "sparse", "sparse"],
                               indexer_types=["full", "shared", "full"])


@pytest.fixture(scope="module")
def dsa_oracle():
    return DSAOracle()


def _check(engine, oracle, path: str, batches) -> list:
    """Run ``batches`` (chunked: rids extend their history) and compare each request with HF on its
    whole history; returns the outputs. Releases every rid at the end."""
    history, worst, outs = {}, 0.0, []
    for batch in batches:
        out = engine.prefill([Request(rid, ids) for rid, ids in batch])
        outs.append(out)
        assert out.mode == "eager" and out.eager_reason.startswith("DSA models run eagerly")
        for i, (rid, ids) in enumerate(batch):
            history[rid] = history.get(rid, []) + ids
            assert len(history[rid]) > TOPK                      # the top-k selection matters
            logits, ref = oracle(path, history[rid])
            errs = [rel_err(out.logits[i], logits)]
            ours = engine.kv_cache(rid)
            assert len(ours) == len(ref)
            for layer, (mine, theirs) in enumerate(zip(ours, ref)):
                shared = mine[2] is None
                assert shared == (theirs[2] is None), f"{rid} layer {layer}: indexer cache"
                for a, b in zip(mine, theirs):
                    if b is not None:
                        assert a.shape == b.shape, f"{rid} layer {layer}: {a.shape} vs {b.shape}"
                        errs.append(rel_err(a, b))
            assert max(errs) <= TOL, f"{rid}: rel err {max(errs):.2e}"
            worst = max(worst, *errs)
    for rid in history:
        engine.release(rid)
    print(f"worst rel err {worst:.2e}")
    return outs


@pytest.mark.parametrize("name", ["v32", "glm5"])
def test_single_rank_matches_hf(request, engines, dsa_oracle, name):
    path = request.getfixturevalue(name)
    engine = engines.get(path)
    _check(engine, dsa_oracle, path, [FIRST, SECOND])
    stats = engine.stats()
    assert stats["kv_tokens_free"] == stats["kv_tokens_total"]          # every page released


def test_sparsity_changes_the_answer(v32, dsa_oracle, tmp_path):
    """The same weights with index_topk above the prompt length (dense attention) give other logits,
    so the parity tests above do check the selection."""
    import json
    import shutil
    dense = tmp_path / "dense"
    shutil.copytree(v32, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 256
    (dense / "config.json").write_text(json.dumps(cfg))
    ids = FIRST[0][1]
    assert rel_err(dsa_oracle(str(dense), ids)[0], dsa_oracle(v32, ids)[0]) > 1e-3


@pytest.mark.parametrize("name,extra", [("v32", dict(ep_size=2)), ("glm5", {})])
def test_cp2_interleave_matches_hf(request, engines, dsa_oracle, name, extra):
    """Each rank scores and attends its own queries; one all-gather of MLA rows and one of indexer
    keys per indexed layer (shared layers gather only the MLA rows)."""
    path = request.getfixturevalue(name)
    engine = engines.get(path, tp_size=2, attn_cp_size=2, **INTERLEAVE, **extra)
    before = engine.collective_counts()["all_gathers"]
    outs = _check(engine, dsa_oracle, path, [FIRST, SECOND])
    indexed = 3 if name == "v32" else 2
    assert engine.collective_counts()["all_gathers"] - before == 2 * (3 + indexed)
    assert [o.per_rank_tokens for o in outs] == [[25, 24], [19, 19]] and outs[0].cp_applied


def test_cp4_interleave_matches_hf(engines, dsa_oracle, glm5):
    engine = engines.get(glm5, tp_size=4, attn_cp_size=4, **INTERLEAVE)
    outs = _check(engine, dsa_oracle, glm5, [FIRST, SECOND])
    assert outs[0].cp_applied
    assert [o.per_rank_tokens for o in outs] == [[13, 12, 12, 12], [10, 10, 9, 9]]


def test_dsa_flags(v32):
    """DSA needs interleave, DP 1, and under CP attention TP 1; the error names the flag."""
    with pytest.raises(ConfigError, match="--cp-strategy"):
        Engine(EngineArgs(model_path=v32, tp_size=2, attn_cp_size=2, enable_prefill_cp=True,
                          cp_strategy="zigzag", max_total_tokens=1024))
    with pytest.raises(ConfigError, match="--dp"):
        check_dsa_flags(EngineArgs(model_path=v32, tp_size=2, dp_size=2))
    with pytest.raises(ConfigError, match="under CP need attention TP 1"):
        check_dsa_flags(EngineArgs(model_path=v32, tp_size=4, attn_cp_size=2, **INTERLEAVE))
    check_dsa_flags(EngineArgs(model_path=v32, tp_size=2, attn_cp_size=2, **INTERLEAVE))
    check_dsa_flags(EngineArgs(model_path=v32, tp_size=2))          # heads over attention TP


def test_attention_tp2_matches_hf(engines, dsa_oracle, glm5):
    """--tp 2 without CP: MLA heads split over the ranks; the indexer (with GLM-5's shared layer)
    and the cached rows are the same on both, so kv_cache is rank 0's."""
    engine = engines.get(glm5, tp_size=2)
    _check(engine, dsa_oracle, glm5, [FIRST, SECOND])
    one = engines.get(glm5).stats()["weight_bytes"]
    assert max(engine.stats()["weight_bytes_per_rank"]) < 0.7 * one


@pytest.mark.parametrize("dtype,wide", [(torch.float32, False), (torch.bfloat16, False),
                                        (torch.bfloat16, True)])
def test_triton_kernels_match_torch(monkeypatch, dtype, wide):
    """Indexer scores and sparse MLA in Triton's interpreter against the torch reference: rows with
    few visible keys, one without any (padding), slots scattered over the pool. ``wide``: the int64
    addressing of pools of 2**31 elements or more (forced)."""
    from graphcp.kernels import dsa_torch, triton_dsa
    if wide:
        monkeypatch.setattr(triton_dsa, "needs_int64", lambda *tensors: True)
    gen = torch.Generator().manual_seed(0)
    rows, heads, dim, keys, pool = 5, 16, 32, 40, 64
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(rows, heads, generator=gen)
    index_keys = torch.randn(pool, dim, generator=gen).to(dtype)
    slots = torch.randperm(pool, generator=gen)[:2 * keys // 2].view(2, keys // 2)   # 2 sequences
    row_seq, limits = torch.tensor([0, 1, 0, 1, 1]), torch.tensor([20, 3, 17, 0, 12])
    want = dsa_torch.indexer_scores(q, weights, index_keys, slots, row_seq, limits)
    got = triton_dsa.indexer_scores(q, weights, index_keys, slots, row_seq, limits)
    visible = torch.isfinite(want)
    assert torch.equal(visible, torch.isfinite(got))
    assert rel_err(got[visible], want[visible]) <= (1e-5 if dtype == torch.float32 else 1e-2)
    selected, shown = dsa_torch.select_topk(want, slots, row_seq, limits, TOPK)
    assert torch.equal(selected[1, :3].sort().values, slots[1, :3].sort().values)   # all it sees
    assert shown.sum(1).tolist() == [TOPK, 3, TOPK, 0, TOPK]
    q_mla = torch.randn(rows, 20, 48, generator=gen).to(dtype)    # 20 heads: a 32-head block
    kv = torch.randn(pool, 48, generator=gen).to(dtype)
    want = dsa_torch.sparse_mla(q_mla, kv, selected, shown, 0.2, 32).float()
    got = triton_dsa.sparse_mla(q_mla, kv, selected, shown, 0.2, 32).float()
    assert got[3].abs().max() == 0 and want[3].abs().max() == 0          # no visible key: zeros
    assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 2e-2)
    from graphcp.kernels.resolve import _dsa_errors  # the start-up check CUDA runs, here interpreted
    assert _dsa_errors(triton_dsa, torch.device("cpu"), dtype) is None


def test_triton_engine_matches_hf(engines, dsa_oracle, glm5):
    """--attention-kernel triton serves DSA with the Triton kernels (the interpreter on CPU)."""
    from graphcp.kernels import triton_dsa
    from graphcp.kernels.resolve import resolve_dsa
    assert resolve_dsa("triton", torch.device("cpu")) is triton_dsa
    engine = engines.get(glm5, attention_kernel="triton")
    _check(engine, dsa_oracle, glm5, [FIRST[:1]])


def test_mtp_layer_is_skipped(v32, tmp_path):
    """Released DSA checkpoints hold a multi-token-prediction layer past the last layer; it loads
    like HF (skipped), while other unknown tensors are still refused."""
    import shutil

    from safetensors.torch import save_file

    from graphcp.checkpoint.loader import load_model
    path = tmp_path / "with-mtp"
    shutil.copytree(v32, path)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(4, 4)}, str(path / "mtp.safetensors"))
    model = load_model(str(path), torch.float32, torch.device("cpu"))
    assert len(model.model.layers) == 3
    save_file({"model.layers.2.extra.weight": torch.zeros(4, 4)}, str(path / "bad.safetensors"))
    with pytest.raises(ConfigError, match="model.layers.2.extra.weight"):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_bench_dsa_balance_counts_each_ranks_work():
    """C=2, extend [5, 3]: rank 0 holds flat tokens 0, 2, 4 (request 0, 1/3/5 keys) and 6
    (request 1, 2 keys); rank 1 holds 1, 3 (2/4 keys), 5 and 7 (1/3 keys). With top-2: 1+2+2+2 and
    2+2+1+2."""
    from graphcp.tools.dsa_balance import dsa_balance
    got = dsa_balance(2, [5, 3], 2)
    assert got["indexer_keys_per_rank"] == [11, 10] and got["sparse_keys_per_rank"] == [7, 7]
    assert got["indexer_max_over_mean"] == pytest.approx(22 / 21)
    assert got["sparse_max_over_mean"] == 1


def test_yarn_rope_matches_hf(engines, dsa_oracle, ckpt_dir):
    """V3.2's YaRN RoPE (factor, beta ramp, mscale on cos/sin and on the softmax scale)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64}
    path = make_dsa_checkpoint(str(ckpt_dir / "dsv32-yarn"), "DeepseekV32", seed=23, n_group=2,
                               topk_group=1, first_k_dense_replace=2, rope_parameters=rope)
    _check(engines.get(path), dsa_oracle, path, [FIRST[:1]])


def test_router_and_indexer_weights_stay_fp32(v32):
    """In a bf16 model the router and the indexer's head weights keep fp32 (as HF keeps them)."""
    from graphcp.checkpoint.loader import load_model
    model = load_model(v32, torch.bfloat16, torch.device("cpu"))
    layer = model.model.layers["1"]
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert layer.self_attn.q_a_proj.weight.dtype == torch.bfloat16


def _fp8_dsa_checkpoint(src: str, dst: str, dequantized: str) -> None:
    """DeepSeek's FP8 layout: every projection weight (experts, kv_a_proj_with_mqa and the indexer's
    wq_b / wk included) float8 with 16x16-block scales; norms, router, weights_proj, embeddings
    and the LM head unquantized. The dequantized twin is HF's oracle."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    from testkit.fp8_checkpoint import dequantize_blocks, quantize_blocks
    block = (16, 16)
    weights = load_file(os.path.join(src, "model.safetensors"))
    fp8, plain = {}, {}
    for name, w in weights.items():
        keep = ("norm", "mlp.gate.", "weights_proj", "embed_tokens", "lm_head")
        if w.ndim == 2 and not any(k in name for k in keep):
            q, s = quantize_blocks(w, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            plain[name] = dequantize_blocks(q, s, block)
        else:
            fp8[name] = plain[name] = w
    for path, tensors in ((dst, fp8), (dequantized, plain)):
        shutil.copytree(src, path)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = json.loads(open(os.path.join(dst, "config.json")).read())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(v32, engines, dsa_oracle, tmp_path):
    """An FP8 V3.2 checkpoint (experts included) loads dequantized, equal to HF on the twin."""
    fp8, plain = str(tmp_path / "fp8"), str(tmp_path / "plain")
    _fp8_dsa_checkpoint(v32, fp8, plain)
    engine = engines.get(fp8)
    out = engine.prefill([Request("a", FIRST[0][1])])
    logits, ref = dsa_oracle(plain, FIRST[0][1])
    assert rel_err(out.logits[0], logits) <= TOL
    for ours, theirs in zip(engine.kv_cache("a"), ref, strict=True):
        assert all(rel_err(a, b) <= TOL for a, b in zip(ours, theirs, strict=True))
    engine.release("a")
    assert rel_err(dsa_oracle(v32, FIRST[0][1])[0], logits) > 1e-4     # quantization did change it


def test_row_chunks_match_hf(engines, dsa_oracle, v32, monkeypatch):
    """Long prompts score and attend their query rows in chunks; tiny chunks give the same
    result."""
    from graphcp.kernels import dsa_torch
    monkeypatch.setattr(dsa_torch, "CHUNK_ELEMENTS", 4096)     # a few rows per chunk at these sizes
    _check(engines.get(v32), dsa_oracle, v32, [FIRST[:1]])


@pytest.mark.parametrize("spelling", [
    dict(index_topk_freq=4, index_skip_topk_offset=3), dict(index_topk_freq=2),
    dict(index_skip_topk_offset=0, index_topk_freq=1),
    dict(index_topk_freq=3, index_skip_topk_offset=1),
    dict(index_topk_pattern="FFSSFS" * 13), dict(index_topk_pattern=["full", "shared"] * 39), {}])
def test_index_share_schedule_is_hfs(spelling):
    """GLM-5.2's IndexShare schedule from every spelling, as GlmMoeDsaConfig derives indexer_types
    (78 layers; GLM-5.2 declares freq 4, offset 3)."""
    import transformers

    from graphcp.models.deepseek.config import _shared_indexer
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=78, **spelling).indexer_types
    ours = _shared_indexer(dict(spelling), "GlmMoeDsaForCausalLM", 78)
    assert ours == tuple(t == "shared" for t in hf)


@pytest.mark.parametrize("spelling,field", [
    (dict(index_topk_freq=2, index_skip_topk_offset=0), "index_topk_freq / index_skip_topk_offset"),
    (dict(index_topk_pattern="FSX"), "index_topk_pattern"),
    (dict(index_topk_freq=None), "integers")])
def test_index_share_schedule_refuses_a_shared_first_layer(spelling, field):
    from graphcp.models.deepseek.config import _shared_indexer
    with pytest.raises(ConfigError, match=field):
        _shared_indexer(spelling, "GlmMoeDsaForCausalLM", 3)


def test_index_share_by_schedule_matches_hf(engines, dsa_oracle, ckpt_dir):
    """A GLM-5 config.json with ``index_topk_freq: 2, index_skip_topk_offset: 2`` and no
    ``indexer_types``: layers full, full, shared, full, derived here as HF derives them."""
    import json
    import os
    path = make_dsa_checkpoint(str(ckpt_dir / "glm5-schedule"), "GlmMoeDsa", seed=24, n_group=1,
                               topk_group=1, num_hidden_layers=4, index_topk_freq=2,
                               index_skip_topk_offset=2)
    cfg_path = os.path.join(path, "config.json")
    raw = json.load(open(cfg_path))
    assert raw.pop("indexer_types") == ["full", "full", "shared", "full"]
    assert raw["index_topk_freq"] == 2 and raw["index_skip_topk_offset"] == 2
    json.dump(raw, open(cfg_path, "w"))
    _check(engines.get(path), dsa_oracle, path, [FIRST[:1], SECOND[:1]])


def test_index_cache_override_skips_the_shared_layers_indexers(engines, dsa_oracle, ckpt_dir,
                                                               caplog):
    """vLLM's IndexCache override for GLM-5: a checkpoint with an indexer on every layer, served
    with ``index_topk_freq`` set in config.json. Layer 2 becomes shared: its indexer's tensors are
    read past and named in the log, the answer is HF's on the same folder, and a tensor no indexer
    has is still refused."""
    import json
    import logging
    import os

    from safetensors.torch import save_file

    from graphcp.checkpoint.loader import load_model
    path = make_dsa_checkpoint(str(ckpt_dir / "glm5-index-cache"), "GlmMoeDsa", seed=25,
                               n_group=1, topk_group=1, num_hidden_layers=4,
                               indexer_types=["full"] * 4)
    cfg_path = os.path.join(path, "config.json")
    raw = json.load(open(cfg_path))
    raw.pop("indexer_types")
    raw.update(index_topk_freq=2, index_skip_topk_offset=2)
    json.dump(raw, open(cfg_path, "w"))
    with caplog.at_level(logging.INFO, logger="graphcp"):
        engine = engines.get(path)
    assert "model.layers.2.self_attn.indexer.* (5)" in caplog.text
    assert "model.layers.1.self_attn.indexer" not in caplog.text
    _check(engine, dsa_oracle, path, [FIRST[:1], SECOND[:1]])
    save_file({"model.layers.2.self_attn.indexer.extra.weight": torch.zeros(4, 4)},
              os.path.join(path, "bad.safetensors"))
    try:
        with pytest.raises(ConfigError, match="model.layers.2.self_attn.indexer.extra.weight"):
            load_model(path, torch.float32, torch.device("cpu"))
    finally:
        os.remove(os.path.join(path, "bad.safetensors"))


def test_row_chunks_follow_the_kernel():
    """The torch forms gather [rows, keys, width]; the Triton kernels hold [rows, keys] at most, so
    at 32K keys they take 512 rows a call where the torch form takes 4 (128x fewer launches)."""
    from graphcp.kernels import dsa_torch, triton_dsa
    keys, index_dim, width, topk = 32768, 128, 576, 2048
    assert dsa_torch.row_chunk(keys, index_dim) == 4
    assert triton_dsa.row_chunk(keys, index_dim) == 512
    assert triton_dsa.row_chunk(topk, width) * topk <= dsa_torch.CHUNK_ELEMENTS
    assert dsa_torch.row_chunk(topk, width) * topk * width <= dsa_torch.CHUNK_ELEMENTS

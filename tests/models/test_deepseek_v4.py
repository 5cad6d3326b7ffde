"""DeepSeek V4 served by the engine equals HF transformers on tiny random checkpoints (one rank):
last-token logits and every cache part ``engine.kv_cache`` returns (the K = V rows, the compressed
entries, the indexer keys, each compressor's kv | gate rows, which hold the open window and the
overlap) after batched, chunked prefill with chunk boundaries inside windows; random chunkings
equal one pass; release frees every part; legacy configs, FP8 and bf16; the config fields and flags
V4 refuses name themselves. Interleave CP, EP and PD: tests/models/test_deepseek_v4_cp.py."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from testkit.deepseek_v4_reference import (
    BATCHES,
    CSA,
    HCA,
    A,
    B,
    V4Oracle,
    make_legacy_checkpoint,
    release_all,
    run_batches,
    v4_checkpoint,
)
from testkit.fp8_checkpoint import make_fp8_checkpoint
from testkit.hf_reference import rel_err
from testkit.parity import TOL

from graphcp import ConfigError, Engine, EngineArgs, Request, RequestError
from graphcp.checkpoint.config import read_model_config
from graphcp.models.deepseek_v4.names import v4_model_name


@pytest.fixture(scope="module")
def v4(ckpt_dir):
    return v4_checkpoint(ckpt_dir)


@pytest.fixture(scope="module")
def v4_legacy(ckpt_dir):
    return make_legacy_checkpoint(str(ckpt_dir / "deepseek_v4_legacy"))


@pytest.fixture(scope="module")
def v4_oracle():
    return V4Oracle()


def test_chunked_batches_match_hf(engines, v4, v4_oracle):
    assert os.path.isfile(os.path.join(v4, "model.safetensors.index.json"))     # sharded
    engine = engines.get(v4)
    worst, outs = run_batches(engine, v4_oracle, v4, BATCHES)
    print(f"worst rel err vs HF (logits and caches) {worst:.2e}")
    assert rel_err(outs[2].logits[0], outs[1].logits[2]) <= TOL     # chunked "a" equals "one"
    # the documented kv_cache format for a 200-token request: CSA (rate 4), sliding, HCA (rate 16)
    shapes = [[(200, 32), (50, 32), (50, 16), (200, 128), (200, 64)], [(200, 32)] + [None] * 4,
              [(200, 32), (12, 32), None, (200, 64), None]]
    got = [[None if t is None else tuple(t.shape) for t in layer] for layer in engine.kv_cache("a")]
    assert got == shapes
    release_all(engine, ["a", "b", "c", "one"])
    with pytest.raises(RequestError, match="'a'"):
        engine.kv_cache("a")


def test_random_chunkings_equal_one_pass(engines, v4):
    """200 tokens cut at random points (chunks of 1 token, chunks inside one window, chunks
    spanning many) leave the same caches and last logits as one pass."""
    engine = engines.get(v4)
    ref = engine.prefill([Request("whole", A)]).logits[0]
    whole = engine.kv_cache("whole")
    gen = torch.Generator().manual_seed(5)
    for trial in range(3):
        count = int(torch.randint(1, 6, (1,), generator=gen))
        cuts = sorted(set(torch.randint(1, 200, (count,), generator=gen).tolist() + [199 - trial]))
        rid = f"cut{trial}"
        for lo, hi in zip([0] + cuts, cuts + [200]):
            logits = engine.prefill([Request(rid, A[lo:hi])]).logits[0]
        errs = [rel_err(logits, ref)]
        for ours, theirs in zip(engine.kv_cache(rid), whole):
            errs += [rel_err(a, b) for a, b in zip(ours, theirs) if b is not None]
        assert max(errs) <= TOL, f"cuts {cuts}: {max(errs):.2e}"
        engine.release(rid)
    release_all(engine, ["whole"])


def test_triton_indexer_matches_hf(engines, v4, v4_oracle, monkeypatch):
    """``--attention-kernel triton``: the CSA indexer scores through the Triton DSA kernel (its
    interpreter on CPU; the one-rank engine runs in this process) over the entry slots, across a
    second chunk."""
    from graphcp.kernels import triton_dsa
    calls, kernel = [], triton_dsa.indexer_scores
    monkeypatch.setattr(triton_dsa, "indexer_scores", lambda *a: calls.append(1) or kernel(*a))
    engine = engines.get(v4, attention_kernel="triton")
    worst, _ = run_batches(engine, v4_oracle, v4, [[("a", A[:90]), ("b", B)], [("a", A[90:])]])
    assert len(calls) >= 2                      # the CSA layer of each forward
    print(f"triton indexer: worst rel err {worst:.2e}")
    release_all(engine, ["a", "b"])


def test_legacy_config_and_module_names_match_hf(engines, v4_legacy, v4_oracle):
    """Legacy config keys, sigmoid scoring, tied embeddings, fused experts, an MTP tensor."""
    engine = engines.get(v4_legacy)
    worst, _ = run_batches(engine, v4_oracle, v4_legacy, [[("a", A), ("b", B)]])
    print(f"legacy: worst rel err {worst:.2e}")
    release_all(engine, ["a", "b"])


def test_fp8_checkpoint_matches_its_dequantized_twin(engines, v4_legacy, v4_oracle, tmp_path):
    """Every projection block-quantized (the compressors' and indexer-weight projections stay
    unquantized, as transformers keeps them) and read through graphcp's FP8 path, against HF on
    the exactly dequantized checkpoint."""
    kinds = read_model_config(v4_legacy).family_config.layer_types
    keep = ["lm_head"] + [f"model.layers.{i}.self_attn.compressor.{part}"
                          for i, kind in enumerate(kinds) if kind != "sliding_attention"
                          for part in ("kv_proj", "gate_proj", "indexer.kv_proj",
                                       "indexer.gate_proj", "indexer.scorer.weights_proj")]
    fp8, twin = make_fp8_checkpoint(v4_legacy, str(tmp_path / "fp8"), str(tmp_path / "twin"),
                                    (16, 16), tuple(keep))
    assert read_model_config(fp8).fp8_block == (16, 16)
    with Engine(EngineArgs(model_path=fp8, max_total_tokens=1024)) as engine:
        logits = engine.prefill([Request("a", A)]).logits[0]
    err = rel_err(logits, v4_oracle(twin, A)[0])
    print(f"fp8 rel err {err:.2e}")
    assert err <= TOL


def test_bf16_matches_hf_bf16(v4):
    """In bf16, the parts transformers keeps in fp32 (hyper-connections, norms, sinks, position
    biases, the correction bias) stay fp32 here too."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([A])).logits[0, -1].float()
    with Engine(EngineArgs(model_path=v4, dtype="bfloat16", max_total_tokens=1024)) as engine:
        logits = engine.prefill([Request("a", A)]).logits[0]
    err = rel_err(logits, ref)
    print(f"bf16 rel err vs HF bf16 {err:.2e}")
    assert err <= 1e-2


def test_checkpoint_names():
    """DeepSeek's own names (no ``model.`` prefix), those transformers writes back and its module
    names all load the same parameters; MTP tensors are skipped."""
    same = {
        "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
        "layers.3.attn.wq_a.weight_scale_inv": "model.layers.3.self_attn.q_a_proj.weight_scale_inv",
        "model.layers.3.attn.norm.weight": "model.layers.3.self_attn.kv_norm.weight",
        "layers.3.attn.compressor.ape": "model.layers.3.self_attn.compressor.position_bias",
        "layers.3.attn.indexer.compressor.norm.weight":
            "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
        "layers.3.attn.indexer.weights_proj.weight":
            "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.3.hc_ffn_scale": "model.layers.3.ffn_hc.scale",
        "layers.3.ffn.gate.bias": "model.layers.3.mlp.gate.e_score_correction_bias",
        "layers.3.ffn.experts.5.w2.weight": "model.layers.3.mlp.experts.5.down_proj.weight",
        "model.layers.3.self_attn.q_b_proj.weight": "model.layers.3.self_attn.q_b_proj.weight",
    }
    for name, target in same.items():
        assert v4_model_name(name) == target, name
    assert v4_model_name("mtp.0.attn.wq_a.weight") is None


def test_selection_and_compression_change_the_answer(v4, v4_oracle, tmp_path):
    """The same weights with index_topk above the entry count (dense CSA) give other logits, and
    so does the HCA layer without its compressed branch (a sliding layer, its compressor weights
    unused): the parity above checks the top-k and the compressed entries."""
    ids = A[:150]
    base = v4_oracle(v4, ids)[0]
    kinds = [CSA, "sliding_attention", "sliding_attention"]
    for key, value in (("index_topk", 64), ("layer_types", kinds)):
        variant = tmp_path / key
        shutil.copytree(v4, variant)
        cfg = json.loads((variant / "config.json").read_text())
        cfg[key] = value
        (variant / "config.json").write_text(json.dumps(cfg))
        assert rel_err(v4_oracle(str(variant), ids)[0], base) > 1e-3, key


@pytest.mark.parametrize("key,value,flag", [
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("scoring_func", "softmax", "scoring_func"),
    ("n_shared_experts", 2, "n_shared_experts"),
    ("norm_topk_prob", False, "norm_topk_prob"),
    ("layer_types", ["sliding_attention"] * 2, "layer_types"),
    ("mlp_layer_types", ["dense"] * 3, "mlp_layer_types"),
    ("compress_rates", {CSA: 0, HCA: 16}, "compress_rates"),
    ("o_groups", 3, "o_groups"),
    ("expert_dtype", "fp4", "expert_dtype"),
    ("rope_parameters", {"main": {"rope_type": "llama3", "rope_theta": 1e4},
                         "compress": {"rope_type": "default", "rope_theta": 1e4}}, "rope_type"),
])
def test_config_errors_name_the_field(v4, tmp_path, key, value, flag):
    bad = tmp_path / "bad"
    shutil.copytree(v4, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg[key] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=flag):
        read_model_config(str(bad))


CP = dict(enable_prefill_cp=True, attn_cp_size=2, tp_size=2)


@pytest.mark.parametrize("kwargs,flag", [
    (dict(CP, cp_strategy="zigzag"), "--cp-strategy"),
    (dict(tp_size=2), "--tp"),                               # attention TP 2 over one KV head
    (dict(tp_size=2, dp_size=2), "--dp"),
    (dict(pp_size=2), "--pp"),
    (dict(speculative_aux_hidden_layers=(1,)), "--speculative-aux-hidden-layers"),
    (dict(CP, tp_size=3, attn_cp_size=3, cp_strategy="interleave", ep_size=3), "--ep"),
])
def test_flags_name_the_flag(v4, kwargs, flag):
    """Refused before any rank process starts."""
    with pytest.raises(ConfigError, match=flag):
        Engine(EngineArgs(model_path=v4, max_total_tokens=1024, **kwargs))


def test_bench_counts_each_ranks_v4_work(v4):
    """C=2, one request of 9 tokens, window 16, CSA rate 4 (top-6), HCA rate 16: rank 0 holds
    positions 0, 2, .., 8 (1, 3, 5, 7, 9 keys seen), rank 1 positions 1, .., 7 (2, 4, 6, 8). CSA
    entries closed: 0+0+1+1+2 = 4 and 0+1+1+2 = 4; HCA none; every layer attends the window."""
    from graphcp.tools.dsa_balance import v4_balance
    got = v4_balance(2, [9], read_model_config(v4).family_config)
    assert got["indexer_keys_per_rank"] == [4, 4]
    assert got["attended_keys_per_rank"] == [3 * 25 + 4, 3 * 20 + 4]
    assert got["attention_max_over_mean"] == pytest.approx(79 * 2 / 143)

"""DeepSeek V4 equals HF transformers on tiny random checkpoints: last-token logits and every cache
part (sliding-window keys, compressed entries, indexer keys, the compressors' open-window buffers
and overlap state) after batched, chunked prefill with chunk boundaries inside windows; and
interleave CP 2 and 4 (real gloo groups) equals one rank. graphcp's model runs over explicit
per-request caches here (``attention/deepseek_v4.py``); the engine refuses V4 until its paged
caches land."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from deepseek_v4_reference import (VOCAB, V4Oracle, cp_worker, make_legacy_checkpoint,
                                   make_v4_checkpoint, ours_layer, prefill)
from fp8_checkpoint import make_fp8_checkpoint
from hf_reference import rel_err
from parity import TOL, random_ids

from graphcp import ConfigError, Engine, EngineArgs
from graphcp.models import load_model, read_model_config
from graphcp.models.deepseek_v4_names import v4_model_name

A, B, C = random_ids(200, VOCAB, 41), random_ids(140, VOCAB, 42), random_ids(29, VOCAB, 43)
# a: 37 + 50 + 113 tokens (boundaries inside CSA windows of 4 and HCA windows of 16), b: 61 + 79,
# c: 29 in one; "one" holds a's 200 tokens in one forward.
BATCHES = [[("a", A[:37]), ("b", B[:61])],
           [("a", A[37:87]), ("c", C), ("one", A)],
           [("a", A[87:]), ("b", B[61:])]]
CP_BATCHES = BATCHES[:2]        # several requests, a cached prefix, a 200-token one


@pytest.fixture(scope="module")
def v4(ckpt_dir):
    return make_v4_checkpoint(str(ckpt_dir / "deepseek_v4"))


@pytest.fixture(scope="module")
def v4_legacy(ckpt_dir):
    return make_legacy_checkpoint(str(ckpt_dir / "deepseek_v4_legacy"))


@pytest.fixture(scope="module")
def v4_oracle():
    return V4Oracle()


def _cache_errors(ours: tuple, theirs: tuple, where: str) -> list[float]:
    """Relative errors of every cache tensor; shapes must agree (None where HF has none)."""
    errs = []
    for a, b in zip(_flatten(ours), _flatten(theirs)):
        assert (a is None) == (b is None), f"{where}: cache part present on one side only"
        if b is None:
            continue
        assert a.shape == b.shape, f"{where}: {tuple(a.shape)} vs {tuple(b.shape)}"
        if b.numel():
            errs.append(rel_err(a, b))
    return errs


def _flatten(layer: tuple) -> list:
    window, comp, index = layer
    return [window, *(comp or (None,) * 3), *(index or (None,) * 3)]


def _run(path: str, oracle: V4Oracle, batches: list) -> tuple[dict, list]:
    """The batches on one rank, each request checked against HF on its history -> (the last
    caches, each forward's (hidden, logits)); prints the worst error."""
    model = load_model(path, torch.float32, torch.device("cpu"))
    caches, history, worst, steps = {}, {}, 0.0, []
    for batch in batches:
        hidden, _, logits = prefill(model, caches, batch)
        steps.append((hidden, logits))
        for rid, ids in batch:
            history[rid] = history.get(rid, []) + ids
            ref_logits, ref_layers = oracle(path, history[rid])
            errs = [rel_err(logits[rid], ref_logits)]
            for layer, (state, ref) in enumerate(zip(caches[rid], ref_layers)):
                errs += _cache_errors(ours_layer(state), ref, f"{rid} layer {layer}")
            assert max(errs) <= TOL, f"{rid} after {len(history[rid])} tokens: {max(errs):.2e}"
            worst = max(worst, *errs)
    print(f"worst rel err {worst:.2e}")
    return caches, steps


def test_chunked_batches_match_hf(v4, v4_oracle):
    assert os.path.isfile(os.path.join(v4, "model.safetensors.index.json"))     # sharded
    caches, steps = _run(v4, v4_oracle, BATCHES)
    assert rel_err(steps[2][1]["a"], steps[1][1]["one"]) <= TOL      # chunked equals one pass
    kinds = read_model_config(v4).v4.layer_types
    for layer, kind in enumerate(kinds):            # what a 200-token request leaves in the caches
        state = caches["a"][layer]
        assert state.length == 200 and state.window.shape[0] == 15
        if kind != "sliding_attention":
            rate = 4 if kind.startswith("compressed") else 16
            assert state.compressor.entries.shape[0] == 200 // rate
            assert state.compressor.buffer.shape[0] == 200 % rate


def test_random_chunkings_equal_one_pass(v4):
    """200 tokens cut at random points (chunks of 1 token, chunks inside one window, chunks
    spanning many) leave the same caches and last logits as one pass."""
    model = load_model(v4, torch.float32, torch.device("cpu"))
    one = {}
    _, _, ref = prefill(model, one, [("a", A)])
    gen = torch.Generator().manual_seed(5)
    for trial in range(3):
        cuts = sorted(set(torch.randint(1, 200, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                        generator=gen).tolist() + [199 - trial]))
        caches, logits = {}, None
        for lo, hi in zip([0] + cuts, cuts + [200]):
            _, _, logits = prefill(model, caches, [("a", A[lo:hi])])
        errs = [rel_err(logits["a"], ref["a"])]
        for layer, state in enumerate(caches["a"]):
            errs += _cache_errors(ours_layer(state), ours_layer(one["a"][layer]), f"{cuts}")
        assert max(errs) <= TOL, f"cuts {cuts}: {max(errs):.2e}"


def test_legacy_config_and_module_names_match_hf(v4_legacy, v4_oracle):
    """Legacy config keys, sigmoid scoring, tied embeddings, fused experts, an MTP tensor."""
    _run(v4_legacy, v4_oracle, [[("a", A), ("b", B)]])


def test_fp8_checkpoint_matches_its_dequantized_twin(v4_legacy, v4_oracle, tmp_path):
    """Every projection block-quantized (the compressors' and indexer-weight projections stay
    unquantized, as transformers keeps them) and read through graphcp's FP8 path, against HF on
    the exactly dequantized checkpoint."""
    kinds = read_model_config(v4_legacy).v4.layer_types
    keep = ["lm_head"] + [f"model.layers.{i}.self_attn.compressor.{part}"
                          for i, kind in enumerate(kinds) if kind != "sliding_attention"
                          for part in ("kv_proj", "gate_proj", "indexer.kv_proj",
                                       "indexer.gate_proj", "indexer.scorer.weights_proj")]
    fp8, twin = make_fp8_checkpoint(v4_legacy, str(tmp_path / "fp8"), str(tmp_path / "twin"),
                                    (16, 16), tuple(keep))
    model = load_model(fp8, torch.float32, torch.device("cpu"))
    assert read_model_config(fp8).fp8_block == (16, 16)
    _, _, logits = prefill(model, {}, [("a", A)])
    err = rel_err(logits["a"], v4_oracle(twin, A)[0])
    print(f"fp8 rel err {err:.2e}")
    assert err <= TOL


def test_bf16_matches_hf_bf16(v4):
    """In bf16, the parts transformers keeps in fp32 (hyper-connections, norms, sinks, position
    biases, the correction bias) stay fp32 here too."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([A])).logits[0, -1].float()
    model = load_model(v4, torch.bfloat16, torch.device("cpu"))
    assert model.model.layers["0"].self_attn.sinks.dtype == torch.float32
    _, _, logits = prefill(model, {}, [("a", A)])
    err = rel_err(logits["a"], ref)
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
    kinds = ["compressed_sparse_attention", "sliding_attention", "sliding_attention"]
    for key, value in (("index_topk", 64), ("layer_types", kinds)):
        variant = tmp_path / key
        shutil.copytree(v4, variant)
        cfg = json.loads((variant / "config.json").read_text())
        cfg[key] = value
        (variant / "config.json").write_text(json.dumps(cfg))
        assert rel_err(v4_oracle(str(variant), ids)[0], base) > 1e-3, key


def test_interleave_cp_matches_one_rank(v4, v4_oracle, tmp_path):
    """4 gloo ranks: CP 4, then CP 2 on each pair. Each rank's hidden rows equal one rank's rows
    at its tokens (t % C == rank), every rank holds the whole cache, each layer gathers its new
    rows (K = V, compressor and indexer projections) in one all-gather, and the last-token
    logits equal HF's."""
    model = load_model(v4, torch.float32, torch.device("cpu"))
    caches, single, history, hf = {}, [], {}, []
    for batch in CP_BATCHES:
        hidden, _, logits = prefill(model, caches, batch)
        single.append((hidden, logits, {rid: [ours_layer(s) for s in layers]
                                        for rid, layers in caches.items()}))
        history.update({rid: history.get(rid, []) + ids for rid, ids in batch})
        hf.append({rid: v4_oracle(v4, history[rid])[0] for rid, _ in batch})
    mp.spawn(cp_worker, args=(4, v4, CP_BATCHES, str(tmp_path)), nprocs=4, join=True)
    # gathered row widths per layer (CSA, sliding, HCA): K = V 32, the compressor's kv | gate of
    # 2 x 64 (CSA, overlapping) or 2 x 32 (HCA), the indexer's 2 x 32
    worst, widths = 0.0, [32 + 2 * 64 + 2 * 32, 32, 32 + 2 * 32]
    for rank in range(4):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for cp_size, steps in results.items():
            for (hidden, logits, ref_caches), ref_logits, step in zip(single, hf, steps):
                mine = list(range(rank % cp_size, hidden.shape[0], cp_size))
                assert step["local"].tolist() == mine and step["gathers"] == widths
                errs = [rel_err(step["hidden"], hidden[step["local"]])]
                errs += [rel_err(step["logits"][rid], logits[rid]) for rid in step["logits"]]
                errs += [rel_err(step["logits"][rid], ref_logits[rid]) for rid in step["logits"]]
                for rid, layers in ref_caches.items():
                    for layer, ref in enumerate(layers):
                        errs += _cache_errors(step["caches"][rid][layer], ref, f"{rid} {layer}")
                assert max(errs) <= TOL, f"CP {cp_size} rank {rank}: {max(errs):.2e}"
                worst = max(worst, *errs)
    print(f"worst rel err vs one rank and HF {worst:.2e}")


@pytest.mark.parametrize("key,value,flag", [
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("scoring_func", "softmax", "scoring_func"),
    ("n_shared_experts", 2, "n_shared_experts"),
    ("norm_topk_prob", False, "norm_topk_prob"),
    ("layer_types", ["sliding_attention"] * 2, "layer_types"),
    ("mlp_layer_types", ["dense"] * 3, "mlp_layer_types"),
    ("compress_rates", {"compressed_sparse_attention": 0,
                        "heavily_compressed_attention": 16}, "compress_rates"),
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


def test_engine_refuses_until_integrated(v4):
    with pytest.raises(ConfigError, match="DeepseekV4ForCausalLM"):
        Engine(EngineArgs(model_path=v4, max_total_tokens=1024))

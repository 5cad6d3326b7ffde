"""DeepSeek V4 test parts: tiny random checkpoints written by transformers, HF's one-pass oracle
(logits and every cache part), and graphcp's ``engine.kv_cache`` entries seen in HF's cache layout,
with a comparison of the two."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from graphcp import Request
from graphcp.checkpoint.config import read_model_config
from testkit.hf_reference import CachedHF, rel_err
from testkit.parity import TOL, random_ids

VOCAB = 211
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
A, B, C = random_ids(200, VOCAB, 41), random_ids(140, VOCAB, 42), random_ids(29, VOCAB, 43)
# a: 37 + 50 + 113 tokens (boundaries inside CSA windows of 4 and HCA windows of 16), b: 61 + 79,
# c: 29 in one; "one" holds a's 200 tokens in one forward.
BATCHES = [[("a", A[:37]), ("b", B[:61])],
           [("a", A[37:87]), ("c", C), ("one", A)],
           [("a", A[87:]), ("b", B[61:])]]
# Windows and rates small enough that a 200-token request crosses 12 windows of 16, 50 CSA entries
# (index_topk 6 of them per query) and 12 HCA entries; 16 indexer heads keep exact score ties
# (ReLU zeros on every head) out of the top-k.
TINY = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, head_dim=32, q_lora_rank=48, qk_rope_head_dim=8,
            n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, o_groups=2,
            o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=6, hc_mult=4,
            swiglu_limit=0.5, max_position_embeddings=512)


def _randomize(model, seed: int) -> None:
    """Widen transformers' tiny init; non-zero sinks, biases, position biases and routing tables,
    and a SwiGLU limit that clamps, so every part changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
            elif name.endswith(("sinks", ".base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        experts = model.config.n_routed_experts
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
            elif name.endswith("tid2eid"):
                b.copy_(torch.randint(0, experts, b.shape, generator=gen))


def make_v4_checkpoint(path: str, seed: int = 31, **overrides) -> str:
    """transformers' own save_pretrained (DeepSeek's tensor names), sharded with an index; layers
    CSA, sliding, HCA; YaRN on the compressed layers' rotary; hash routing on layers 0 and 2."""
    import transformers
    kwargs = dict(TINY, layer_types=[CSA, "sliding_attention", HCA],
                  compress_rates={CSA: 4, HCA: 16}, mlp_layer_types=["hash_moe", "moe", "hash_moe"],
                  rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 128})
    kwargs.update(overrides)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**kwargs)).float()
    _randomize(model, seed)
    model.save_pretrained(path, max_shard_size="200KB")
    return path


def v4_checkpoint(ckpt_dir) -> str:
    """The suite's V4 checkpoint, written once for every test file that serves it."""
    path = str(ckpt_dir / "deepseek_v4")
    if not os.path.isdir(path):
        make_v4_checkpoint(path)
    return path


def make_legacy_checkpoint(path: str, seed: int = 32) -> str:
    """A config.json in the legacy keys (per-layer ``compress_ratios``, ``compress_rate_hca``,
    ``num_hash_layers``, flat ``rope_scaling``, ``qk_rope_head_dim``), sigmoid scoring, tied
    embeddings, and one safetensors file in transformers' module names (fused experts), with an
    MTP tensor."""
    import transformers
    raw = dict(TINY)
    raw.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
               compress_ratios=[128, 0, 4], compress_rate_hca=16, num_hash_layers=1,
               scoring_func="sigmoid", tie_word_embeddings=True,
               rope_scaling={"type": "yarn", "factor": 2.0,
                             "original_max_position_embeddings": 256})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.DeepseekV4ForCausalLM(config).float()
    _randomize(model, seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["mtp.0.ffn.gate.weight"] = torch.zeros(8, 64)     # the MTP layer both loaders skip
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


class V4Oracle(CachedHF):
    """HF in fp32, one pass over a whole history -> (last-token logits, per layer (window keys,
    compressor (entries, buffer, overlap) or None, indexer (the same) or None)). Buffers and
    overlaps are kv | gate rows as projected: HF's overlap gate has the position bias added, which
    is taken off here, as graphcp caches the rows before the bias."""

    attn_implementation = None           # V4 has no sdpa path in transformers

    def layers(self, out, model) -> list:
        return [_hf_layer(cache, block.self_attn)
                for cache, block in zip(out.cache.layers, model.model.layers)]


def _hf_layer(layer, attn) -> tuple:
    def part(name: str, module):
        if name not in getattr(layer, "compressed_kv", {}):
            return None
        overlap = getattr(layer, "overlap_kv", {}).get(name)
        if overlap is not None:
            d = overlap.shape[-1]
            gate = layer.overlap_gate[name][0] - module.position_bias[:, :d]
            overlap = torch.cat([overlap[0], gate], dim=-1)
        buffer = torch.cat([layer.buffer_kv[name][0], layer.buffer_gate[name][0]], dim=-1)
        return layer.compressed_kv[name][0], buffer, overlap
    compressor = getattr(attn, "compressor", None)
    indexer = getattr(compressor, "indexer", None)
    return layer.keys[0, 0], part("compressor", compressor), part("indexer", indexer)


def engine_layer(entry: tuple, window: int, rate: int) -> tuple:
    """One layer of ``engine.kv_cache`` (kv, entries, index_k, compressor rows, indexer rows) in
    ``V4Oracle``'s layout: the last ``window - 1`` keys, and per compressor its entries, the rows of
    the open window and (overlapping) the first halves of the last closed window's rows."""
    kv, entries, index_k, comp_rows, index_rows = entry
    n = kv.shape[0]

    def part(keys, rows):
        if rows is None:
            return None
        closed = n // rate * rate
        overlap = None
        if index_k is not None and closed:          # CSA: both compressors overlap
            half = rows.shape[1] // 4
            last = rows[closed - rate:closed]
            overlap = torch.cat([last[:, :half], last[:, 2 * half:3 * half]], dim=-1)
        return keys, rows[closed:], overlap
    return kv[max(0, n - window + 1):], part(entries, comp_rows), part(index_k, index_rows)


def cache_errors(ours: tuple, theirs: tuple, where: str) -> list[float]:
    """Relative errors of every cache tensor of a layer; shapes must agree, None where HF has
    none."""
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


def check_request(engine, oracle: V4Oracle, path: str, logits: torch.Tensor, rid: str,
                  history: list[int]) -> float:
    """One request's logits and every layer's cache against HF on its whole history -> the worst
    relative error."""
    v4 = read_model_config(path).family_config
    ref_logits, ref_layers = oracle(path, history)
    errs = [rel_err(logits, ref_logits)]
    cache = engine.kv_cache(rid)
    assert len(cache) == len(ref_layers)
    for layer, (entry, ref) in enumerate(zip(cache, ref_layers)):
        ours = engine_layer(entry, v4.sliding_window, v4.compress_rates[layer] or 1)
        errs += cache_errors(ours, ref, f"{rid} layer {layer}")
    worst = max(errs)
    assert worst <= TOL, f"{rid} after {len(history)} tokens: rel err {worst:.2e}"
    return worst


def run_batches(engine, oracle: V4Oracle, path: str, batches: list) -> tuple[float, list]:
    """Each batch through the engine, every request checked against HF -> (worst error, each
    forward's PrefillOutput)."""
    history, worst, outs = {}, 0.0, []
    for batch in batches:
        out = engine.prefill([Request(rid, ids) for rid, ids in batch])
        assert out.mode == "eager" and "DeepSeek V4" in out.eager_reason
        outs.append(out)
        for i, (rid, ids) in enumerate(batch):
            history[rid] = history.get(rid, []) + ids
            err = check_request(engine, oracle, path, out.logits[i], rid, history[rid])
            worst = max(worst, err)
    return worst, outs


def release_all(engine, rids) -> None:
    for rid in rids:
        engine.release(rid)
    stats = engine.stats()
    assert stats["kv_tokens_free"] == stats["kv_tokens_total"]          # every part freed

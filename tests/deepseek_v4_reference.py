"""DeepSeek V4 test parts: tiny random checkpoints written by transformers, HF's one-pass oracle
(logits and caches), graphcp's V4 model run over explicit caches on one rank or as one rank of
interleave CP (the worker spawned with gloo)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

VOCAB = 211
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
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


class V4Oracle:
    """HF in fp32, one pass over a whole history: last-token logits and per layer (window keys,
    compressor (entries, buffer, overlap), indexer (entries, buffer, overlap)) in graphcp's
    layouts (buffer / overlap: kv | gate)."""

    def __init__(self) -> None:
        self.models, self.cache = {}, {}

    @torch.no_grad()
    def __call__(self, path: str, ids: list[int]):
        import transformers
        key = (path, tuple(ids))
        if key not in self.cache:
            if path not in self.models:
                self.models[path] = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32).eval()
            out = self.models[path](torch.tensor([ids]), use_cache=True)
            self.cache[key] = (out.logits[0, -1].float(), [_hf_layer(l) for l in out.cache.layers])
        return self.cache[key]


def _hf_layer(layer) -> tuple:  # noqa: ANN001 - a transformers cache layer
    def part(name: str):
        if name not in getattr(layer, "compressed_kv", {}):
            return None
        overlap = getattr(layer, "overlap_kv", {}).get(name)
        if overlap is not None:
            overlap = torch.cat([overlap[0], layer.overlap_gate[name][0]], dim=-1)
        buffer = torch.cat([layer.buffer_kv[name][0], layer.buffer_gate[name][0]], dim=-1)
        return layer.compressed_kv[name][0], buffer, overlap
    return layer.keys[0, 0], part("compressor"), part("indexer")


def ours_layer(state) -> tuple:  # noqa: ANN001 - a V4LayerState
    def part(comp):  # noqa: ANN001, ANN202
        return None if comp is None else (comp.entries, comp.buffer, comp.overlap)
    return state.window, part(state.compressor), part(state.indexer)


def prefill(model, caches: dict, batch: list[tuple[str, list[int]]], cp_size: int = 1,
            rank: int = 0, group=None, counter: list | None = None):  # noqa: ANN001, ANN201
    """One forward of ``batch`` (rids extend their caches) -> (hidden rows of this rank's tokens,
    their flat indices, {rid: last-token logits} for the requests whose last token is here)."""
    from graphcp.attention.deepseek_v4 import InterleaveGather, V4ReferenceAttention
    from graphcp.cp import build_layout
    from graphcp.forward_context import forward_context
    rids, lens = [rid for rid, _ in batch], [len(ids) for _, ids in batch]
    prefix = [caches[rid][0].length if rid in caches else 0 for rid in rids]
    ids = torch.tensor([t for _, chunk in batch for t in chunk])
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
    local = torch.tensor(build_layout("interleave", cp_size, rank, lens).local_indices)
    gather = None
    if cp_size > 1:
        inner = InterleaveGather(group, cp_size, lens)

        def gather(rows: torch.Tensor) -> torch.Tensor:
            counter.append(rows.shape[-1])
            return inner(rows)
    op = V4ReferenceAttention(caches, rids, lens, local, gather)
    with torch.no_grad(), forward_context(op):
        hidden = model(ids[local], positions[local])
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        logits = {rid: model.compute_logits(hidden[local == end])[0]
                  for rid, end in zip(rids, ends.tolist()) if bool((local == end).any())}
    return hidden, local, logits


def cp_worker(rank: int, world: int, path: str, batches: list, out_dir: str) -> None:
    """One of ``world`` gloo ranks: interleave CP over all of them, and CP 2 over pairs of ranks;
    writes each forward's hidden rows, logits, caches and gathered widths."""
    import torch.distributed as dist
    from graphcp.models import load_model
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank,
                            world_size=world)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    model = load_model(path, torch.float32, torch.device("cpu"))
    results = {}
    for cp_size, group, cp_rank in ((world, None, rank), (2, pairs[rank // 2], rank % 2)):
        caches, steps = {}, []
        for batch in batches:
            counter = []
            hidden, local, logits = prefill(model, caches, batch, cp_size, cp_rank, group, counter)
            steps.append(dict(hidden=hidden, local=local, logits=logits, gathers=counter,
                              caches={rid: [ours_layer(s) for s in layers]
                                      for rid, layers in caches.items()}))
        results[cp_size] = steps
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()

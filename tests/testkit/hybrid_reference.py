"""Hybrid linear-attention models for tests: tiny random HF checkpoints (Qwen3-Next, Qwen3.5,
Qwen3.5-MoE) written by transformers, the HF oracle with its linear-attention cache, and plain
attention ops that stand in for the engine's paged one when a test drives graphcp's model
directly."""
from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.nn import functional as F

ARCHES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


def make_hybrid_checkpoint(path: str, arch: str, seed: int = 0, shard: str | None = None,
                           **overrides) -> str:
    """A random checkpoint mixing Gated DeltaNet and full-attention layers, saved by transformers.
    Decays are made slow (A = exp(A_log) in [0.02, 0.14]) so a state carries across ~100 tokens and
    a wrong hand-off shows; ``shard`` (e.g. "40KB") writes several safetensors files and the
    index."""
    import transformers
    cfg_name, model_name = ARCHES[arch]
    kwargs = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=2048,
                  layer_types=["linear_attention", "full_attention", "linear_attention",
                               "linear_attention"])
    if arch != "qwen3_5":
        kwargs.update(MOE)
    if arch == "qwen3_next":
        kwargs["decoder_sparse_step"] = 2        # layers 1 and 3 MoE, 0 and 2 dense
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(math.log(0.02), math.log(0.14))
            elif name.endswith("dt_bias"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    sharding = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **sharding)
    return path


class HybridHF:
    """The HF model in fp32 on CPU (its torch gated-delta-rule fallback): logits at every position
    and, per layer, the cache it leaves: (conv window [K-1, conv_dim], delta state [Hv, dk, dv]) for
    linear layers, (k, v) [kv_heads, len, head_dim] for full-attention ones."""

    def __init__(self, path: str) -> None:
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(self, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        out = self.model(torch.tensor([ids]), use_cache=True)
        cache, layers = out.past_key_values, []
        for i, kind in enumerate(self.model.config.layer_types):
            layer = cache.layers[i]
            if kind == "linear_attention":
                conv = layer.conv_states[0][0]                 # [conv_dim, K], oldest first
                layers.append((conv[:, 1:].t().float(), layer.recurrent_states[0][0].float()))
            else:
                layers.append((layer.keys[0].float(), layer.values[0].float()))
        return out.logits[0].float(), layers


class ByKind:
    """The forward context's attention op of a hybrid model: each call goes to the op of its layer's
    kind (the linear-attention op for Gated DeltaNet layers, ``full`` for the others)."""

    def __init__(self, linear_layers: tuple[int, ...], linear, full) -> None:
        self.linear_layers, self.linear, self.full = linear_layers, linear, full

    def __call__(self, layer_id: int, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        op = self.linear if layer_id in self.linear_layers else self.full
        return op(layer_id, *args, **kwargs)


class LocalFullAttention:
    """Causal attention of each request over its cached and new K/V: the test stand-in for the
    engine's paged attention op, keeping K/V per (request, layer) across calls."""

    def __init__(self, kv: dict, rids: list[str], lens: list[int]) -> None:
        self.kv, self.rids, self.lens = kv, rids, lens

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        out, start = q.new_zeros(q.shape), 0
        for rid, n in zip(self.rids, self.lens):
            old_k, old_v = self.kv.get((rid, layer_id), (k[:0], v[:0]))
            keys = torch.cat([old_k, k[start:start + n]])
            values = torch.cat([old_v, v[start:start + n]])
            self.kv[(rid, layer_id)] = (keys, values)
            prefix = keys.shape[0] - n
            mask = (torch.arange(n)[:, None] + prefix) >= torch.arange(prefix + n)[None, :]
            out[start:start + n] = _attend(q[start:start + n], keys, values, mask)
            start += n
        return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, d], keys/values [L, Hkv, d] (grouped heads), mask [n, L] -> [n, Hq, d]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.repeat_interleave(group, 1).transpose(0, 1) for x in (keys, values))
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
    return attn.transpose(0, 1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


class StateSlots:
    """Per-request state for tests that drive the linear ops directly: a StatePool over ``layers``
    and one slot per request, read once the request has run and written in place."""

    def __init__(self, cfg, layers, requests: int = 4) -> None:
        from graphcp.attention.kinds import state_parts
        from graphcp.kv.states import StatePool
        parts = state_parts(cfg, range(cfg.num_hidden_layers), 1)
        self.pool = StatePool({i: parts[i] for i in layers}, requests, torch.float32,
                              torch.device("cpu"))
        self.slot: dict[str, int] = {}
        self.ran: set[str] = set()

    def states(self, rids: list[str]):
        """This batch's states; every request counts as run after it."""
        from graphcp.attention.linear_op import RequestStates
        state_in = torch.tensor([self.slot[r] if r in self.ran else 0 for r in rids])
        out = torch.tensor([self.slot.setdefault(r, len(self.slot) + 1) for r in rids])
        self.ran.update(rids)
        return RequestStates(self.pool, state_in, out)

    def request_state(self, rid: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: (conv window [K-1, conv_dim], delta state [Hv, dk, dv])."""
        return {layer: self.pool.read(layer, self.slot[rid]) for layer in self.pool.layer_parts}


def graph_equals_eager(make_op, mixer, inputs: list[torch.Tensor],
                       tensors: list[torch.Tensor], next_batch) -> float:
    """Capture the linear-attention op ``make_op()`` builds (built inside the segment, as the engine
    builds it per forward) under graphcp's CPU capture emulation (its rules: no host sync, no
    data-dependent shape, collectives as breaks), let ``next_batch()`` write another batch into the
    same buffers (inputs and batch tensors), replay, and return the worst relative error of the
    replay's outputs and states (``tensors``) against an eager call on that batch."""
    from graphcp.graph.cpu import CpuCapture
    gen = torch.Generator().manual_seed(3)
    layer = mixer.layer_id
    out = make_op()(layer, *inputs, mixer=mixer).clone()    # eager warmup: the output's shape
    with CpuCapture() as capture:
        out.copy_(make_op()(layer, *inputs, mixer=mixer))
    graph = capture.finish([out, *inputs, *tensors])
    next_batch()
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in tensors]
    graph.replay()
    replayed = [out.clone()] + [t.clone() for t in tensors]
    for t, b in zip(tensors, before):
        t.copy_(b)
    eager = [make_op()(layer, *inputs, mixer=mixer)] + tensors
    return max(rel_err(a, b) for a, b in zip(replayed, eager))

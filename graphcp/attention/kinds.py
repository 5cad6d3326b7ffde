"""Layer kinds: for each kind of attention layer, its per-forward op, the parts it caches per token
(and per request, for a recurrent kind), and how the engine returns them (``engine.kv_cache``). The
model config names each layer's kind (``ModelConfig.attention_kinds``); this table is the one place a
name becomes an op and a cache layout. A new family adds its kind here, its op beside ``op.py``,
``dsa.py`` and ``mla.py``, and its model file."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.attention.deepseek_v4 import GRAPH_REASON as V4_REASON
from graphcp.attention.deepseek_v4 import V4CSAAttention, V4HCAAttention, V4SlidingAttention, v4_export, v4_parts
from graphcp.attention.dsa import DSAAttention
from graphcp.attention.linear_cp import linear_attention
from graphcp.attention.linear_op import CONV, RECURRENT
from graphcp.attention.mla import MLAAttention, probe_mla
from graphcp.attention.op import PagedAttention
from graphcp.errors import ConfigError
from graphcp.kernels.resolve import probe_delta_rule
from graphcp.kv.cache import CachePart, LayerParts
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import MLAConfig
from graphcp.models.qwen3_next.config import HybridConfig


def join_heads(shards: list[tuple]) -> tuple:
    """One layer's ``kv_cache`` entry from its attention-TP ranks' (in rank order): each part's
    heads side by side (dim 0; a part a kind leaves None stays None)."""
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*shards))


@dataclass(frozen=True)
class LayerKind:
    name: str
    op: Callable                                                   # built once per forward: op(ctx)
    parts: Callable[[ModelConfig, int, int], tuple[CachePart, ...]]  # (config, layer, attention TP)
    export: Callable[[ModelConfig, tuple[torch.Tensor, ...]], tuple]  # rows per part -> kv_cache entry
    pd_kind: str                                                   # the name PD destinations carry
    kernels: tuple[str, ...]                                       # the kernel ops its op runs
    graph_reason: str | None = None                                # why its layers run eagerly
    heads_split: bool = True        # attention-TP ranks cache their own heads (else the same rows)
    state: Callable[[ModelConfig, int, int], tuple[CachePart, ...]] | None = None  # per request
    join: Callable[[list[tuple]], tuple] = join_heads      # attention-TP ranks' exports -> one
    # checks its op's Triton kernels at start on CUDA: (choices, config, attention TP, device, dtype)
    probe: Callable | None = None
    # its op uses the pool through ``write`` / ``part`` / ``prepare`` only: its cache can be
    # sharded over the CP group (``kv/sharding.py``)
    shardable: bool = False


def _gqa_parts(cfg: ModelConfig, layer: int, attn_tp: int) -> tuple[CachePart, ...]:
    row = (cfg.kv_heads_per_rank(attn_tp), cfg.head_dim)
    return CachePart("k", row), CachePart("v", row)


def _gqa_export(cfg: ModelConfig, rows: tuple[torch.Tensor, ...]) -> tuple:
    """(k, v) [kv_heads, n, head_dim], keys after RoPE: HF's past_key_values."""
    k, v = rows
    return k.transpose(0, 1).float().cpu(), v.transpose(0, 1).float().cpu()


def _dsa_parts(cfg: ModelConfig, layer: int, attn_tp: int) -> tuple[CachePart, ...]:
    """The MLA row, shared by every head (so by every attention-TP rank), and the indexer keys on
    an indexed layer (not DeepSeek-V3's, nor a GLM-5 "shared" one that reuses the top-k before)."""
    d = MLAConfig.of(cfg)
    mla = CachePart("mla", (d.kv_lora_rank + d.qk_rope_head_dim,))
    if not d.indexed(layer):
        return (mla,)
    return mla, CachePart("index_k", (d.index_head_dim,))


def _dsa_export(cfg: ModelConfig, rows: tuple[torch.Tensor, ...]) -> tuple:
    """(kv_latent [n, kv_lora_rank], k_rope [n, rope_dim], index_k [n, index_dim] or None)."""
    mla = rows[0].float().cpu()
    index = rows[1].float().cpu() if len(rows) > 1 else None
    latent = MLAConfig.of(cfg).kv_lora_rank
    return mla[:, :latent], mla[:, latent:], index


def _linear_state(cfg: ModelConfig, layer: int, attn_tp: int) -> tuple[CachePart, ...]:
    """Gated DeltaNet: the conv window (the last K-1 q|k|v inputs), the delta-rule state (fp32),
    of a rank's heads."""
    h = HybridConfig.of(cfg).per_rank(attn_tp)
    return (CachePart(CONV, (h.conv_kernel - 1, h.conv_dim)),
            CachePart(RECURRENT, (h.num_v_heads, h.head_k_dim, h.head_v_dim), torch.float32))


def _linear_export(cfg: ModelConfig, rows: tuple[torch.Tensor, ...]) -> tuple:
    """(conv window [K-1, conv_dim], the last K-1 inputs oldest first; delta-rule state
    [Hv, dk, dv]). HF's cache keeps the window as [conv_dim, K] with one older input, never read."""
    window, state = rows
    return window.float().cpu(), state.float().cpu()


def _linear_join(shards: list[tuple]) -> tuple:
    """Gated DeltaNet: the delta states' heads side by side; each window's channels are the rank's
    q|k|v (its key heads' q, k; their value heads' v), so each section is joined on its own. A
    rank's v has its state's heads x dv channels, q and k split the rest."""
    sections = []
    for window, state in shards:
        v = state.shape[0] * state.shape[2]
        k = (window.shape[1] - v) // 2
        sections.append(window.split([k, k, v], 1))
    window = torch.cat([torch.cat(part, 1) for part in zip(*sections)], 1)
    return window, torch.cat([state for _, state in shards])


def _probe_linear(choices, cfg: ModelConfig, attn_tp: int, device, dtype) -> None:
    hybrid = cfg.family_config       # the Triton delta rule at the model's key / value head dims
    probe_delta_rule(choices, device, dtype, hybrid.head_k_dim, hybrid.head_v_dim)


KINDS = {
    "gqa": LayerKind("gqa", PagedAttention, _gqa_parts, _gqa_export, "mha", ("attention",),
                     shardable=True),
    "dsa": LayerKind("dsa", DSAAttention, _dsa_parts, _dsa_export, "dsa", ("dsa",),
                     "DSA models run eagerly (indexer top-k and sparse attention, as SGLang)",
                     heads_split=False, shardable=True),
    # Dense MLA: the Triton prefill (checked by its probe) or the torch forms; PD carries its rows
    # as a DSA layer's.
    "mla": LayerKind("mla", MLAAttention, _dsa_parts, _dsa_export, "dsa", (), heads_split=False,
                     probe=probe_mla, shardable=True),
    # DeepSeek V4 (attention/deepseek_v4.py): one kind per layer type, one PD kind for all three
    "deepseek_v4_sliding": LayerKind("deepseek_v4_sliding", V4SlidingAttention, v4_parts,
                                     v4_export, "deepseek_v4", (), V4_REASON),
    "deepseek_v4_hca": LayerKind("deepseek_v4_hca", V4HCAAttention, v4_parts, v4_export,
                                 "deepseek_v4", (), V4_REASON),
    "deepseek_v4_csa": LayerKind("deepseek_v4_csa", V4CSAAttention, v4_parts, v4_export,
                                 "deepseek_v4", ("dsa",), V4_REASON),
    "gated_deltanet": LayerKind("gated_deltanet", linear_attention, lambda cfg, layer, tp: (),
                                _linear_export, "gated_deltanet", (), state=_linear_state,
                                join=_linear_join, probe=_probe_linear),
}


def layer_kinds(cfg: ModelConfig, layers: range) -> dict[int, LayerKind]:
    kinds = {}
    for layer in layers:
        name = cfg.attention_kinds[layer]
        if name not in KINDS:
            raise ConfigError(f"--model-path: layer {layer} has attention kind {name!r}, which graphcp does "
                              f"not implement ({', '.join(KINDS)})")
        kinds[layer] = KINDS[name]
    return kinds


def cache_parts(cfg: ModelConfig, layers: range, attn_tp: int) -> LayerParts:
    """What each of ``layers`` caches per token on a rank of attention-TP size ``attn_tp``."""
    return {layer: kind.parts(cfg, layer, attn_tp) for layer, kind in layer_kinds(cfg, layers).items()}


def state_parts(cfg: ModelConfig, layers: range, attn_tp: int) -> LayerParts:
    """What each of ``layers`` whose kind keeps per-request state keeps per request."""
    kinds = layer_kinds(cfg, layers)
    return {layer: kind.state(cfg, layer, attn_tp) for layer, kind in kinds.items()
            if kind.state is not None}

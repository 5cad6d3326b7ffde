"""Multi-head latent attention (MLA) with the DSA lightning indexer, HF weight names (DeepSeek V3.2,
GLM-5).

Absorbed form: each head's no-RoPE query is multiplied into the latent space by its slice of
``kv_b_proj`` (W_UK), so attention runs as one-KV-head MQA over the cached rows
``[kv_latent | k_rope]`` and returns latent outputs, which W_UV maps to each head's values. Keys and
values are never expanded per head, and the cache holds exactly what HF caches. The attention op
(forward context) writes the cache, runs the indexer's top-k and the sparse attention.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.forward_context import current_attention
from graphcp.models.config import ModelConfig
from graphcp.models.layers import RMSNorm, rope_torch


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's pairwise rotation of (x0, x1), (x2, x3), ...; the output is de-interleaved (even
    results, then odd ones), as HF writes it. cos/sin: the usual cat(freqs, freqs) tables."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Fp32Projection(nn.Module):
    """A bias-free projection kept in fp32 in any model dtype (HF keeps ``indexer.weights_proj``
    fp32); not an ``nn.Linear``, so FP8 checkpoints leave it unquantized, as HF does."""

    keep_fp32 = True

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    """The lightning indexer's projections: per-head queries, one key per token, per-head weights.
    Scoring and top-k run in the attention op, where the cached keys are."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.dsa
        self.heads, self.head_dim = d.index_n_heads, d.index_head_dim
        self.rope_dim = d.qk_rope_head_dim
        self.wq_b = nn.Linear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=1e-6)
        self.weights_proj = Fp32Projection(cfg.hidden_size, d.index_n_heads)
        self.rope = rope_interleaved if d.indexer_rope_interleaved else rope_torch

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (queries [T, Hi, Di], head weights [T, Hi] fp32, keys [T, Di]); RoPE on the first
        ``qk_rope_head_dim`` features of each."""
        r = self.rope_dim
        q = self.wq_b(q_resid).view(x.shape[0], self.heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        q = torch.cat([self.rope(q[..., :r], cos[:, None], sin[:, None]), q[..., r:]], dim=-1)
        k = torch.cat([self.rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        weights = self.weights_proj(x) * self.heads ** -0.5
        return q, weights, k


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d = cfg.dsa
        self.layer_id, self.num_heads, self.d = layer_id, cfg.num_attention_heads, d
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = nn.Linear(hidden, d.q_lora_rank, bias=d.attention_bias)
        self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(d.q_lora_rank, heads * d.qk_head_dim, bias=False)
        latent = d.kv_lora_rank
        rope, bias = d.qk_rope_head_dim, d.attention_bias
        self.kv_a_proj_with_mqa = nn.Linear(hidden, latent + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(latent, heads * (d.qk_nope_head_dim + d.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * d.v_head_dim, hidden, bias=d.attention_bias)
        # GLM "shared" layers have no indexer: they reuse the previous layer's top-k.
        self.indexer = None if d.shared_indexer[layer_id] else Indexer(cfg)

    def fuse(self) -> None:
        """Nothing to fuse: the absorbed W_UK / W_UV are views of ``kv_b_proj`` taken per call."""

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``rope``: the (cos, sin) tables at this rank's positions."""
        (cos, sin), d, t, heads = rope, self.d, x.shape[0], self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, heads, d.qk_head_dim)
        q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_rope = kv.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = rope_interleaved(q_rope, cos[:, None], sin[:, None])
        k_rope = rope_interleaved(k_rope, cos, sin)
        w = self.kv_b_proj.weight.view(heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        w_uk, w_uv = w[:, :d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [T, H, C]
        index = self.indexer(x, q_resid, cos, sin) if self.indexer is not None else None
        query = torch.cat([q_latent, q_rope], dim=-1)
        out = current_attention()(self.layer_id, query, torch.cat([latent, k_rope], dim=-1), index)
        out = torch.matmul(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]
        return self.o_proj(out.reshape(t, heads * d.v_head_dim))

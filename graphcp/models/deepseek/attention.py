"""Multi-head latent attention (MLA), HF weight names: dense (DeepSeek-V3 / R1, Kimi-K2) or with the
DSA lightning indexer (DeepSeek V3.2, GLM-5). Heads are split over attention TP (``q_b_proj`` /
``q_proj``, ``kv_b_proj``, ``o_proj``); the latent projections, the cached row
``[kv_latent | k_rope]`` and the indexer are the same on every attention-TP rank.

DSA layers use the absorbed form: each head's no-RoPE query is multiplied into the latent space by
its slice of ``kv_b_proj`` (W_UK), so the sparse attention runs as one-KV-head MQA over the cached
rows and returns latent outputs, which W_UV maps to each head's values. Dense MLA layers hand the op
the full queries and ``kv_b_proj``; it picks the absorbed or the expanded form per batch
(``kernels/mla_torch.py``). Either way the cache holds exactly what HF caches.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import TPInfo
from graphcp.forward_context import current_attention
from graphcp.kernels.torch_layers import rope_interleaved, rope_torch
from graphcp.models.common.layers import RMSNorm
from graphcp.models.common.linear import ColumnLinear, Linear, RowLinear
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import MLAConfig


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
        d = MLAConfig.of(cfg)
        self.heads, self.head_dim = d.index_n_heads, d.index_head_dim
        self.rope_dim = d.qk_rope_head_dim
        self.wq_b = Linear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, d.index_head_dim, bias=False)
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
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo | None = None) -> None:
        super().__init__()
        d, tp = MLAConfig.of(cfg), tp or TPInfo()
        self.layer_id, self.num_heads, self.d = layer_id, cfg.num_attention_heads // tp.size, d
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        if d.q_lora_rank is None:           # DeepSeek-V3 without a query LoRA
            self.q_proj = ColumnLinear(hidden, heads * d.qk_head_dim, False, tp, unit=d.qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, d.q_lora_rank, bias=d.attention_bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnLinear(d.q_lora_rank, heads * d.qk_head_dim, False, tp,
                                         unit=d.qk_head_dim)
        latent = d.kv_lora_rank
        rope, bias = d.qk_rope_head_dim, d.attention_bias
        self.kv_a_proj_with_mqa = Linear(hidden, latent + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        unit = d.qk_nope_head_dim + d.v_head_dim
        self.kv_b_proj = ColumnLinear(latent, heads * unit, False, tp, unit=unit)
        # The op splits it into the absorbed W_UK / W_UV: the one weight kept dequantized (FP8).
        self.kv_b_proj.dequantized_at_load = True
        self.o_proj = RowLinear(heads * d.v_head_dim, hidden, tp, unit=d.v_head_dim, bias=bias)
        self.sparse = d.index_topk > 0       # DSA: the indexer's top-k selects the keys
        # GLM "shared" layers have no indexer: they reuse the previous layer's top-k.
        self.indexer = Indexer(cfg) if d.indexed(layer_id) else None
        self.rope = rope_interleaved if d.rope_interleave else rope_torch

    def fuse(self) -> None:
        """Nothing to fuse: the absorbed W_UK / W_UV are views of ``kv_b_proj`` taken per call."""

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``rope``: the (cos, sin) tables at this rank's positions."""
        (cos, sin), d, t, heads = rope, self.d, x.shape[0], self.num_heads
        if d.q_lora_rank is None:
            q_resid, q = None, self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(t, heads, d.qk_head_dim)
        q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_rope = kv.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = self.rope(q_rope, cos[:, None], sin[:, None])
        rows = torch.cat([latent, self.rope(k_rope, cos, sin)], dim=-1)
        if not self.sparse:
            query = torch.cat([q_nope, q_rope], dim=-1)
            out = current_attention()(self.layer_id, query, rows, self.kv_b_proj.weight)
            return self.o_proj(out.reshape(t, heads * d.v_head_dim))
        w = self.kv_b_proj.weight.view(heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        w_uk, w_uv = w[:, :d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [T, H, C]
        index = self.indexer(x, q_resid, cos, sin) if self.indexer is not None else None
        query = torch.cat([q_latent, q_rope], dim=-1)
        out = current_attention()(self.layer_id, query, rows, index)
        out = torch.matmul(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]
        return self.o_proj(out.reshape(t, heads * d.v_head_dim))

"""DeepSeek V4 attention, HF weight names: shared-KV multi-query attention (one KV head, K = V)
with partial interleaved RoPE (undone on the output), per-head sinks, a grouped low-rank output
projection, a sliding window on every layer and, per layer kind, a compressor (HCA: one entry per
``rate`` tokens, attended densely; CSA: overlapping windows and a lightning indexer choosing
``index_topk`` entries per query).

The layer computes every per-token projection; the attention op (forward context,
``graphcp/attention/deepseek_v4.py``) owns the rest: it gathers the new rows in token order into the
paged cache, pools the windows that close (``Compressor.entries`` here) and attends this rank's
queries."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.forward_context import current_attention
from graphcp.kernels.fp8_torch import dense_weight
from graphcp.kernels.v4_torch import pool_windows, rotate_tail
from graphcp.models.common.linear import Linear
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from graphcp.models.deepseek_v4.rope import V4RMSNorm, V4Rotary, unweighted_rms_norm


class Projection(nn.Module):
    """A bias-free projection that FP8 checkpoints leave unquantized (transformers keeps V4's
    compressor and indexer-weight projections in bf16); not an ``nn.Linear`` for that reason."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class Compressor(nn.Module):
    """Projects each token to a kv and a gate row (``rows``); ``entries`` pools closed windows of
    ``rate`` tokens into entries, RMS-normed and rotated at their window's first position."""

    fp32_tensors = ("position_bias",)       # kept fp32 in any model dtype, as transformers

    def __init__(self, hidden: int, entry_dim: int, rate: int, overlapping: bool, eps: float,
                 rotary: V4Rotary) -> None:
        super().__init__()
        width = 2 * entry_dim if overlapping else entry_dim
        self.rate, self.overlapping = rate, overlapping
        self.entry_dim, self.width = entry_dim, width
        self.span = 2 * rate if overlapping else rate       # tokens one entry pools over
        self.kv_proj = Projection(hidden, width)
        self.gate_proj = Projection(hidden, width)
        self.position_bias = nn.Parameter(torch.empty(rate, width), requires_grad=False)
        self.kv_norm = V4RMSNorm(entry_dim, eps)
        self.rotary = [rotary]      # shared, kept out of the state dict

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, 2 * width]: kv | gate."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def entries(self, rows: torch.Tensor, present: torch.Tensor,
                blocks: torch.Tensor) -> torch.Tensor:
        """The entries of windows ``blocks`` [E] (entry e pools tokens up to (e + 1) * rate - 1):
        rows [E, span, 2 * width] of the ``span`` tokens ending there, present [E, span]
        -> [E, d]."""
        pooled = pool_windows(rows, present, self.position_bias, self.overlapping)
        cos, sin = self.rotary[0](blocks * self.rate, pooled.dtype)
        return rotate_tail(self.kv_norm(pooled), cos, sin)


class Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = Projection(hidden, heads)


class Indexer(Compressor):
    """The lightning indexer: its own overlapping compressor at ``index_head_dim`` (the keys) and
    per-head queries and weights; scoring and top-k run in the attention op."""

    def __init__(self, cfg: ModelConfig, rate: int, rotary: V4Rotary) -> None:
        v4 = DeepseekV4Config.of(cfg)
        super().__init__(cfg.hidden_size, v4.index_head_dim, rate, True, cfg.rms_norm_eps, rotary)
        self.heads = v4.index_n_heads
        self.q_b_proj = Linear(v4.q_lora_rank, v4.index_n_heads * v4.index_head_dim, bias=False)
        self.scorer = Scorer(cfg.hidden_size, v4.index_n_heads)

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (queries [T, Hi, Di] rotated, head weights [T, Hi] fp32, scaled by Hi^-1/2)."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.entry_dim)
        weights = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        return rotate_tail(q, cos[:, None], sin[:, None]), weights


class CSACompressor(Compressor):
    def __init__(self, cfg: ModelConfig, rate: int, rotary: V4Rotary) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, rate, True, cfg.rms_norm_eps, rotary)
        self.indexer = Indexer(cfg, rate, rotary)


class V4Attention(nn.Module):
    fp32_tensors = ("sinks",)

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: V4Rotary) -> None:
        super().__init__()
        v4, hidden, heads, d = DeepseekV4Config.of(cfg), cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.layer_id, self.kind = layer_id, v4.layer_types[layer_id]
        self.num_heads, self.head_dim, self.eps = heads, d, cfg.rms_norm_eps
        self.groups, self.scale = v4.o_groups, d ** -0.5
        self.q_a_proj = Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(v4.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(v4.q_lora_rank, heads * d, bias=False)
        self.kv_proj = Linear(hidden, d, bias=False)
        self.kv_norm = V4RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = Linear(heads * d // v4.o_groups, v4.o_groups * v4.o_lora_rank,
                                  bias=False)
        self.o_b_proj = Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads), requires_grad=False)
        rate = v4.compress_rates[layer_id]
        if self.kind == CSA:
            self.compressor = CSACompressor(cfg, rate, rotary)
        elif self.kind == HCA:
            self.compressor = Compressor(hidden, d, rate, False, cfg.rms_norm_eps, rotary)
        else:
            self.compressor = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, rope / 2] of this layer's rotary -> [T, hidden]. The op gets
        the queries, the new K = V rows and each compressor's kv | gate rows with the compressor
        itself (it pools the windows that close); CSA also the indexer's queries and weights."""
        t = x.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim),
                                self.eps)
        q = rotate_tail(q, cos[:, None], sin[:, None])
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin)
        compressors, index = (), None
        if self.compressor is not None:
            compressors = (self.compressor,)
        if self.kind == CSA:
            indexer = self.compressor.indexer
            compressors = (self.compressor, indexer)
            index = indexer.queries(x, q_residual, cos, sin)
        rows = [c.rows(x) for c in compressors]
        out = current_attention()(self.layer_id, q, kv, *rows, sinks=self.sinks, scale=self.scale,
                                  compressors=compressors, index=index)          # [T, H, D]
        out = rotate_tail(out, cos[:, None], -sin[:, None])      # undo the values' rotation
        return self.o_b_proj(self.grouped_output(out))

    def grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """Each group of heads projected on its own to ``o_lora_rank`` features (block-diagonal
        ``o_a_proj``), as transformers computes it: one batched GEMM over the groups."""
        t, per_group = out.shape[0], self.num_heads * self.head_dim // self.groups
        o_a = dense_weight(self.o_a_proj.fp8 or self.o_a_proj.weight, out.dtype)   # FP8: per call
        weight = o_a.view(self.groups, -1, per_group).transpose(1, 2)
        grouped = out.reshape(t, self.groups, per_group).transpose(0, 1)
        return torch.bmm(grouped, weight).transpose(0, 1).reshape(t, -1)

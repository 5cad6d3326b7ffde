"""The GQA self-attention the dense-attention families share (Llama, Mistral, Qwen2/3, Qwen3-MoE,
GLM-4.5, gpt-oss): one fused q/k/v GEMM, optional per-head q/k RMSNorm, RoPE over the whole head or
its first ``rotary_dim`` dims (GLM's partial rotary, the rest passed through), optional learned sink
logits per head (gpt-oss), then the forward context's attention op and o_proj. Heads (and their
sinks) split over the attention TP group; KV heads are replicated where the group is larger. HF's
tensor names: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, sinks."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import TPInfo, kv_head_range, shard_range
from graphcp.forward_context import current_attention
from graphcp.models.common.layers import RMSNorm, RotaryEmbedding
from graphcp.models.common.linear import ColumnLinear, RowLinear, fused_linear
from graphcp.models.common.quantized import fuse
from graphcp.models.config import ModelConfig


class GQAAttention(nn.Module):
    keeps_rows = True       # can compute some rows' outputs only (DecoderLM.prunes_last_layer)
    fused_projections = (("q_proj", "k_proj", "v_proj"),)      # laid out back to back at load

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo,
                 rotary_dim: int | None = None, sinks: bool = False) -> None:
        super().__init__()
        d, hidden = cfg.head_dim, cfg.hidden_size
        self.layer_id, self.head_dim = layer_id, d
        self.rotary_dim = rotary_dim or d
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.kv_heads_per_rank(tp.size)
        first, last = kv_head_range(cfg.num_key_value_heads, tp.size, tp.rank)
        kv_rows = (first * d, last * d)         # a replicated head where TP exceeds the KV heads
        self.q_proj = ColumnLinear(hidden, cfg.q_size, cfg.qkv_bias, tp, unit=d)
        self.k_proj = ColumnLinear(hidden, cfg.kv_size, cfg.qkv_bias, tp, rows=kv_rows)
        self.v_proj = ColumnLinear(hidden, cfg.kv_size, cfg.qkv_bias, tp, rows=kv_rows)
        self.o_proj = RowLinear(cfg.q_size, hidden, tp, unit=d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        if sinks:
            # this rank's heads' sink logits (the heads q_proj's shard holds), kept fp32
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.tensor_shards = {"sinks": (0, *shard_range(cfg.num_attention_heads, tp.size,
                                                             tp.rank))}
            self.fp32_tensors = ("sinks",)
        self.rotary = [rotary]  # shared, not a submodule: kept out of the state dict
        self.qkv: tuple | None = None           # (weight, bias, split sizes) after fuse()

    def fuse(self) -> None:
        """One GEMM for q, k and v (their weights are views of it)."""
        self.qkv = fuse((self.q_proj, self.k_proj, self.v_proj))

    def _rope(self, positions: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hq, hk, r = self.num_heads, self.num_kv_heads, self.rotary_dim
        if not hasattr(self, "q_norm") and r == self.head_dim:
            qk = self.rotary[0].rotate(positions, heads[:, :hq + hk])   # q's and k's heads at once
            return qk[:, :hq], qk[:, hq:]
        q, k = heads[:, :hq], heads[:, hq:hq + hk]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if r == self.head_dim:
            return self.rotary[0](positions, q, k)
        q_rot, k_rot = self.rotary[0](positions, q[..., :r], k[..., :r])
        return torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: only those tokens' outputs are wanted (every token's K/V is still cached)."""
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        heads = fused_linear(x, self.qkv).view(t, hq + 2 * hk, d)
        q, k = self._rope(positions, heads)
        extra = {} if rows is None else {"rows": rows}
        if hasattr(self, "sinks"):
            extra["sinks"] = self.sinks
        out = current_attention()(self.layer_id, q, k, heads[:, hq + hk:], **extra)
        return self.o_proj(out.reshape(out.shape[0], hq * d))


__all__ = ["GQAAttention"]

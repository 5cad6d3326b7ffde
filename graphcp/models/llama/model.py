"""Llama-family causal LM (Llama with optional attention/MLP biases, Mistral, Qwen2 with qkv bias, Qwen3 with
q/k norm and optional attention bias, Qwen3-MoE: Qwen3 attention with MoE blocks), HF weight names, on the
shared decoder (``models/common/decoder.py``). Heads are split over the attention TP group, MLP features over the
FFN TP group.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.forward_context import current_attention
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.layers import RMSNorm, RotaryEmbedding
from graphcp.models.common.linear import ColumnLinear, RowLinear, fused_linear
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.common.moe import MoEBlock
from graphcp.models.common.quantized import fuse
from graphcp.models.config import ModelConfig


class SelfAttention(nn.Module):
    keeps_rows = True       # can compute some rows' outputs only (DecoderLM.prunes_last_layer)
    fused_projections = (("q_proj", "k_proj", "v_proj"),)      # laid out back to back at load

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo) -> None:
        super().__init__()
        self.layer_id, self.head_dim = layer_id, cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        d = cfg.head_dim
        self.q_proj = ColumnLinear(cfg.hidden_size, cfg.q_size, cfg.qkv_bias, tp, unit=d)
        self.k_proj = ColumnLinear(cfg.hidden_size, cfg.kv_size, cfg.qkv_bias, tp, unit=d)
        self.v_proj = ColumnLinear(cfg.hidden_size, cfg.kv_size, cfg.qkv_bias, tp, unit=d)
        self.o_proj = RowLinear(cfg.q_size, cfg.hidden_size, tp, unit=d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # shared, not a submodule: kept out of the state dict
        self.qkv: tuple | None = None  # (weight, bias, split sizes) after fuse()

    def fuse(self) -> None:
        """One GEMM for q, k and v (their weights are views of it)."""
        self.qkv = fuse((self.q_proj, self.k_proj, self.v_proj))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: only those tokens' outputs are wanted (every token's K/V is still cached)."""
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        heads = fused_linear(x, self.qkv).view(t, hq + 2 * hk, d)
        q, k, v = heads[:, :hq], heads[:, hq:hq + hk], heads[:, hq + hk:]
        if hasattr(self, "q_norm"):
            q, k = self.rotary[0](positions, self.q_norm(q), self.k_norm(k))
        else:        # q's and k's heads are adjacent: RoPE on both in one pass
            qk = self.rotary[0].rotate(positions, heads[:, :hq + hk])
            q, k = qk[:, :hq], qk[:, hq:]
        attend = current_attention()
        extra = {} if rows is None else {"rows": rows}
        out = attend(self.layer_id, q, k, v, **extra)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class LlamaForCausalLM(DecoderLM):
    """The llama family on the shared decoder: q/k/v attention with RoPE, a dense or MoE FFN per layer."""

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo, ep: EPInfo) -> DecoderLayer:
        mlp = MoEBlock(cfg, ep) if layer in cfg.moe_layers else GatedMLP(cfg, ffn_tp)
        return DecoderLayer(cfg, SelfAttention(cfg, layer, self.rotary, tp), mlp)

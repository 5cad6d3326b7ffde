"""GLM-4.5 / 4.6 / 4.7 causal LM (``Glm4MoeForCausalLM``), HF weight names, on the shared decoder
(``models/common/decoder.py``): GQA attention with q/k/v biases, optional per-head q/k RMSNorm and
RoPE on the first ``rotary_dim`` dims of each head (half-split, the rest passed through), a dense
FFN on the first layers and the grouped top-k MoE with shared experts
(``models/common/grouped_moe.py``) on the others. Heads and the vocabulary split over attention
TP; the dense FFN and the shared experts over the TP world, the routed experts over EP and expert
TP.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.forward_context import current_attention
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.grouped_moe import GroupedTopKMoE
from graphcp.models.common.layers import RMSNorm, RotaryEmbedding
from graphcp.models.common.linear import ColumnLinear, RowLinear, fused_linear
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.common.quantized import fuse
from graphcp.models.config import ModelConfig
from graphcp.models.glm4_moe.config import Glm4MoeConfig


class PartialRotaryAttention(nn.Module):
    """q/k/v (one fused GEMM), q/k RMSNorm per head where the config says so, RoPE over the first
    ``rotary_dim`` dims of q and k, attention, o_proj (no bias)."""

    keeps_rows = True       # can compute some rows' outputs only (DecoderLM.prunes_last_layer)
    fused_projections = (("q_proj", "k_proj", "v_proj"),)

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo) -> None:
        super().__init__()
        d = cfg.head_dim
        self.layer_id, self.head_dim = layer_id, d
        self.rotary_dim = Glm4MoeConfig.of(cfg).rotary_dim
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.q_proj = ColumnLinear(cfg.hidden_size, cfg.q_size, cfg.qkv_bias, tp, unit=d)
        self.k_proj = ColumnLinear(cfg.hidden_size, cfg.kv_size, cfg.qkv_bias, tp, unit=d)
        self.v_proj = ColumnLinear(cfg.hidden_size, cfg.kv_size, cfg.qkv_bias, tp, unit=d)
        self.o_proj = RowLinear(cfg.q_size, cfg.hidden_size, tp, unit=d)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = [rotary]      # shared, not a submodule: kept out of the state dict
        self.qkv: tuple | None = None

    def fuse(self) -> None:
        self.qkv = fuse((self.q_proj, self.k_proj, self.v_proj))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: only those tokens' outputs are wanted (every token's K/V is still cached)."""
        t, hq, hk, r = x.shape[0], self.num_heads, self.num_kv_heads, self.rotary_dim
        heads = fused_linear(x, self.qkv).view(t, hq + 2 * hk, self.head_dim)
        q, k, v = heads[:, :hq], heads[:, hq:hq + hk], heads[:, hq + hk:]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q_rot, k_rot = self.rotary[0](positions, q[..., :r], k[..., :r])
        if r < self.head_dim:
            q_rot, k_rot = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
        extra = {} if rows is None else {"rows": rows}
        out = current_attention()(self.layer_id, q_rot, k_rot, v, **extra)
        return self.o_proj(out.reshape(out.shape[0], hq * self.head_dim))


class Glm4MoeForCausalLM(DecoderLM):
    """GLM-4.5 on the shared decoder; the RoPE tables cover the rotary part of a head only."""

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(replace(cfg, head_dim=Glm4MoeConfig.of(cfg).rotary_dim))

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo,
                   ep: EPInfo) -> DecoderLayer:
        if layer in cfg.moe_layers:
            mlp = GroupedTopKMoE(cfg, Glm4MoeConfig.of(cfg).routing, ep, ffn_tp)
        else:
            mlp = GatedMLP(cfg, ffn_tp)
        return DecoderLayer(cfg, PartialRotaryAttention(cfg, layer, self.rotary, tp), mlp)

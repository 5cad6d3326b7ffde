"""Hybrid linear-attention causal LMs, HF weight names: Qwen3-Next, Qwen3.5 text, Qwen3.5-MoE text.

Layers are Gated DeltaNet (``linear_attn``, graphcp/models/gated_deltanet.py) or gated full
attention (``self_attn``: q_proj doubled into per-head query and output gate, zero-centred q/k
norms, rotary on the first ``rotary_dim`` of each head), as ``layer_types`` says. FFNs are dense or
MoE with a shared expert behind a sigmoid gate. Norms are zero-centred: x_norm * (1 + weight).

The decoder loop, the LM head and pipeline stages are the shared decoder's
(``models/decoder.py``). Attention TP splits the heads of both mixers: the full-attention q/gate,
k, v by head, the Gated DeltaNet layers by key head (``gated_deltanet.py``).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo, kv_head_range
from graphcp.forward_context import current_attention, current_moe_communicator
from graphcp.models.common.decoder import DecoderLM
from graphcp.models.common.layers import RotaryEmbedding
from graphcp.models.common.linear import ColumnLinear, Linear, RowLinear
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.common.moe import Experts, SoftmaxTopKRouter
from graphcp.models.config import ModelConfig
from graphcp.models.qwen3_next.config import LINEAR, HybridConfig
from graphcp.models.qwen3_next.gated_deltanet import GatedDeltaNet


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: fp32 statistics times (1 + weight), then back to the input dtype. With
    ``residual``: (norm(x + residual), x + residual), as graphcp's RMSNorm."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        total = x if residual is None else residual + x
        xf = total.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
               * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, total)


class GatedAttention(nn.Module):
    """Full attention with an output gate: attention(q, k, v) * sigmoid(gate) -> o_proj."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 tp: TPInfo) -> None:
        super().__init__()
        d, bias = cfg.head_dim, cfg.qkv_bias
        self.layer_id, self.head_dim = layer_id, d
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.kv_heads_per_rank(tp.size)
        self.rotary_dim = HybridConfig.of(cfg).rotary_dim
        first, last = kv_head_range(cfg.num_key_value_heads, tp.size, tp.rank)
        kv_rows = (first * d, last * d)         # a replicated head where TP exceeds the KV heads
        # per head: q then its gate, so whole heads are 2 * head_dim rows
        self.q_proj = ColumnLinear(cfg.hidden_size, 2 * cfg.q_size, bias, tp, unit=2 * d)
        self.k_proj = ColumnLinear(cfg.hidden_size, cfg.kv_size, bias, tp, rows=kv_rows)
        self.v_proj = ColumnLinear(cfg.hidden_size, cfg.kv_size, bias, tp, rows=kv_rows)
        self.o_proj = RowLinear(cfg.q_size, cfg.hidden_size, tp, unit=d, bias=cfg.o_bias)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.rotary = [rotary]      # shared, not a submodule

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, d, r = x.shape[0], self.head_dim, self.rotary_dim
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * d).split(d, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        q_rot, k_rot = self.rotary[0](positions, q[..., :r], k[..., :r])
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
        out = current_attention()(self.layer_id, q, k, v)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class SharedExpertMoE(nn.Module):
    """Routed experts (Qwen3-MoE's router and experts) plus a dense shared expert scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, ep: EPInfo, ffn_tp: TPInfo) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(cfg)
        self.experts = Experts(cfg, ep)
        shared = replace(cfg, intermediate_size=HybridConfig.of(cfg).shared_expert_intermediate_size,
                         mlp_bias=False)
        self.shared_expert = GatedMLP(shared, ffn_tp)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def fuse(self) -> None:
        self.shared_expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = current_moe_communicator().run(x, self.gate, self.experts)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class HybridDecoderLayer(nn.Module):
    """The shared decoder's layer contract (``forward(positions, delta, residual)``, ``fuse``) with
    zero-centred norms and the mixer under its HF name: ``linear_attn`` or ``self_attn``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo,
                 ffn_tp: TPInfo, ep: EPInfo) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if HybridConfig.of(cfg).layer_types[layer_id] == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, layer_id, tp)
        else:
            self.self_attn = GatedAttention(cfg, layer_id, rotary, tp)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = layer_id in cfg.moe_layers
        self.mlp = SharedExpertMoE(cfg, ep, ffn_tp) if moe else GatedMLP(cfg, ffn_tp)

    def forward(self, positions: torch.Tensor, delta: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = delta, self.input_layernorm(delta)
        else:
            x, residual = self.input_layernorm(delta, residual)
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x, residual = self.post_attention_layernorm(mixer(positions, x), residual)
        return self.mlp(x), residual

    def fuse(self) -> None:
        """The FFN's gate/up become one GEMM; the mixers' projections stay apart."""
        self.mlp.fuse()


class Qwen3NextForCausalLM(DecoderLM):
    """The hybrid family on the shared decoder (``models/decoder.py``), final norm zero-centred."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        super().__init__(cfg, tp, layers, ffn_tp, ep)
        if self.is_last:
            self.model.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(replace(cfg, head_dim=HybridConfig.of(cfg).rotary_dim))

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo,
                   ep: EPInfo) -> HybridDecoderLayer:
        return HybridDecoderLayer(cfg, layer, self.rotary, tp, ffn_tp, ep)

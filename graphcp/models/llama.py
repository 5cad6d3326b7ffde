"""Llama-family causal LM (Llama with optional attention/MLP biases, Mistral, Qwen2 with qkv bias, Qwen3 with
q/k norm and optional attention bias, Qwen3-MoE: Qwen3 attention with MoE blocks), HF weight names.

Heads and the vocabulary are split over the attention TP group (``tp``), MLP features over the FFN TP
group (``ffn_tp``, the whole TP world); a pipeline stage builds only its layers (``layers``), the first
stage the embedding, the last the norm and LM head.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from graphcp.forward_context import current_attention, current_communicator
from graphcp.models import fp8
from graphcp.models.config import ModelConfig
from graphcp.models.layers import RMSNorm, RotaryEmbedding
from graphcp.models.moe import EPInfo, MoEBlock
from graphcp.models.parallel import ColumnLinear, RowLinear, TPInfo, VocabEmbedding, vocab_logits


def _fuse(linears: tuple[nn.Linear, ...]) -> tuple:
    """Concatenate the output rows of ``linears``; each keeps its parameter as a view (no extra memory)."""
    if fp8.is_fp8(linears[0]):                       # FP8 kept for the GEMM: weights and block scales
        return fp8.fuse(linears)
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    sizes, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        sizes.append(n)
        start += n
    return weight, bias, sizes


def _fused_linear(x: torch.Tensor, fused: tuple | None) -> tuple[torch.Tensor, ...]:
    if fused is None:
        raise RuntimeError("projections are not fused: call CausalLM.fuse_projections() after loading weights")
    weight, bias, sizes = fused
    return fp8.linear(x, weight, bias).split(sizes, dim=-1)      # F.linear, or the FP8 GEMM


class SelfAttention(nn.Module):
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
        """One GEMM for q, k and v: their loaded weights become views of one concatenated tensor."""
        self.qkv = _fuse((self.q_proj, self.k_proj, self.v_proj))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = _fused_linear(x, self.qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = current_attention()(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """Dense FFN, split over the FFN TP group; the layer communicator brings it the tokens it serves."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo) -> None:
        super().__init__()
        self.gate_proj = ColumnLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.up_proj = ColumnLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias)
        self.gate_up: tuple | None = None

    def fuse(self) -> None:
        self.gate_up = _fuse((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = current_communicator()
        rows = x.shape[0]
        x = comm.gather(x)
        gate, up = _fused_linear(x, self.gate_up)
        partial = self.down_proj(nn.functional.silu(gate) * up, reduce=False)
        out = comm.scatter(partial, rows)                   # reduce-scatter to this rank's rows
        return self.down_proj.reduce(partial) if out is None else self.down_proj.add_bias(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo,
                 ffn_tp: TPInfo, ep: EPInfo) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg, ep) if layer_id in cfg.moe_layers else GatedMLP(cfg, ffn_tp)

    def forward(self, positions: torch.Tensor, delta: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state is ``residual + delta`` (just ``delta`` before the first layer); each residual add
        happens inside the norm that follows it (one launch on CUDA). Returns (mlp output, residual)."""
        if residual is None:
            residual, x = delta, self.input_layernorm(delta)
        else:
            x, residual = self.input_layernorm(delta, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPInfo, layers: range, ffn_tp: TPInfo,
                 ep: EPInfo) -> None:
        super().__init__()
        first, last = layers.start == 0, layers.stop == cfg.num_hidden_layers
        if first:
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # Keyed by the global index, so names stay "model.layers.{i}.*" on every pipeline stage.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, rotary, tp, ffn_tp, ep) for i in layers})
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        super().__init__()
        tp = tp or TPInfo()
        self.config, self.tp = cfg, tp
        self.layer_range = layers if layers is not None else range(cfg.num_hidden_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_hidden_layers
        self.rotary = RotaryEmbedding(cfg)
        self.model = Backbone(cfg, self.rotary, tp, self.layer_range, ffn_tp or tp, ep or EPInfo())
        if self.is_last and not (cfg.tie_word_embeddings and self.is_first):
            # Untied, or tied on a last stage without the embedding: the head loads its own vocab shard.
            self.lm_head = ColumnLinear(cfg.hidden_size, cfg.vocab_size, False, tp)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden: torch.Tensor | None = None,
                capture_layers: Sequence[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, list]:
        """Residual stream for this rank's tokens after this stage's layers, before the final norm. With
        ``capture_layers`` (ids of this stage's layers), also the residual stream entering each of them, in
        that order (HF's ``hidden_states[i]``; speculative drafts read them)."""
        delta, residual = self.model.embed_tokens(input_ids) if self.is_first else hidden, None
        captured = {}
        for i, layer in self.model.layers.items():
            if capture_layers is not None and int(i) in capture_layers:
                captured[int(i)] = delta if residual is None else residual + delta
            delta, residual = layer(positions, delta, residual)
        out = delta if residual is None else residual + delta
        return out if capture_layers is None else (out, [captured[i] for i in capture_layers])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (last stage), applied only to the rows that need logits."""
        head = self.lm_head if hasattr(self, "lm_head") else self.model.embed_tokens
        return vocab_logits(self.model.norm(hidden), head.weight, self.tp, self.config.vocab_size).float()

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up each become one GEMM (fewer launches, larger tiles)."""
        for layer in self.model.layers.values():
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def source_name(self, name: str) -> str:
        """The checkpoint tensor a parameter loads from (a tied head reads the embedding)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

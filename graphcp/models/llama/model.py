"""Llama-family causal LM (Llama with optional attention/MLP biases, Mistral, Qwen2 with qkv bias, Qwen3 with
q/k norm and optional attention bias, Qwen3-MoE: Qwen3 attention with MoE blocks), HF weight names, on the
shared decoder (``models/common/decoder.py``). Heads are split over the attention TP group, MLP features over the
FFN TP group.
"""
from __future__ import annotations

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.models.common.attention import GQAAttention
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.layers import RotaryEmbedding
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.common.moe import MoEBlock
from graphcp.models.config import ModelConfig


class LlamaForCausalLM(DecoderLM):
    """The llama family on the shared decoder: q/k/v attention with RoPE, a dense or MoE FFN per layer."""

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo, ep: EPInfo) -> DecoderLayer:
        mlp = MoEBlock(cfg, ep) if layer in cfg.moe_layers else GatedMLP(cfg, ffn_tp)
        return DecoderLayer(cfg, GQAAttention(cfg, layer, self.rotary, tp), mlp)

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

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.models.common.attention import GQAAttention
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.grouped_moe import GroupedTopKMoE
from graphcp.models.common.layers import RotaryEmbedding
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.config import ModelConfig
from graphcp.models.glm4_moe.config import Glm4MoeConfig


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
        attention = GQAAttention(cfg, layer, self.rotary, tp,
                                 rotary_dim=Glm4MoeConfig.of(cfg).rotary_dim)
        return DecoderLayer(cfg, attention, mlp)

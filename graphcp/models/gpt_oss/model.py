"""gpt-oss causal LM (``GptOssForCausalLM``), HF weight names, on the shared decoder: GQA with
q/k/v/o biases, YaRN RoPE and a learned sink logit per head, on sliding-window and full layers
alternately (the attention op knows which: ``ModelConfig.sliding_layers``); every FFN the MoE
block of ``moe.py``. Heads and their sinks are split over the attention TP group, experts over
the EP group."""
from __future__ import annotations

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.models.common.attention import GQAAttention
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.layers import RotaryEmbedding
from graphcp.models.config import ModelConfig
from graphcp.models.gpt_oss.moe import GptOssMoE


class GptOssForCausalLM(DecoderLM):
    """gpt-oss on the shared decoder: sink attention with RoPE, the MoE block on every layer."""

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo,
                   ep: EPInfo) -> DecoderLayer:
        attention = GQAAttention(cfg, layer, self.rotary, tp, sinks=True)
        return DecoderLayer(cfg, attention, GptOssMoE(cfg, layer, ep))

"""MLA causal LMs: DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``), and the DSA ones, DeepSeek
V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``), HF weight names, on the shared
decoder (``models/decoder.py``): MLA attention, with the lightning indexer for DSA (``models/mla.py``),
a dense FFN on the first layers and the grouped top-k MoE (``models/common/grouped_moe.py``) on
the others. Heads and the vocabulary split over attention TP; the dense FFN and the experts over the
TP world / EP as for the llama family.
"""
from __future__ import annotations

import torch

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.grouped_moe import GroupedRouting, GroupedTopKMoE
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.attention import MLAttention
from graphcp.models.deepseek.config import MLAConfig
from graphcp.models.deepseek.rope import DSARotary


class MLAForCausalLM(DecoderLM):
    """One pipeline stage holding every layer."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        if layers is not None and len(layers) != cfg.num_hidden_layers:
            raise ValueError("MLA models run on one pipeline stage")
        super().__init__(cfg, tp, None, ffn_tp, ep)

    def make_rotary(self, cfg: ModelConfig) -> DSARotary:
        return DSARotary(cfg)        # over qk_rope_head_dim (the config's head_dim)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo, ep: EPInfo) -> DecoderLayer:
        if layer in cfg.moe_layers:
            d = MLAConfig.of(cfg)
            routing = GroupedRouting(d.n_group, d.topk_group, d.routed_scaling_factor,
                                     d.n_shared_experts)
            mlp = GroupedTopKMoE(cfg, routing, ep, ffn_tp)
        else:
            mlp = GatedMLP(cfg, ffn_tp)
        return DecoderLayer(cfg, MLAttention(cfg, layer, tp), mlp)

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables at this rank's positions, gathered once for every layer."""
        cos = self.rotary.cos.index_select(0, positions).to(dtype)
        sin = self.rotary.sin.index_select(0, positions).to(dtype)
        return cos, sin

"""DSA causal LMs: DeepSeek V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``), HF
weight names, on the shared decoder (``models/decoder.py``): MLA + lightning indexer attention
(``models/mla.py``), a dense FFN on the first layers and DeepSeek MoE on the others. Attention is not split
over TP (DSA needs attention TP 1); the dense FFN and the experts split over the TP world / EP as for the
llama family.
"""
from __future__ import annotations

import torch

from graphcp.models.config import ModelConfig
from graphcp.models.decoder import DecoderLayer, DecoderLM
from graphcp.models.deepseek_moe import DeepseekMoE
from graphcp.models.dsa_rope import DSARotary
from graphcp.models.llama import GatedMLP
from graphcp.models.mla import MLAttention
from graphcp.models.moe import EPInfo
from graphcp.models.parallel import TPInfo


class DSACausalLM(DecoderLM):
    """One pipeline stage holding every layer, attention TP 1."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        split_stage = layers is not None and len(layers) != cfg.num_hidden_layers
        if (tp is not None and tp.size > 1) or split_stage:
            raise ValueError("DSA models run with attention TP 1 and one pipeline stage")
        super().__init__(cfg, TPInfo(), None, ffn_tp, ep)

    def make_rotary(self, cfg: ModelConfig) -> DSARotary:
        return DSARotary(cfg)        # over qk_rope_head_dim (the config's head_dim)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo, ep: EPInfo) -> DecoderLayer:
        mlp = DeepseekMoE(cfg, ep, ffn_tp) if layer in cfg.moe_layers else GatedMLP(cfg, ffn_tp)
        return DecoderLayer(cfg, MLAttention(cfg, layer), mlp)

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables at this rank's positions, gathered once for every layer."""
        cos = self.rotary.cos.index_select(0, positions).to(dtype)
        sin = self.rotary.sin.index_select(0, positions).to(dtype)
        return cos, sin

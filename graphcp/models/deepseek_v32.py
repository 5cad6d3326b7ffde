"""DSA causal LMs: DeepSeek V3.2 (``DeepseekV32ForCausalLM``) and GLM-5
(``GlmMoeDsaForCausalLM``), HF weight names. MLA + lightning indexer attention (``models/mla.py``),
dense FFN on the first layers and DeepSeek MoE on the others. Attention is not split over TP (DSA
needs attention TP 1); the dense FFN and the experts split over the TP world / EP as for the llama
family.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_moe import DeepseekMoE
from graphcp.models.dsa_rope import DSARotary
from graphcp.models.layers import RMSNorm
from graphcp.models.llama import GatedMLP
from graphcp.models.mla import MLAttention
from graphcp.models.moe import EPInfo
from graphcp.models.parallel import TPInfo, VocabEmbedding, vocab_logits


class DSADecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ffn_tp: TPInfo, ep: EPInfo) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = layer_id in cfg.moe_layers
        self.mlp = DeepseekMoE(cfg, ep, ffn_tp) if moe else GatedMLP(cfg, ffn_tp)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, delta: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As the llama layer: the residual add happens inside the norm that follows it."""
        if residual is None:
            residual, x = delta, self.input_layernorm(delta)
        else:
            x, residual = self.input_layernorm(delta, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(cos, sin, x), residual)
        return self.mlp(x), residual


class DSABackbone(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_tp: TPInfo, ep: EPInfo) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, TPInfo())
        self.layers = nn.ModuleDict({str(i): DSADecoderLayer(cfg, i, ffn_tp, ep)
                                     for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DSACausalLM(nn.Module):
    """The interface of ``llama.CausalLM`` (forward, compute_logits, fuse_projections, source_name);
    one pipeline stage holding every layer."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        super().__init__()
        split_stage = layers is not None and len(layers) != cfg.num_hidden_layers
        if (tp is not None and tp.size > 1) or split_stage:
            raise ValueError("DSA models run with attention TP 1 and one pipeline stage")
        self.config, self.tp = cfg, TPInfo()
        self.layer_range, self.is_first, self.is_last = range(cfg.num_hidden_layers), True, True
        self.rotary = DSARotary(cfg)        # over qk_rope_head_dim (the config's head_dim)
        self.model = DSABackbone(cfg, ffn_tp or TPInfo(), ep or EPInfo())
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden: torch.Tensor | None = None,
                capture_layers: Sequence[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, list]:
        """Residual stream for this rank's tokens after every layer, before the final norm. With
        ``capture_layers``, also the residual stream entering each of those layers (HF's
        ``hidden_states[i]``), as the llama family does."""
        cos = self.rotary.cos.index_select(0, positions)
        sin = self.rotary.sin.index_select(0, positions)
        delta, residual = self.model.embed_tokens(input_ids) if hidden is None else hidden, None
        cos, sin = cos.to(delta.dtype), sin.to(delta.dtype)
        captured = {}
        for i, layer in self.model.layers.items():
            if capture_layers is not None and int(i) in capture_layers:
                captured[int(i)] = delta if residual is None else residual + delta
            delta, residual = layer(cos, sin, delta, residual)
        out = residual + delta
        return out if capture_layers is None else (out, [captured[i] for i in capture_layers])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if hasattr(self, "lm_head") else self.model.embed_tokens
        logits = vocab_logits(self.model.norm(hidden), head.weight, self.tp, self.config.vocab_size)
        return logits.float()

    def fuse_projections(self) -> None:
        for layer in self.model.layers.values():
            layer.mlp.fuse()

    def source_name(self, name: str) -> str:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

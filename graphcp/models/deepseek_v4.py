"""DeepSeek V4 causal LM (``DeepseekV4ForCausalLM``), transformers' module names (checkpoints in
DeepSeek's names load through ``deepseek_v4_names``): hyper-connected decoder layers, each V4
attention (sliding, CSA or HCA, ``deepseek_v4_attention``) and a V4 MoE (``hash_moe``), then the
hyper head, the norm and the LM head. One pipeline stage, attention TP 1; the experts split over EP
through the MoE communicator."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_v4_attention import V4Attention
from graphcp.models.deepseek_v4_config import SLIDING
from graphcp.models.deepseek_v4_rope import V4Rotary, V4RMSNorm
from graphcp.models.hash_moe import V4MoE
from graphcp.models.hyper_connections import HyperConnection, HyperHead
from graphcp.models.moe import EPInfo
from graphcp.models.parallel import TPInfo


class V4Rotaries:
    """The two rotaries ("main" on sliding layers, "compress" elsewhere), built after loading."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.main, self.compress = V4Rotary(cfg.v4.main_rope), V4Rotary(cfg.v4.compress_rope)

    def build(self, device: torch.device) -> None:
        self.main.build(device)
        self.compress.build(device)


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotaries: V4Rotaries, ep: EPInfo) -> None:
        super().__init__()
        v4 = cfg.v4
        self.sliding = v4.layer_types[layer_id] == SLIDING
        self.self_attn = V4Attention(cfg, layer_id, rotaries.compress)     # its compressors' rotary
        self.mlp = V4MoE(cfg, layer_id, ep)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor,
                ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the same after attention and MoE. ``ropes``: cos/sin of
        the main (True) and compress (False) rotaries at this forward's positions."""
        cos, sin = ropes[self.sliding]
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), cos, sin)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), token_ids)
        return HyperConnection.merge(streams, out, post, comb)


class V4Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotaries: V4Rotaries, ep: EPInfo) -> None:
        super().__init__()
        v4 = cfg.v4
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): V4DecoderLayer(cfg, i, rotaries, ep)
                                     for i in range(cfg.num_hidden_layers)})
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, v4.hc_mult, v4.hc_eps, cfg.rms_norm_eps)


class DeepseekV4CausalLM(nn.Module):
    """The interface of ``llama.CausalLM`` (forward, compute_logits, fuse_projections,
    source_name); one pipeline stage holding every layer."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        super().__init__()
        split_stage = layers is not None and len(layers) != cfg.num_hidden_layers
        if (tp is not None and tp.size > 1) or split_stage:
            raise ValueError("DeepSeek V4 runs with attention TP 1 and one pipeline stage")
        self.config, self.tp = cfg, TPInfo()
        self.layer_range, self.is_first, self.is_last = range(cfg.num_hidden_layers), True, True
        self.rotary = V4Rotaries(cfg)
        self.model = V4Backbone(cfg, self.rotary, ep or EPInfo())
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden: torch.Tensor | None = None,
                capture_layers: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's tokens -> their hidden state after the hyper head, before the final norm
        (the hyper head is per token, so logits rows can be picked from it); with
        ``capture_layers`` (none: the engine refuses aux layers for V4) also the empty list."""
        if input_ids is None or hidden is not None or capture_layers:
            raise ValueError("DeepSeek V4 runs as one stage from token ids, without captured "
                             "layers")
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.v4.hc_mult, -1).contiguous()
        ropes = {True: self.rotary.main(positions, x.dtype),
                 False: self.rotary.compress(positions, x.dtype)}
        for layer in self.model.layers.values():
            streams = layer(streams, input_ids, ropes)
        out = self.model.hc_head(streams)
        return out if capture_layers is None else (out, [])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if hasattr(self, "lm_head") else self.model.embed_tokens
        return nn.functional.linear(self.model.norm(hidden), head.weight).float()

    def fuse_projections(self) -> None:
        """Nothing to fuse; checks the hash-routing tables once their values are loaded."""
        for layer in self.model.layers.values():
            layer.mlp.gate.check_table(self.config.num_experts)

    def source_name(self, name: str) -> str:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

"""DeepSeek V4 causal LM (``DeepseekV4ForCausalLM``), transformers' module names (checkpoints in
DeepSeek's names load through ``deepseek_v4_names``): hyper-connected decoder layers, each V4
attention (sliding, CSA or HCA, ``deepseek_v4_attention``) and a V4 MoE (``hash_moe``), then the
hyper head, the norm and the LM head. One pipeline stage, attention TP 1; the experts split over EP
through the MoE communicator."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.models.common.decoder import DecoderLM
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_v4.attention import V4Attention
from graphcp.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from graphcp.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead
from graphcp.models.deepseek_v4.moe import V4MoE
from graphcp.models.deepseek_v4.rope import V4RMSNorm, V4Rotary


class V4Rotaries:
    """The two rotaries ("main" on sliding layers, "compress" elsewhere), built after loading."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.main, self.compress = V4Rotary(DeepseekV4Config.of(cfg).main_rope), V4Rotary(
            DeepseekV4Config.of(cfg).compress_rope)

    def build(self, device: torch.device) -> None:
        self.main.build(device)
        self.compress.build(device)


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotaries: V4Rotaries, ep: EPInfo) -> None:
        super().__init__()
        v4 = DeepseekV4Config.of(cfg)
        self.sliding = v4.layer_types[layer_id] == SLIDING
        self.self_attn = V4Attention(cfg, layer_id, rotaries.compress)     # its compressors' rotary
        self.mlp = V4MoE(cfg, layer_id, ep)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.experts = cfg.num_experts

    def forward(self, inputs: tuple[torch.Tensor, dict],
                streams: torch.Tensor) -> tuple[torch.Tensor]:
        """streams [T, hc_mult, hidden] -> the same after attention and MoE. ``inputs``: the token ids
        and the cos/sin of the main (True) and compress (False) rotaries at this forward's positions."""
        token_ids, ropes = inputs
        cos, sin = ropes[self.sliding]
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), cos, sin)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), token_ids)
        return (HyperConnection.merge(streams, out, post, comb),)

    def fuse(self) -> None:
        """Nothing to fuse; checks the hash-routing table once its values are loaded."""
        self.mlp.gate.check_table(self.experts)


class DeepseekV4ForCausalLM(DecoderLM):
    """On the shared decoder: the stream from layer to layer is the hyper-connection streams
    [T, hc_mult, hidden], entered by copying the embedding, left through the hyper head. One pipeline
    stage, attention TP 1; every layer takes the token ids (hash routing) and both rotaries."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        split_stage = layers is not None and len(layers) != cfg.num_hidden_layers
        if (tp is not None and tp.size > 1) or split_stage:
            raise ValueError("DeepSeek V4 runs with attention TP 1 and one pipeline stage")
        super().__init__(cfg, TPInfo(), None, ffn_tp, ep)
        v4 = DeepseekV4Config.of(cfg)
        self.model.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.model.hc_head = HyperHead(cfg.hidden_size, v4.hc_mult, v4.hc_eps, cfg.rms_norm_eps)

    def make_rotary(self, cfg: ModelConfig) -> V4Rotaries:
        return V4Rotaries(cfg)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo,
                   ep: EPInfo) -> V4DecoderLayer:
        return V4DecoderLayer(cfg, layer, self.rotary, ep)

    def layer_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        if input_ids is None:
            raise ValueError("DeepSeek V4 runs as one stage from token ids")
        ropes = {True: self.rotary.main(positions, dtype), False: self.rotary.compress(positions, dtype)}
        return input_ids, ropes

    def enter(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden.unsqueeze(1).expand(-1, DeepseekV4Config.of(self.config).hc_mult, -1).contiguous(),)

    def stream(self, state: tuple) -> torch.Tensor:
        raise ValueError("DeepSeek V4 returns no aux hidden states (the engine refuses them)")

    def leave(self, state: tuple) -> torch.Tensor:
        """The hyper head is per token, so logits rows can be picked from its output."""
        return self.model.hc_head(state[0])

"""gpt-oss causal LM (``GptOssForCausalLM``), HF weight names, on the shared decoder: GQA with
q/k/v/o biases, YaRN RoPE and a learned sink logit per head, on sliding-window and full layers
alternately (the attention op knows which: ``ModelConfig.sliding_layers``); every FFN the MoE
block of ``moe.py``. Heads and their sinks are split over the attention TP group, experts over
the EP group."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo, shard_range
from graphcp.forward_context import current_attention
from graphcp.models.common.decoder import DecoderLayer, DecoderLM
from graphcp.models.common.layers import RotaryEmbedding
from graphcp.models.common.linear import ColumnLinear, RowLinear, fused_linear
from graphcp.models.common.quantized import fuse
from graphcp.models.config import ModelConfig
from graphcp.models.gpt_oss.moe import GptOssMoE


class SinkAttention(nn.Module):
    """Attention whose softmax also counts one learned logit per head (its sink), which takes a
    share of the weight and no value."""

    keeps_rows = True       # can compute some rows' outputs only (DecoderLM.prunes_last_layer)
    fused_projections = (("q_proj", "k_proj", "v_proj"),)      # laid out back to back at load
    fp32_tensors = ("sinks",)

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 tp: TPInfo) -> None:
        super().__init__()
        self.layer_id, self.head_dim = layer_id, cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        d, hidden = cfg.head_dim, cfg.hidden_size
        self.q_proj = ColumnLinear(hidden, cfg.q_size, cfg.qkv_bias, tp, unit=d)
        self.k_proj = ColumnLinear(hidden, cfg.kv_size, cfg.qkv_bias, tp, unit=d)
        self.v_proj = ColumnLinear(hidden, cfg.kv_size, cfg.qkv_bias, tp, unit=d)
        self.o_proj = RowLinear(cfg.q_size, hidden, tp, unit=d, bias=cfg.o_bias)
        # this rank's heads' sinks (the heads q_proj's shard holds)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.tensor_shards = {"sinks": (0, *shard_range(cfg.num_attention_heads, tp.size,
                                                         tp.rank))}
        self.rotary = [rotary]  # shared, not a submodule: kept out of the state dict
        self.qkv: tuple | None = None           # (weight, bias, split sizes) after fuse()

    def fuse(self) -> None:
        """One GEMM for q, k and v (their weights are views of it)."""
        self.qkv = fuse((self.q_proj, self.k_proj, self.v_proj))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: only those tokens' outputs are wanted (every token's K/V is still cached)."""
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        heads = fused_linear(x, self.qkv).view(t, hq + 2 * hk, d)
        qk = self.rotary[0].rotate(positions, heads[:, :hq + hk])   # q's and k's heads, one pass
        q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hk:]
        extra = {} if rows is None else {"rows": rows}
        out = current_attention()(self.layer_id, q, k, v, sinks=self.sinks, **extra)
        return self.o_proj(out.reshape(out.shape[0], hq * d))


class GptOssForCausalLM(DecoderLM):
    """gpt-oss on the shared decoder: sink attention with RoPE, the MoE block on every layer."""

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg)

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo,
                   ep: EPInfo) -> DecoderLayer:
        attention = SinkAttention(cfg, layer, self.rotary, tp)
        return DecoderLayer(cfg, attention, GptOssMoE(cfg, layer, ep))

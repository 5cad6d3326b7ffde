"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5, HF weight names.

Projections give, per token, the q|k|v conv inputs, the output gate z and the per-value-head b
(beta = sigmoid(b)) and a (log decay g = -exp(A_log) * softplus(a + dt_bias)). The forward context's
attention op for this layer (graphcp/attention/linear_op.py, linear_cp.py under CP) runs the conv
and the delta rule over the sequence with the request's states; the layer then applies the gated
RMSNorm and out_proj.

Qwen3-Next packs in_proj_qkvz and in_proj_ba per key head ([q, k, v-group, z-group] for each key
head); Qwen3.5 keeps four projections with q, k and v side by side. The conv channels are q|k|v
either way. Under attention TP a rank holds whole key heads with their value heads: a slice of
each section (q|k|v split three ways for Qwen3.5's in_proj_qkv and for the conv, one range of the
packed projections), out_proj row-split and all-reduced.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from graphcp.distributed.shards import TPInfo, section_pieces, shard_range
from graphcp.forward_context import current_attention
from graphcp.kernels.delta_rule_torch import l2norm
from graphcp.models.common.linear import ColumnLinear, RowLinear, SectionColumnLinear
from graphcp.models.config import ModelConfig
from graphcp.models.qwen3_next.config import HybridConfig


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then times silu(gate): statistics and gate in fp32, the
    weight applied in the input dtype, as HF's Qwen3NextRMSNormGated."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One attention-TP rank's heads (``tp``): whole key heads, each with the value heads it serves
    (value head j reads key head j // group, as HF's repeat_interleave), so the rank's q, k, v, z,
    b, a, conv channels, A_log and dt_bias are one slice per section and out_proj is row-split."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo) -> None:
        super().__init__()
        full = HybridConfig.of(cfg)
        h = full.per_rank(tp.size)
        self.layer_id, self.cfg = layer_id, h
        hidden, dk, dv = cfg.hidden_size, h.head_k_dim, h.head_v_dim
        group = h.num_v_heads // h.num_k_heads
        # The conv channels q|k|v, each split by key head (v by its key head's value heads).
        channels = ((full.key_dim, dk), (full.key_dim, dk), (full.value_dim, group * dv))
        if h.split_projections:
            self.in_proj_qkv = SectionColumnLinear(hidden, channels, tp)
            self.in_proj_z = ColumnLinear(hidden, full.value_dim, False, tp, unit=group * dv)
            self.in_proj_b = ColumnLinear(hidden, full.num_v_heads, False, tp, unit=group)
            self.in_proj_a = ColumnLinear(hidden, full.num_v_heads, False, tp, unit=group)
        else:       # packed per key head: [q, k, v-group, z-group], then [b-group, a-group]
            self.in_proj_qkvz = ColumnLinear(hidden, 2 * full.key_dim + 2 * full.value_dim, False,
                                             tp, unit=2 * dk + 2 * group * dv)
            self.in_proj_ba = ColumnLinear(hidden, 2 * full.num_v_heads, False, tp, unit=2 * group)
        # Only its weight [conv_dim, 1, kernel] is used: the op runs the conv with each window.
        self.conv1d = nn.Conv1d(h.conv_dim, h.conv_dim, h.conv_kernel, groups=h.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(h.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(h.num_v_heads), requires_grad=False)
        heads = (0, *shard_range(full.num_v_heads, tp.size, tp.rank, group))
        self.tensor_shards = {"conv1d.weight": section_pieces(channels, tp.size, tp.rank),
                              "dt_bias": heads, "A_log": heads}
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)     # one weight for every head
        self.out_proj = RowLinear(full.value_dim, hidden, tp, unit=group * dv)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, H] -> (q|k|v conv inputs [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        h, t = self.cfg, x.shape[0]
        if h.split_projections:
            z = self.in_proj_z(x).view(t, h.num_v_heads, h.head_v_dim)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
            return self.in_proj_qkv(x), z, b, a
        group = h.num_v_heads // h.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, h.num_k_heads, -1)
        q, k, v, z = qkvz.split([h.head_k_dim, h.head_k_dim, group * h.head_v_dim,
                                 group * h.head_v_dim], -1)
        b, a = self.in_proj_ba(x).view(t, h.num_k_heads, 2 * group).split(group, -1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        return (mixed, z.reshape(t, h.num_v_heads, h.head_v_dim), b.reshape(t, -1),
                a.reshape(t, -1))

    def heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[S, T, conv_dim] -> q, k [S, T, Hv, dk] (l2-normalised fp32), v [S, T, Hv, dv]."""
        h = self.cfg
        s, t = conv_out.shape[:2]
        q, k, v = conv_out.split([h.key_dim, h.key_dim, h.value_dim], -1)
        group = h.num_v_heads // h.num_k_heads
        q, k = (l2norm(x.reshape(s, t, h.num_k_heads, h.head_k_dim).float()) for x in (q, k))
        if group > 1:       # each key head serves ``group`` consecutive value heads
            q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        return q, k, v.reshape(s, t, h.num_v_heads, h.head_v_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = current_attention()(self.layer_id, mixed, g, beta, mixer=self).to(x.dtype)
        out = self.norm(core.reshape(-1, self.cfg.head_v_dim), z.reshape(-1, self.cfg.head_v_dim))
        return self.out_proj(out.reshape(x.shape[0], -1))

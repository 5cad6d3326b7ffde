"""The MoE block of the DeepSeek lineage (DeepSeek-V3 / V3.2, Kimi-K2, GLM-5, GLM-4.5 / 4.6 / 4.7):
a grouped top-k sigmoid router over the routed experts plus always-on shared experts.

The routed experts reuse ``Experts`` and the forward context's MoE communicator (EP and the token
flows compose as for Qwen3-MoE); the shared experts are a dense gated MLP split like the dense FFN.
A family gives its routing values as a ``GroupedRouting``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.forward_context import current_moe_communicator
from graphcp.models.common.mlp import GatedMLP
from graphcp.models.common.moe import Experts
from graphcp.models.config import ModelConfig


@dataclass(frozen=True)
class GroupedRouting:
    """The router's grouping and scaling, and the shared experts' count (each as wide as a routed
    expert: ``n_shared_experts * moe_intermediate_size`` features)."""
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int


class GroupedTopKRouter(nn.Module):
    """Sigmoid scores; groups ranked by their two best scores (with the score-correction bias),
    experts chosen within the best ``topk_group`` groups; the weights are the unbiased scores,
    optionally renormalised, times ``routed_scaling_factor``. fp32 throughout; its weights stay fp32
    in a bf16 model, as HF keeps them."""

    keep_fp32 = True

    def __init__(self, cfg: ModelConfig, routing: GroupedRouting) -> None:
        super().__init__()
        experts = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts), requires_grad=False)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.groups, self.topk_group = routing.n_group, routing.topk_group
        self.scaling = routing.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k] int64)."""
        scores = torch.sigmoid(nn.functional.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(x.shape[0], self.groups, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best_groups, 1.0)
        choice = torch.where(keep[..., None] > 0, grouped, float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), ids


class GroupedTopKMoE(nn.Module):
    """Routed experts (grouped top-k) plus the shared experts, summed."""

    def __init__(self, cfg: ModelConfig, routing: GroupedRouting, ep: EPInfo,
                 ffn_tp: TPInfo) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(cfg, routing)
        self.experts = Experts(cfg, ep)
        shared = routing.n_shared_experts * cfg.moe_intermediate_size
        shared_cfg = replace(cfg, intermediate_size=shared, mlp_bias=False)
        self.shared_experts = GatedMLP(shared_cfg, ffn_tp) if shared else None

    def fuse(self) -> None:
        if self.shared_experts is not None:
            self.shared_experts.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = current_moe_communicator().run(x, self.gate, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)

"""DeepSeek's MoE block: a grouped top-k router over the routed experts plus always-on shared
experts.

The routed experts reuse graphcp's ``Experts`` and the forward context's MoE communicator (EP and
the token flows compose as for Qwen3-MoE); the shared experts are a dense gated MLP split like the
dense FFN.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from graphcp.forward_context import current_moe_communicator
from graphcp.models.config import ModelConfig
from graphcp.models.llama import GatedMLP
from graphcp.models.moe import EPInfo, Experts, GroupedTopKRouter
from graphcp.models.parallel import TPInfo


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ep: EPInfo, ffn_tp: TPInfo) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(cfg)
        self.experts = Experts(cfg, ep)
        shared = cfg.dsa.n_shared_experts * cfg.moe_intermediate_size
        shared_cfg = replace(cfg, intermediate_size=shared, mlp_bias=False)
        self.shared_experts = GatedMLP(shared_cfg, ffn_tp) if shared else None

    def fuse(self) -> None:
        if self.shared_experts is not None:
            self.shared_experts.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = current_moe_communicator().run(x, self.gate, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)

"""DeepSeek V4's MoE block, HF weight names: a router scoring every expert (sqrtsoftplus or
sigmoid), choosing the top-k by score plus correction bias or, on ``hash_moe`` layers, by a frozen
token-id table (``tid2eid``); SwiGLU experts and one shared expert, gate and up clamped to
``swiglu_limit``. The routed experts run through the forward context's MoE communicator, as
graphcp's other MoE blocks; on hash layers it carries each row's token id with the row
(``row_ids``), wherever the rows go under EP."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo
from graphcp.errors import ConfigError
from graphcp.forward_context import current_moe_communicator
from graphcp.kernels.moe_torch import GatedActivation
from graphcp.models.common.linear import Linear
from graphcp.models.common.moe import Experts
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_v4.config import DeepseekV4Config

_SCORES = {"sqrtsoftplus": lambda x: nn.functional.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


class V4Router(nn.Module):
    """-> (weights [N, k], expert ids [N, k]): the chosen experts' scores renormalised, times
    ``routed_scaling_factor``."""

    fp32_tensors = ("e_score_correction_bias",)

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        v4, experts = DeepseekV4Config.of(cfg), cfg.num_experts
        self.hashed, self.top_k = hashed, cfg.num_experts_per_tok
        self.scaling = v4.routed_scaling_factor
        self.score = _SCORES[v4.scoring_func]
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size), requires_grad=False)
        if hashed:
            table = torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long)
            self.register_buffer("tid2eid", table)
            self.fp32_tensors = ()
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def check_table(self, num_experts: int) -> None:
        if self.hashed and not bool(((self.tid2eid >= 0) & (self.tid2eid < num_experts)).all()):
            raise ConfigError("--model-path: a tid2eid table names experts outside "
                              f"0..{num_experts - 1}")

    def forward(self, x: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden]; token_ids [N] (hash layers: the token of each row, which the MoE
        communicator carries with the rows)."""
        scores = self.score(nn.functional.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid[token_ids]
        else:
            choice = scores + self.e_score_correction_bias
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class ClampedExperts(Experts):
    """graphcp's fused experts with V4's clamped SwiGLU: the grouped GEMMs take the clamp as their
    gating, so only routed (row, expert) pairs are computed on CUDA."""

    def __init__(self, cfg: ModelConfig, ep: EPInfo) -> None:
        super().__init__(cfg, ep)
        self.activation = GatedActivation(limit=DeepseekV4Config.of(cfg).swiglu_limit)


class ClampedMLP(nn.Module):
    """The shared expert, replicated on every rank (as transformers' TP plan keeps it)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.activation = GatedActivation(limit=DeepseekV4Config.of(cfg).swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))


class V4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ep: EPInfo) -> None:
        super().__init__()
        self.gate = V4Router(cfg, DeepseekV4Config.of(cfg).hash_layers[layer_id])
        self.experts = ClampedExperts(cfg, ep)
        self.shared_experts = ClampedMLP(cfg)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] and the token id of each row (hash layers route by it)."""
        row_ids = token_ids if self.gate.hashed else None
        routed = current_moe_communicator().run(x, self.gate, self.experts, row_ids=row_ids)
        return routed + self.shared_experts(x)

"""The sparse MoE block: a router picks top-k experts per token, gated SiLU experts run on them.

The block knows nothing about ranks: the forward context's MoE communicator moves tokens to the
experts (an all-gather / reduce-scatter, or an all-to-all dispatch and combine) and calls back into
the router and the experts. Each rank holds ``num_experts / ep`` experts, each split over the
expert-TP ranks along the intermediate dimension. The router is a separate small module so a
DeepSeek-style router (grouped top-k, score-correction bias, routed scaling) can sit beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphcp.forward_context import current_moe_communicator
from graphcp.models.config import ModelConfig
from graphcp.kernels.registry import chosen, probe_op
from graphcp.models.parallel import shard_range


@dataclass(frozen=True)
class EPInfo:
    """This rank's place for the experts: EP rank (which experts), expert-TP rank (which slice)."""
    ep_size: int = 1
    ep_rank: int = 0
    expert_tp_size: int = 1
    expert_tp_rank: int = 0


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE's router: softmax over all experts in fp32, top-k, optionally renormalised."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size),
                                   requires_grad=False)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k] int64)."""
        probs = torch.softmax(nn.functional.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class GroupedTopKRouter(nn.Module):
    """DeepSeek's router: sigmoid scores; groups ranked by their two best scores (with the
    score-correction bias), experts chosen within the best ``topk_group`` groups; the weights are
    the unbiased scores, optionally renormalised, times ``routed_scaling_factor``. fp32
    throughout; its weights stay fp32 in a bf16 model, as HF keeps them."""

    keep_fp32 = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.dsa
        experts = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts), requires_grad=False)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.groups, self.topk_group = d.n_group, d.topk_group
        self.scaling = d.routed_scaling_factor

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


class Experts(nn.Module):
    """This rank's experts, stored fused as transformers 5 keeps them: gate_up_proj
    [E_local, 2 I_local, H] (gate rows first), down_proj [E_local, H, I_local]. Checkpoints name
    them per expert (``experts.{e}.gate_proj.weight``) or fused; each rank reads only its experts
    and its expert-TP slice of them."""

    def __init__(self, cfg: ModelConfig, ep: EPInfo) -> None:
        super().__init__()
        per = cfg.num_experts // ep.ep_size
        self.first, self.num_local, self.num_experts = ep.ep_rank * per, per, cfg.num_experts
        self.inter = cfg.moe_intermediate_size
        self.slice = shard_range(cfg.moe_intermediate_size, ep.expert_tp_size, ep.expert_tp_rank)
        inter = self.slice[1] - self.slice[0]
        hidden = cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(per, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(per, hidden, inter), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's experts of weight x expert(x) for each (row, expert) pair of
        ``ids``; pairs routed to other ranks' experts add nothing. x [N, H], ids/weights [N, k]."""
        args = (x, ids, weights, self.gate_up_proj, self.down_proj, self.first)
        fn = chosen("moe_experts") if x.is_cuda else None
        if fn is not None:      # one grouped-GEMM launch per projection (accepted at engine start)
            return fn(*args)
        return _experts_torch(*args)

    def probe(self) -> None:
        """At engine start, eagerly: the Triton grouped GEMM once against the torch form on random
        routing; one that fails or disagrees is replaced by the torch form with a warning."""
        if not self.gate_up_proj.is_cuda:
            return
        gen = torch.Generator().manual_seed(0)
        n, k = 9, min(2, self.num_experts)
        x = torch.randn(n, self.gate_up_proj.shape[-1], generator=gen).to(self.gate_up_proj)
        ids = torch.randint(0, self.num_experts, (n, k), generator=gen).to(x.device)
        weights = torch.rand(n, k, generator=gen).to(x)
        args = (x, ids, weights, self.gate_up_proj, self.down_proj, self.first)
        probe_op("moe_experts", lambda fn: fn(*args), lambda: _experts_torch(*args), x.dtype)

    # -- loading ------------------------------------------------------------------------------
    def checkpoint_tensors(self, prefix: str, names: set[str], hidden: int) -> dict[str, tuple]:
        """Checkpoint tensors (name -> full shape) the experts load from: per expert or fused."""
        if f"{prefix}.gate_up_proj" in names:
            return {f"{prefix}.gate_up_proj": (self.num_experts, 2 * self.inter, hidden),
                    f"{prefix}.down_proj": (self.num_experts, hidden, self.inter)}
        out = {}
        for e in range(self.num_experts):
            out[f"{prefix}.{e}.gate_proj.weight"] = (self.inter, hidden)
            out[f"{prefix}.{e}.up_proj.weight"] = (self.inter, hidden)
            out[f"{prefix}.{e}.down_proj.weight"] = (hidden, self.inter)
        return out

    @torch.no_grad()
    def load(self, prefix: str, names: set[str], read, take) -> None:  # noqa: ANN001
        """Only this rank's slices leave the checkpoint: ``read(name, (dim, start, end))`` returns
        a shard of a per-expert weight (dequantized when it is FP8), ``take(name, index)`` returns
        ``tensor[index]`` of a fused one."""
        lo, hi = self.slice
        experts = slice(self.first, self.first + self.num_local)
        inter = hi - lo
        if f"{prefix}.gate_up_proj" in names:
            self.gate_up_proj[:, :inter] = take(f"{prefix}.gate_up_proj", (experts, slice(lo, hi)))
            up = slice(self.inter + lo, self.inter + hi)
            self.gate_up_proj[:, inter:] = take(f"{prefix}.gate_up_proj", (experts, up))
            self.down_proj.copy_(take(f"{prefix}.down_proj", (experts, slice(None), slice(lo, hi))))
            return
        for i in range(self.num_local):
            e = f"{prefix}.{self.first + i}"
            self.gate_up_proj[i, :inter] = read(f"{e}.gate_proj.weight", (0, lo, hi))
            self.gate_up_proj[i, inter:] = read(f"{e}.up_proj.weight", (0, lo, hi))
            self.down_proj[i] = read(f"{e}.down_proj.weight", (1, lo, hi))


def _experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, first: int) -> torch.Tensor:
    """The torch form (CPU, and the oracle of the Triton kernel): every local expert runs on every row,
    weighted by the row's routing weight for it (0 where it is not routed there). More arithmetic than
    gathering each expert's rows, but static shapes and no host sync, so it stays inside a graph."""
    local = ids - first
    inter = down.shape[-1]
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        w = (weights * (local == e).to(weights.dtype)).sum(-1, keepdim=True)        # [N, 1]
        h = nn.functional.linear(x, gate_up[e])
        out = out + nn.functional.linear(nn.functional.silu(h[:, :inter]) * h[:, inter:], down[e]) * w
    return out


class MoEBlock(nn.Module):
    """Router + experts; the forward context's MoE communicator decides where tokens meet them."""

    def __init__(self, cfg: ModelConfig, ep: EPInfo) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(cfg)
        self.experts = Experts(cfg, ep)

    def fuse(self) -> None:
        """Experts are stored fused already (one tensor per projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_moe_communicator().run(x, self.gate, self.experts)


def probe_experts(model: nn.Module) -> None:
    """Check the Triton grouped GEMM once on the model's first expert module (CUDA, engine start)."""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if experts is not None:
        experts.probe()

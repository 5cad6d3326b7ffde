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
from graphcp.graph.capture import graph_break
from graphcp.models.config import ModelConfig
from graphcp.models.layers import fused_or_torch
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

        def torch_form() -> torch.Tensor:
            return _experts_torch(x.new_empty(x.shape), *args)
        if x.is_cuda:   # one grouped-GEMM launch per projection, checked once against torch_form
            return fused_or_torch("moe_experts", lambda fn: fn(*args), torch_form)
        return torch_form()

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
    def load(self, prefix: str, names: set[str], read) -> None:  # noqa: ANN001
        """``read(name, index)`` returns ``tensor[index]`` from the checkpoint (only that slice)."""
        lo, hi = self.slice
        experts = slice(self.first, self.first + self.num_local)
        inter = hi - lo
        if f"{prefix}.gate_up_proj" in names:
            self.gate_up_proj[:, :inter] = read(f"{prefix}.gate_up_proj", (experts, slice(lo, hi)))
            up = slice(self.inter + lo, self.inter + hi)
            self.gate_up_proj[:, inter:] = read(f"{prefix}.gate_up_proj", (experts, up))
            self.down_proj.copy_(read(f"{prefix}.down_proj", (experts, slice(None), slice(lo, hi))))
            return
        for i in range(self.num_local):
            e = f"{prefix}.{self.first + i}"
            self.gate_up_proj[i, :inter] = read(f"{e}.gate_proj.weight", (slice(lo, hi),))
            self.gate_up_proj[i, inter:] = read(f"{e}.up_proj.weight", (slice(lo, hi),))
            self.down_proj[i] = read(f"{e}.down_proj.weight", (slice(None), slice(lo, hi)))


@graph_break
def _experts_torch(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, first: int) -> torch.Tensor:
    """The per-expert loop (the CPU form, and the oracle of the Triton kernel). Which rows each
    expert gets is known only on the host, so inside a graph this is a break."""
    out.zero_()
    local = ids - first
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        rows, slot = torch.where(local == e)
        if rows.numel() == 0:
            continue
        h = nn.functional.linear(x.index_select(0, rows), gate_up[e])
        y = nn.functional.linear(nn.functional.silu(h[:, :inter]) * h[:, inter:], down[e])
        out.index_add_(0, rows, y * weights[rows, slot, None])
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

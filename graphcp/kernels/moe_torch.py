"""The MoE experts in torch: the form that serves on CPU, the oracle of the Triton grouped GEMMs,
and the only form for activations the kernels do not have (DeepSeek V4's clamp)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# (gate [N, I], up [N, I]) -> the expert's intermediate activation [N, I]
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# local expert -> (gate_up [2 I, H], down [H, I]) in the activation dtype
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


def experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int,
                  first: int, expert_weights: ExpertWeights,
                  activation: Activation = silu_and_mul) -> torch.Tensor:
    """Every local expert runs on every row, weighted by the row's routing weight for it (0 where
    it is not routed there). More arithmetic than gathering each expert's rows, but static shapes
    and no host sync, so it stays inside a graph. ``expert_weights`` gives one expert's weights at
    a time: FP8 experts are dequantized one expert per call, never all at once."""
    local = ids - first
    out = torch.zeros_like(x)
    for e in range(num_local):
        gate_up, down = expert_weights(e)
        inter = down.shape[-1]
        w = (weights * (local == e).to(weights.dtype)).sum(-1, keepdim=True)        # [N, 1]
        h = nn.functional.linear(x, gate_up)
        out = out + nn.functional.linear(activation(h[:, :inter], h[:, inter:]), down) * w
    return out


def dense_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, first: int) -> torch.Tensor:
    """``experts_torch`` over plain fused weights, gate_up [E, 2 I, H] and down [E, H, I]: the
    contract of the Triton grouped GEMM (``triton_moe.triton_experts``)."""
    return experts_torch(x, ids, weights, gate_up.shape[0], first, lambda e: (gate_up[e], down[e]))

"""The MoE experts in torch: the form that serves on CPU and the oracle of the Triton grouped
GEMMs, for every gated activation they have (``GatedActivation``: SiLU, DeepSeek V4's clamped
SwiGLU, gpt-oss's clamped SwiGLU with biases). The FP8 grouped GEMM's oracle
(``experts_fp8_torch``) also rounds each projection's input to FP8 as it does."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from graphcp.kernels.fp8_torch import dequantize_expert, rounded_activations
from graphcp.kernels.fp8_types import Fp8Experts

# (gate [N, I], up [N, I]) -> the expert's intermediate activation [N, I]
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# local expert -> (gate_up [2 I, H], down [H, I]) in the activation dtype, optionally followed by
# their biases (gate_up [2 I], down [H] or None)
ExpertWeights = Callable[[int], tuple]


@dataclass(frozen=True)
class GatedActivation:
    """An expert's gating, one formula with three settings: ``g * sigmoid(alpha g) * (u + up_shift)``
    on g = min(gate, limit) and u = up clamped to [-limit, limit] (no clamp when ``limit`` is None).
    SiLU-and-mul is the default; DeepSeek V4 clamps (``limit``); gpt-oss clamps, scales the sigmoid
    (``alpha``) and shifts up by 1. The Triton grouped GEMMs take the same settings."""

    limit: float | None = None
    alpha: float = 1.0
    up_shift: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if self.alpha == 1.0 and self.up_shift == 0.0:
            return nn.functional.silu(gate) * up          # transformers' own op order
        return (up + self.up_shift) * (gate * torch.sigmoid(gate * self.alpha))


SILU = GatedActivation()


def experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int,
                  first: int, expert_weights: ExpertWeights,
                  activation: Activation = SILU) -> torch.Tensor:
    """Every local expert runs on every row, weighted by the row's routing weight for it (0 where
    it is not routed there). More arithmetic than gathering each expert's rows, but static shapes
    and no host sync, so it stays inside a graph. ``expert_weights`` gives one expert's weights at
    a time: FP8 experts are dequantized one expert per call, never all at once."""
    local = ids - first
    out = torch.zeros_like(x)
    for e in range(num_local):
        gate_up, down, *biases = expert_weights(e)
        gate_up_bias, down_bias = biases or (None, None)
        inter = down.shape[-1]
        w = (weights * (local == e).to(weights.dtype)).sum(-1, keepdim=True)        # [N, 1]
        h = nn.functional.linear(x, gate_up, gate_up_bias)
        y = nn.functional.linear(activation(h[:, :inter], h[:, inter:]), down, down_bias)
        out = out + y * w
    return out


# Per-expert biases of (gate_up [E, 2 I], down [E, H]); None where a projection has none.
Biases = tuple[torch.Tensor | None, torch.Tensor | None]
NO_BIASES: Biases = (None, None)


def _bias(bias: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias[e].to(dtype)


def dense_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, first: int,
                        activation: GatedActivation = SILU,
                        biases: Biases = NO_BIASES) -> torch.Tensor:
    """``experts_torch`` over plain fused weights, gate_up [E, 2 I, H] and down [E, H, I]: the
    contract of the Triton grouped GEMM (``triton_moe.triton_experts``)."""
    def expert_weights(e: int) -> tuple:
        return gate_up[e], down[e], *(_bias(b, e, x.dtype) for b in biases)

    return experts_torch(x, ids, weights, gate_up.shape[0], first, expert_weights, activation)


def experts_fp8_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: Fp8Experts, down: Fp8Experts, first: int,
                      activation: GatedActivation = SILU,
                      biases: Biases = NO_BIASES) -> torch.Tensor:
    """The FP8 grouped GEMM's arithmetic (``triton_moe.triton_experts_fp8``) in torch: each
    projection's input quantized per token and K group on its weight's grid, products in fp32 with
    one expert dequantized at a time, the gate_up output in x's dtype before the gating."""
    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        act = activation(gate.to(x.dtype), up.to(x.dtype))
        return rounded_activations(act, down.block[1], down.k_offset)

    def expert_weights(e: int) -> tuple:
        return (*(dequantize_expert(w, e, torch.float32) for w in (gate_up, down)),
                *(_bias(b, e, torch.float32) for b in biases))

    xr = rounded_activations(x, gate_up.block[1], gate_up.k_offset)
    num_local = gate_up.weight.shape[0]
    return experts_torch(xr, ids, weights, num_local, first, expert_weights, gated).to(x.dtype)

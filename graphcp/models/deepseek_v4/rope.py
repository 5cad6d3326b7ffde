"""DeepSeek V4's rotaries and norms: interleaved RoPE on the last features of a head (consecutive
pairs rotate together), computed from the positions of each forward (V4 contexts reach 1M tokens,
too long for cos/sin tables), and the RMSNorms as transformers computes them."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.models.common.rope import inv_freq
from graphcp.models.deepseek_v4.config import RopeSpec


class V4Rotary:
    """cos/sin [T, dim / 2] of one rotary at the given positions, in the model's dtype (as HF)."""

    def __init__(self, spec: RopeSpec) -> None:
        self.spec = spec
        self.inv_freq: torch.Tensor | None = None
        self.factor = 1.0

    def build(self, device: torch.device) -> None:
        spec = self.spec
        if spec.yarn is not None:
            yarn = {**spec.yarn, "rope_type": "yarn"}        # its factor is always given here
            freqs, self.factor = inv_freq(spec.theta, yarn, spec.dim, 0)
        else:
            freqs, self.factor = inv_freq(spec.theta, None, spec.dim, 0)
        self.inv_freq = freqs.to(device)

    def __call__(self, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq is None:
            raise RuntimeError("V4Rotary.build(device) must run before the forward")
        freqs = positions.float()[:, None] * self.inv_freq
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(nn.Module):
    """fp32 statistics and an fp32 weight, cast to the input dtype once at the end (HF keeps these
    weights fp32 in any model dtype)."""

    keep_fp32 = True

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)

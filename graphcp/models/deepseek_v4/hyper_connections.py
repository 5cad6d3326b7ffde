"""Manifold-constrained hyper-connections (mHC) of DeepSeek V4, HF weight names: the residual is
``hc_mult`` streams per token; before each block a learned mix collapses them into the block's
input, and after it the block's output is spread back over the streams beside a doubly-stochastic
mix of the old ones (Sinkhorn iterations keep its norm in check). fp32, as transformers keeps them.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.models.deepseek_v4.rope import unweighted_rms_norm


class HyperConnection(nn.Module):
    keep_fp32 = True

    def __init__(self, hidden: int, streams: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        self.streams, self.iters = streams, sinkhorn_iters
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        mixes = (2 + streams) * streams          # pre [n], post [n], comb [n, n]
        self.fn = nn.Parameter(torch.empty(mixes, streams * hidden), requires_grad=False)
        self.base = nn.Parameter(torch.empty(mixes), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], the block input [T, hidden])."""
        n = self.streams
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre, post, comb = nn.functional.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = torch.softmax(comb.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):          # Sinkhorn: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """The streams after a block: its output spread by ``post`` plus comb^T mixing the old."""
        dtype = streams.dtype
        return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


class HyperHead(nn.Module):
    """The final collapse of the streams, before the model's norm."""

    keep_fp32 = True

    def __init__(self, hidden: int, streams: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(streams), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

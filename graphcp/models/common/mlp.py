"""The dense gated FFN every family shares (SiLU-gated, gate/up fused into one GEMM)."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import TPInfo
from graphcp.forward_context import current_communicator
from graphcp.models.common.linear import ColumnLinear, RowLinear, fused_linear
from graphcp.models.common.quantized import fuse
from graphcp.models.config import ModelConfig


class GatedMLP(nn.Module):
    """Dense FFN, split over the FFN TP group; the layer communicator brings it the tokens it serves."""

    keeps_rows = True       # row-wise: any subset of rows
    fused_projections = (("gate_proj", "up_proj"),)

    def __init__(self, cfg: ModelConfig, tp: TPInfo) -> None:
        super().__init__()
        self.gate_proj = ColumnLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.up_proj = ColumnLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias)
        self.gate_up: tuple | None = None

    def fuse(self) -> None:
        self.gate_up = fuse((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = current_communicator()
        rows = x.shape[0]
        x = comm.gather(x)
        gate, up = fused_linear(x, self.gate_up).split(self.gate_up[2], dim=-1)
        # in place on the fresh gate half (same values): no [T, I] allocations besides gate_up
        partial = self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up), reduce=False)
        out = comm.scatter(partial, rows)                   # reduce-scatter to this rank's rows
        return self.down_proj.reduce(partial) if out is None else self.down_proj.add_bias(out)

"""Small layers shared by the model families: RMSNorm and the rotary embedding (one Triton launch each
on CUDA once their start-up check accepted them, ``kernels/resolve.py``; the torch forms are HF's)."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.kernels.registry import chosen
from graphcp.kernels.torch_layers import rms_norm_torch, rope_torch, rotated_sin
from graphcp.models.common.rope import rope_tables
from graphcp.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual), the add fused on CUDA."""
        fn = chosen("rms_norm") if x.is_cuda else None
        if fn is not None and x.stride(-1) == 1 and x.dim() in (2, 3) and x.dtype == self.weight.dtype and (
                residual is None or (x.dim() == 2 and residual.stride(-1) == 1 and residual.dtype == x.dtype)):
            return fn(x, self.weight, self.eps, residual)
        return self._torch_form(x, residual)

    def _torch_form(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            return rms_norm_torch(x, self.weight, self.eps)
        total = residual + x
        return rms_norm_torch(total, self.weight, self.eps), total


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position (models/rope.py: every rope type HF applies, its attention
    factor folded in): a gather, so positions can live in a static graph buffer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self._last: tuple | None = None      # (positions, cos, sin, rotated sin) of this forward

    def build(self, device: torch.device) -> None:
        # Built on the CPU after loading (the module itself may be constructed on the meta device).
        cfg = self.config
        cos, sin = rope_tables(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim,
                               cfg.max_position_embeddings)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D] at ``positions``; every layer of a forward passes the same positions
        tensor, so they are gathered once and reused."""
        return self._tables(positions, dtype)[:2]

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        cached = self._last
        if cached is None or cached[0] is not positions or cached[1].dtype != dtype:
            cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
            sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
            cached = self._last = (positions, cos, sin, None)
        return cached[1:]

    def _torch_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(cos, sin, rotated sin): the torch form's tables, the last made once per forward."""
        cos, sin, rot_sin = self._tables(positions, dtype)
        if rot_sin is None:
            rot_sin = rotated_sin(sin)
            self._last = (positions, cos, sin, rot_sin)
        return cos, sin, rot_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(positions, q.dtype)
        fn = chosen("rope") if q.is_cuda else None
        if fn is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            cos2, sin2 = cos.squeeze(1), sin.squeeze(1)
            return fn(q, cos2, sin2), fn(k, cos2, sin2)
        cos, sin, rot_sin = self._torch_tables(positions, q.dtype)
        return rope_torch(q, cos, sin, rot_sin=rot_sin), rope_torch(k, cos, sin, rot_sin=rot_sin)

    def rotate(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """RoPE on [T, H, D] in one pass: q's and k's heads side by side (each head alone, so the
        values are those of ``forward``; half the ops on CPU, where each op's fixed cost shows)."""
        cos, sin = self.tables(positions, heads.dtype)
        fn = chosen("rope") if heads.is_cuda else None
        if fn is not None and heads.stride(-1) == 1:
            return fn(heads, cos.squeeze(1), sin.squeeze(1))
        cos, sin, rot_sin = self._torch_tables(positions, heads.dtype)
        return rope_torch(heads, cos, sin, head_major=True, rot_sin=rot_sin)

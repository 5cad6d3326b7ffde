"""The FP8 weights the GEMMs read (dense projections and MoE experts), as loaded: float8_e4m3fn
values with float32 block scales (``weight_block_size``, edge blocks partial). A shard need not
start on a block: each output row names its row of the scale grid, and ``k_offset`` says where
column 0 sits in its K block. Kernels import these types; ``models/fp8.py`` builds them at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A K block wider than any weight row: block (1, WHOLE_ROW) is one scale per output row, the
# per-channel format (compressed-tensors' strategy "channel", scales [N, 1]).
WHOLE_ROW = 1 << 30


@dataclass
class Fp8Weight:
    """An FP8 weight [N, K] as the GEMM reads it: block scales, each output row's row in them (a
    fused q/k/v or a shard that starts inside a block maps rows freely), and where column 0 sits in
    its K block."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [row blocks, K blocks]
    scale_rows: torch.Tensor  # int32 [N]
    k_offset: int
    block: tuple[int, int]


@dataclass
class Fp8Experts:
    """A rank's experts of one projection in FP8: ``weight`` [E, N, K], ``scale`` [E, row blocks,
    K blocks]; ``scale_rows`` [N] and ``k_offset`` are the same for every expert (each expert is
    sliced alike). gate_up stacks the gate rows then the up rows, each over its own scale rows."""

    weight: torch.Tensor  # float8_e4m3fn [E, N, K]
    scale: torch.Tensor  # float32 [E, row blocks, K blocks]
    scale_rows: torch.Tensor  # int32 [N]
    k_offset: int
    block: tuple[int, int]

    def expert(self, e: int) -> Fp8Weight:
        return Fp8Weight(self.weight[e], self.scale[e], self.scale_rows, self.k_offset, self.block)

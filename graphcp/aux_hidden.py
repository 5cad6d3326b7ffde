"""Speculative-decoding auxiliary outputs (EAGLE-3): the residual stream entering chosen layers, for every
new token of a batch, in the batch's token order.

The model returns them for this rank's CP-local rows (it knows nothing of CP or graphs). Pipeline stages
before the last send the columns captured so far along with the hidden state, so the last stage holds
every listed layer for its rows; it then all-gathers the rows over the CP group and writes each at its
batch token index into an output buffer (static under graphs), whose last row takes the padding rows.
"""
from __future__ import annotations

from typing import Sequence

import torch

from graphcp.cp.metadata import CPMetadata
from graphcp.distributed.comm import CPComm, all_gather_into


class AuxHidden:
    """Which listed layers this pipeline stage receives, captures and sends on (empty when unset)."""

    def __init__(self, layers: Sequence[int], hidden_size: int, stage: range) -> None:
        self.layers, self.hidden_size = tuple(layers), hidden_size
        self.before = [i for i in self.layers if i < stage.start]     # arrive with the hidden state
        self.here = [i for i in self.layers if i in stage]            # this stage's model returns them
        self.through = [i for i in self.layers if i < stage.stop]     # leave with the hidden state

    @property
    def width(self) -> int:
        """Columns of the output: the listed layers concatenated."""
        return len(self.layers) * self.hidden_size

    @property
    def recv_width(self) -> int:
        return self.hidden_size * (1 + len(self.before))

    def unpack(self, received: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A previous stage's message: (hidden state, {layer id: columns})."""
        parts = received.split(self.hidden_size, dim=1)
        return parts[0], dict(zip(self.before, parts[1:]))

    def pack(self, hidden: torch.Tensor, columns: dict[int, torch.Tensor]) -> torch.Tensor:
        """The message to the next stage: the hidden state, then every column captured so far."""
        if not self.through:
            return hidden
        return torch.cat([hidden] + [columns[i] for i in self.through], dim=1)

    def local(self, columns: dict[int, torch.Tensor]) -> torch.Tensor:
        """This rank's rows [local rows, width], the layers in the order they were listed."""
        return torch.cat([columns[i] for i in self.layers], dim=1)


def gather_rows(out: torch.Tensor, local: torch.Tensor, meta: CPMetadata, comm: CPComm | None) -> None:
    """Write every CP rank's local rows into ``out`` [>= new tokens + 1, width] at their batch token
    index; padding rows land on ``out``'s last row. Tensor ops and one all-gather (capturable)."""
    rows = local
    if meta.cp_size > 1:
        rows = local.new_empty((meta.cp_size * local.shape[0], local.shape[1]))
        all_gather_into(rows, local, comm.group)
    index = meta.gather_token_index
    out.index_copy_(0, torch.where(index >= 0, index, out.shape[0] - 1), rows)

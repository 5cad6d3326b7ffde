"""Per-request recurrent state of the linear-attention layers, kept beside the paged KV of the
full-attention layers: one slot per live request, holding for every linear layer the conv window
(the last ``kernel - 1`` q|k|v inputs, model dtype) and the delta-rule state (fp32, as HF keeps it).

Slot 0 is the dummy that padding requests of a padded batch read and write; requests get 1..max.
A request's state advances with each ``prefill`` of it and is freed by ``release``. Under CP every
rank holds every request's whole state: the hand-off (graphcp/attention/linear_cp.py) leaves each
rank with the final states of all requests, so nothing is exchanged to store or reuse them.
"""
from __future__ import annotations

from typing import Sequence

import torch

from graphcp.errors import RequestError
from graphcp.models.hybrid_config import HybridConfig


class LinearStatePool:
    def __init__(self, cfg: HybridConfig, layers: Sequence[int], max_requests: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        n, slots = len(self.layer_index), max_requests + 1
        self.conv = torch.zeros(n, slots, cfg.conv_kernel - 1, cfg.conv_dim, dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros(n, slots, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim,
                                     dtype=torch.float32, device=device)
        self.slot_of: dict[str, int] = {}
        self.free = list(range(1, slots))

    @property
    def bytes_per_request(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())

    @property
    def free_requests(self) -> int:
        return len(self.free)

    def allocate(self, rid: str) -> int:
        """The request's slot; a new request takes a free one (its state is read as zeros until
        written: a batch marks it fresh)."""
        if rid in self.slot_of:
            return self.slot_of[rid]
        if not self.free:
            raise RequestError(f"request {rid!r}: no free linear-attention state slot "
                               f"({len(self.slot_of)} requests hold one; release some)")
        self.slot_of[rid] = self.free.pop(0)
        return self.slot_of[rid]

    def release(self, rid: str) -> None:
        slot = self.slot_of.pop(rid, None)
        if slot is not None:
            self.free.append(slot)

    def read(self, layer: int, slots: torch.Tensor, fresh: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [R, K-1, conv_dim], states [R, Hv, dk, dv]) of ``slots``; zeros where
        ``fresh`` (a request with no cached prefix)."""
        i = self.layer_index[layer]
        zero = torch.zeros((), device=fresh.device)
        window = torch.where(fresh[:, None, None], zero.to(self.conv.dtype),
                             self.conv[i].index_select(0, slots))
        state = torch.where(fresh[:, None, None, None], zero,
                            self.recurrent[i].index_select(0, slots))
        return window, state

    def write(self, layer: int, slots: torch.Tensor, window: torch.Tensor,
              state: torch.Tensor) -> None:
        i = self.layer_index[layer]
        self.conv[i].index_copy_(0, slots, window.to(self.conv.dtype))
        self.recurrent[i].index_copy_(0, slots, state.float())

    def request_state(self, rid: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per linear layer: (conv window [K-1, conv_dim], delta-rule state [Hv, dk, dv]), on CPU.
        HF's cache keeps the conv window as [conv_dim, K] (one older input, never read)."""
        slot = self.slot_of[rid]
        return {layer: (self.conv[i, slot].cpu(), self.recurrent[i, slot].cpu())
                for layer, i in self.layer_index.items()}

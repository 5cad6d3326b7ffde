"""Per-request state: what a layer kind keeps per request rather than per token (a recurrent layer's
conv window and state), stored beside the paged KV in slots, one slot per request.

Slot 0 is the dummy that padding requests read and write. The page table hands out the slots in
the same transaction as pages (``kv/pages.py``): a batch reads each request's committed slot and
writes a spare one, which becomes the request's slot when the batch commits; a failed batch frees
the spare, so the committed state is never overwritten by a forward that does not finish.
"""
from __future__ import annotations

import math

import torch

NO_STATE = 0          # the dummy slot: a request without a committed state reads it as zeros


class StatePool:
    """For each layer of ``parts`` (layer -> its ``CachePart``s: the layers whose kind keeps
    per-request state), each part stored as ``[slots + 1, *shape]`` in the part's dtype (the pool's
    where it names none)."""

    def __init__(self, parts: dict[int, tuple], slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layer_parts = {layer: p for layer, p in parts.items() if p}
        self.slots = slots if self.layer_parts else 0
        self.storage = {(layer, p.name): torch.zeros((self.slots + 1,) + p.shape,
                                                     dtype=p.dtype or dtype, device=device)
                        for layer, layer_parts in self.layer_parts.items() for p in layer_parts}

    def part(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s storage of part ``name``: [slots + 1, *shape]."""
        return self.storage[layer, name]

    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, ...]:
        """Every part of ``layer`` at one slot, in the layer's part order (none if it keeps none)."""
        return tuple(self.storage[layer, p.name][slot] for p in self.layer_parts.get(layer, ()))

    @property
    def bytes_per_request(self) -> int:
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.storage.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage.values())


def state_bytes(parts: dict[int, tuple], dtype: torch.dtype) -> int:
    """Bytes of one request's state over ``parts``."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.width * (torch.empty((), dtype=p.dtype).element_size() if p.dtype else size)
               for layer in parts.values() for p in layer)

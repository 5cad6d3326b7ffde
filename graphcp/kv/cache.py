"""The paged pool: for each layer, the parts its layer kind caches per token (dense K and V; DSA's MLA
rows and indexer keys), each stored as ``[slots, *row shape]`` with slot = page * page_size + offset.

Page 0 is reserved: its first slot is the dummy slot that padding rows write to, so padded graph
replays never touch a real cache entry. Parts kept per request rather than per token (a recurrent
layer's state) live beside the pages in ``states`` (``kv/states.py``). The pool knows nothing of
model families: a layer kind names its parts (``CachePart``) and the pool stores them;
``graphcp/attention/kinds.py`` says which kind each layer has and how the engine returns its cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.kv.states import StatePool

DUMMY_SLOT = 0


@dataclass(frozen=True)
class CachePart:
    """One thing a layer caches per token (or, for per-request state, per request): ``name``, the
    shape of one row, and its dtype where it is not the pool's (a recurrent state kept in fp32)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    @property
    def width(self) -> int:
        return math.prod(self.shape)


LayerParts = dict[int, tuple[CachePart, ...]]    # layer id -> its parts, in the order it writes them


def bytes_per_token(parts: LayerParts, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return size * sum(p.width for layer in parts.values() for p in layer)


class PoolHooks:
    """What the runner and the attention ops ask of every pool, as a pool that holds every layer answers.
    LayerSplit pools (``kv/layer_split.py``) override them."""

    def held_layers(self, stage_layers: range) -> range:
        """The layers whose cache this pool keeps between batches."""
        return stage_layers

    def begin_batch(self, rows: list, prefix_lens: list[int]) -> None:
        """Told each batch's page rows and cached-prefix lengths before the forward."""

    def prepare(self, layer: int) -> None:
        """Called before a layer's attention writes and reads the pool."""

    def map_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Engine slots in ``layer``'s storage numbering (the same unless LayerSplit scratch)."""
        return slots

    def map_pages(self, layer: int, page_rows: torch.Tensor) -> torch.Tensor:
        """Page-table rows in ``layer``'s storage numbering."""
        return page_rows

    def unmap_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Storage slots of ``layer`` back in the engine's numbering."""
        return slots

    def usage(self, table) -> dict:
        """Extra ``stats()`` entries of this pool given the page table (KV sharding: its pages)."""
        return {}


class PagedPool(PoolHooks):
    """Every part of every layer of ``parts`` in full; the parts of one name are stacked over the layers
    that have them (one tensor each, which a PD sender registers once)."""

    def __init__(self, parts: LayerParts, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, write_kernel: Callable | None = None,
                 states: StatePool | None = None) -> None:
        self.layer_parts, self.num_pages, self.page_size = dict(parts), num_pages, page_size
        self.dtype = dtype
        self.states = states or StatePool({}, 0, dtype, device)   # per-request parts (kv/states.py)
        self._write_kernel = write_kernel      # a fused scatter of K and V (Triton on CUDA), else index_copy_
        slots = num_pages * page_size
        self.storage: dict[str, torch.Tensor] = {}
        self._index: dict[tuple[int, str], int] = {}       # (layer, part name) -> row in storage[name]
        shapes: dict[str, tuple[int, ...]] = {}
        for layer, layer_parts in self.layer_parts.items():
            for part in layer_parts:
                if shapes.setdefault(part.name, part.shape) != part.shape:
                    raise ValueError(f"part {part.name!r} has two row shapes")
                self._index[layer, part.name] = sum(1 for (_, n) in self._index if n == part.name)
        for name, shape in shapes.items():
            count = sum(1 for (_, n) in self._index if n == name)
            self.storage[name] = torch.zeros((count, slots) + shape, dtype=dtype, device=device)
        self.device = torch.device(device)

    def part(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s storage of part ``name``: [slots, *row shape]."""
        return self.storage[name][self._index[layer, name]]

    def has_part(self, layer: int, name: str) -> bool:
        return (layer, name) in self._index

    def write(self, layer: int, name: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.part(layer, name).index_copy_(0, self.map_slots(layer, slots), rows)

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 runs: tuple[tuple[int, int, int], ...] | None = None) -> None:
        """Dense K and V together: one fused launch where the write kernel runs (CUDA); else slice
        copies where the host metadata found ``runs`` of consecutive slots (padding rows, bound
        for the dummy slot, are not written): 2-3x faster than indexing them (measured on CPU)."""
        if self.map_slots(layer, slots) is slots:
            if self._write_kernel is not None:
                self._write_kernel(self.part(layer, "k"), self.part(layer, "v"), slots, k, v)
                return
            if runs is not None:
                for part, rows in ((self.part(layer, "k"), k), (self.part(layer, "v"), v)):
                    for row, slot, count in runs:
                        part[slot:slot + count].copy_(rows[row:row + count])
                return
        self.write(layer, "k", slots, k)
        self.write(layer, "v", slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every part of ``layer`` at engine ``slots``, in the layer's part order."""
        return tuple(self.part(layer, p.name).index_select(0, slots) for p in self.layer_parts[layer])

    # -- what a PD sender reads (graphcp/pd/sender.py): rows [slots, ...], one token each -----------------
    def transfer_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.part(layer, p.name) for p in self.layer_parts[layer])

    def registered(self) -> tuple[torch.Tensor, ...]:
        """The tensors a sender registers with its transfer engine: every part lies in one of them."""
        return tuple(self.storage.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage.values())

"""LayerSplit (``--enable-dsa-cache-layer-split``): each CP rank keeps only its contiguous range of layers'
cache persistently; every other layer runs on a scratch layer sized to the current batch.

With interleave every CP rank all-gathers every layer's new rows anyway, so a non-owned layer only lacks the
cached prefix of a later chunk: before that layer's attention, its owner broadcasts the prefix rows to the CP
group (``prepare``). The scratch holds only the pages the batch touches, renumbered 1..n (page 0 stays the
dummy page), so a rank holds about 1/C of the unsplit cache plus one layer of the largest batch. Pools take
and give slots in the engine's (global) numbering: ``map_slots`` / ``map_pages`` turn them into a layer's
storage numbering for the kernels, ``unmap_slots`` back. The owned ranges are what each rank sends in a PD
transfer (``KVSender``). LayerSplit needs interleave, which runs eagerly, so the per-batch tables are host
work outside any graph. The pool is generic over the layer kinds' parts, as ``PagedPool`` is.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from graphcp.distributed.shards import even_split
from graphcp.kv.cache import LayerParts, PagedPool


class ScratchPages:
    """The current batch's pages renumbered 1..n for the scratch layer, both ways, and its prefix slots."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.to_scratch = torch.zeros(num_pages, dtype=torch.long, device=device)
        self.to_global = torch.zeros(1, dtype=torch.long, device=device)
        self.pages = 1                               # the dummy page only
        self.prefix_slots = torch.zeros(0, dtype=torch.long, device=device)
        self._mapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, rows: list, prefix_lens: list[int]) -> None:
        device = self.to_scratch.device
        used = [np.asarray(r, dtype=np.int64) for r in rows if len(r)]
        pages = np.unique(np.concatenate(used)) if used else np.zeros(0, dtype=np.int64)
        pages = pages[pages != 0]
        self.to_scratch.zero_()
        self.to_global = torch.from_numpy(np.concatenate(([0], pages))).to(device)
        self.to_scratch[self.to_global] = torch.arange(len(pages) + 1, device=device)
        self.pages = len(pages) + 1
        ps = self.page_size
        slots = [np.asarray(row)[np.arange(n) // ps] * ps + np.arange(n) % ps
                 for row, n in zip(rows, prefix_lens) if n]
        flat = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
        self.prefix_slots = torch.from_numpy(flat.astype(np.int64)).to(device)
        self._mapped.clear()

    def _remap(self, slots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return table[torch.div(slots, ps, rounding_mode="floor")] * ps + slots % ps

    def map_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Global slots -> scratch slots; the forward's metadata tensors are mapped once per batch."""
        hit = self._mapped.get(id(slots))
        if hit is not None and hit[0] is slots:
            return hit[1]
        mapped = self._remap(slots, self.to_scratch)
        self._mapped[id(slots)] = (slots, mapped)
        return mapped

    def map_pages(self, page_rows: torch.Tensor) -> torch.Tensor:
        hit = self._mapped.get(id(page_rows))
        if hit is not None and hit[0] is page_rows:
            return hit[1]
        mapped = self.to_scratch[page_rows]
        self._mapped[id(page_rows)] = (page_rows, mapped)
        return mapped

    def unmap_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return self._remap(slots, self.to_global)


def layer_ranges(num_layers: int, cp_size: int) -> list[range]:
    """Each CP rank's contiguous layers, as even as possible (10 over 4: 3, 3, 2, 2): the split used for
    the cache and for PD sends alike."""
    return [range(*even_split(num_layers, cp_size, c)) for c in range(cp_size)]


def _grown(t: torch.Tensor, slots: int) -> torch.Tensor:
    """``t`` with at least ``slots`` rows: the scratch grows to the largest batch seen (by half again)."""
    if t.shape[0] >= slots:
        return t
    return t.new_zeros((max(slots, t.shape[0] * 3 // 2),) + tuple(t.shape[1:]))


class LayerSplitPool(PagedPool):
    """The owned layers' parts in full (a ``PagedPool``), one scratch layer per part for the rest."""

    def __init__(self, parts: LayerParts, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup, cp_ranks: list[int], cp_rank: int) -> None:
        layers = sorted(parts)
        ranges = layer_ranges(len(layers), len(cp_ranks))
        self.owned = range(layers[0] + ranges[cp_rank].start, layers[0] + ranges[cp_rank].stop)
        self.owners = {layer: next(c for c, r in enumerate(ranges) if i in r) for i, layer in enumerate(layers)}
        self.group, self.cp_ranks, self.cp_rank = group, cp_ranks, cp_rank
        super().__init__({i: parts[i] for i in self.owned}, num_pages, page_size, dtype, device)
        self.all_parts = dict(parts)
        self.scratch = ScratchPages(num_pages, page_size, device)
        shapes = {p.name: p.shape for layer in parts.values() for p in layer}
        self.scratch_rows = {name: torch.zeros((page_size,) + shape, dtype=dtype, device=device)
                             for name, shape in shapes.items()}

    def held_layers(self, stage_layers: range) -> range:
        return self.owned

    def part(self, layer: int, name: str) -> torch.Tensor:
        return super().part(layer, name) if layer in self.owned else self.scratch_rows[name]

    def has_part(self, layer: int, name: str) -> bool:
        return any(p.name == name for p in self.all_parts[layer])

    def transfer_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        """A non-owned layer's parts are its scratch rows (a sender only sends its own layers)."""
        return tuple(self.part(layer, p.name) for p in self.all_parts[layer])

    def map_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return slots if layer in self.owned else self.scratch.map_slots(slots)

    def map_pages(self, layer: int, page_rows: torch.Tensor) -> torch.Tensor:
        return page_rows if layer in self.owned else self.scratch.map_pages(page_rows)

    def unmap_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return slots if layer in self.owned else self.scratch.unmap_slots(slots)

    def begin_batch(self, rows: list, prefix_lens: list[int]) -> None:
        self.scratch.begin(rows, prefix_lens)
        slots = self.scratch.pages * self.page_size
        self.scratch_rows = {name: _grown(t, slots) for name, t in self.scratch_rows.items()}

    def prepare(self, layer: int) -> None:
        """Before a layer's attention: a non-owned layer gets the batch's cached-prefix rows of every part
        from its owner, in one broadcast."""
        prefix = self.scratch.prefix_slots
        if prefix.numel() == 0:
            return
        parts = self.all_parts[layer]
        owner = self.owners[layer]
        if owner == self.cp_rank:
            rows = torch.cat([self.part(layer, p.name).index_select(0, prefix).reshape(prefix.numel(), -1)
                              for p in parts], dim=1)
        else:
            rows = torch.empty(prefix.numel(), sum(p.width for p in parts), dtype=self.dtype,
                               device=self.device)
        dist.broadcast(rows, src=self.cp_ranks[owner], group=self.group)
        if layer in self.owned:
            return
        for part, block in zip(parts, rows.split([p.width for p in parts], dim=1)):
            self.write(layer, part.name, prefix, block.reshape((prefix.numel(),) + part.shape))

    @property
    def nbytes(self) -> int:
        scratch = sum(t.numel() * t.element_size() for t in self.scratch_rows.values())
        return super().nbytes + scratch

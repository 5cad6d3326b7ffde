"""LayerSplit (``--enable-dsa-cache-layer-split``): each CP rank keeps only its contiguous range of layers'
cache persistently; every other layer runs on a scratch layer sized to the current batch.

With interleave every CP rank all-gathers every layer's new rows anyway, so a non-owned layer only lacks the
cached prefix of a later chunk: before that layer's attention, its owner broadcasts the prefix rows to the CP
group (``prepare``). The scratch holds only the pages the batch touches, renumbered 1..n (page 0 stays the
dummy page), so a rank holds about 1/C of the unsplit cache plus one layer of the largest batch. Pools take
and give slots in the engine's (global) numbering: ``map_slots`` / ``map_pages`` turn them into a layer's
storage numbering for the kernels, ``unmap_slots`` back. The owned ranges are what each rank sends in a PD
transfer (``KVSender``). LayerSplit needs interleave, which runs eagerly, so the per-batch tables are host
work outside any graph.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from graphcp.kv.cache import KVPool
from graphcp.kv.dsa_cache import DSAPool
from graphcp.models.parallel import even_split


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


class _LayerOwnership:
    """The layer ranges of the CP group, the scratch numbering, and the owner's prefix broadcast."""

    def _split(self, num_layers: int, num_pages: int, page_size: int, device: torch.device,
               group: dist.ProcessGroup, cp_ranks: list[int], cp_rank: int) -> None:
        ranges = [range(*even_split(num_layers, len(cp_ranks), c)) for c in range(len(cp_ranks))]
        self.owned = ranges[cp_rank]
        self.owners = [next(c for c, r in enumerate(ranges) if layer in r) for layer in range(num_layers)]
        self.group, self.cp_ranks, self.cp_rank = group, cp_ranks, cp_rank
        self.scratch = ScratchPages(num_pages, page_size, device)

    def held_layers(self, stage_layers: range) -> range:
        return self.owned

    def map_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return slots if layer in self.owned else self.scratch.map_slots(slots)

    def map_pages(self, layer: int, page_rows: torch.Tensor) -> torch.Tensor:
        return page_rows if layer in self.owned else self.scratch.map_pages(page_rows)

    def unmap_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return slots if layer in self.owned else self.scratch.unmap_slots(slots)

    def begin_batch(self, rows: list, prefix_lens: list[int]) -> None:
        self.scratch.begin(rows, prefix_lens)
        self._fit_scratch(self.scratch.pages * self.page_size)

    def _broadcast_prefix(self, layer: int, rows: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The owner's prefix rows of ``layer`` (its ``rows``) on every CP rank."""
        owner = self.owners[layer]
        if owner != self.cp_rank:
            rows = like.new_empty((self.scratch.prefix_slots.numel(),) + tuple(like.shape[1:]))
        dist.broadcast(rows, src=self.cp_ranks[owner], group=self.group)
        return rows


def _grown(t: torch.Tensor, slots: int) -> torch.Tensor:
    """``t`` with at least ``slots`` rows: the scratch grows to the largest batch seen (by half again)."""
    if t.shape[0] >= slots:
        return t
    return t.new_zeros((max(slots, t.shape[0] * 3 // 2),) + tuple(t.shape[1:]))


class LayerSplitPool(_LayerOwnership, KVPool):
    """Dense K/V: the owned layers in full, one scratch K/V layer for the rest."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup, cp_ranks: list[int],
                 cp_rank: int) -> None:
        self._split(num_layers, num_pages, page_size, device, group, cp_ranks, cp_rank)
        KVPool.__init__(self, len(self.owned), num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.scratch_k = torch.zeros((page_size,) + tuple(self.k.shape[2:]), dtype=dtype, device=device)
        self.scratch_v = torch.zeros_like(self.scratch_k)

    def _fit_scratch(self, slots: int) -> None:
        self.scratch_k = _grown(self.scratch_k, slots)
        self.scratch_v = _grown(self.scratch_v, slots)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer - self.owned.start] if layer in self.owned else self.scratch_k

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer - self.owned.start] if layer in self.owned else self.scratch_v

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.map_slots(layer, slots)
        self.keys(layer).index_copy_(0, slots, k)
        self.values(layer).index_copy_(0, slots, v)

    def prepare(self, layer: int) -> None:
        """Before a layer's attention: a non-owned layer gets the batch's cached-prefix rows from its owner."""
        prefix = self.scratch.prefix_slots
        if prefix.numel() == 0:
            return
        mine = None
        if layer in self.owned:
            mine = torch.stack([self.keys(layer).index_select(0, prefix), self.values(layer).index_select(0, prefix)],
                               dim=1)
        like = self.k.new_empty((0, 2) + tuple(self.k.shape[2:]))
        rows = self._broadcast_prefix(layer, mine, like)
        if layer not in self.owned:
            self.write(layer, prefix, rows[:, 0], rows[:, 1])

    @property
    def nbytes(self) -> int:
        return 2 * (self.k.numel() + self.scratch_k.numel()) * self.k.element_size()


class LayerSplitDSAPool(_LayerOwnership, DSAPool):
    """DSA: the owned layers' MLA rows and indexer keys in full, one scratch layer of each for the rest."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                 index_dim: int, shared_indexer: tuple[bool, ...], dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup, cp_ranks: list[int], cp_rank: int) -> None:
        self._split(num_layers, num_pages, page_size, device, group, cp_ranks, cp_rank)
        DSAPool.__init__(self, num_layers, num_pages, page_size, kv_lora_rank, rope_dim, index_dim,
                         shared_indexer, dtype, device, held=self.owned)
        self.scratch_kv = torch.zeros(page_size, kv_lora_rank + rope_dim, dtype=dtype, device=device)
        self.scratch_index = torch.zeros(page_size, index_dim, dtype=dtype, device=device)

    def _fit_scratch(self, slots: int) -> None:
        self.scratch_kv = _grown(self.scratch_kv, slots)
        self.scratch_index = _grown(self.scratch_index, slots)

    def latent_kv(self, layer: int) -> torch.Tensor:
        return super().latent_kv(layer) if layer in self.owned else self.scratch_kv

    def index_keys(self, layer: int) -> torch.Tensor:
        return super().index_keys(layer) if layer in self.owned else self.scratch_index

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.latent_kv(layer).index_copy_(0, self.map_slots(layer, slots), rows)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        self.index_keys(layer).index_copy_(0, self.map_slots(layer, slots), keys)

    def prepare(self, layer: int) -> None:
        """A non-owned layer gets the prefix's MLA rows (and indexer keys) from its owner, in one broadcast."""
        prefix = self.scratch.prefix_slots
        if prefix.numel() == 0:
            return
        indexed = not self.shared_indexer[layer]
        width = self.kv.shape[-1]
        mine = None
        if layer in self.owned:
            parts = [self.latent_kv(layer).index_select(0, prefix)]
            if indexed:
                parts.append(self.index_keys(layer).index_select(0, prefix))
            mine = torch.cat(parts, dim=-1)
        like = self.kv.new_empty(0, width + (self.index_k.shape[-1] if indexed else 0))
        rows = self._broadcast_prefix(layer, mine, like)
        if layer not in self.owned:
            self.write(layer, prefix, rows[:, :width])
            if indexed:
                self.write_index(layer, prefix, rows[:, width:])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.index_k, self.scratch_kv, self.scratch_index))

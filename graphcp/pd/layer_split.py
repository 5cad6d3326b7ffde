"""LayerSplit (``--enable-dsa-cache-layer-split``): each CP rank keeps only its contiguous range of layers'
KV persistently; every other layer is served from one scratch layer during the forward.

With interleave every CP rank all-gathers every layer's new K/V anyway, so a non-owned layer only lacks the
cached prefix of a later chunk: before that layer's attention, its owner broadcasts the prefix rows to the CP
group (``prepare``). The owned ranges are the ranges each rank sends in a PD transfer (``KVSender``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from graphcp.kv.cache import KVPool
from graphcp.models.parallel import shard_range


class LayerSplitPool(KVPool):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup, cp_ranks: list[int],
                 cp_rank: int) -> None:
        ranges = [range(*shard_range(num_layers, len(cp_ranks), c)) for c in range(len(cp_ranks))]
        self.owned = ranges[cp_rank]
        self.owners = [next(c for c, r in enumerate(ranges) if layer in r) for layer in range(num_layers)]
        super().__init__(len(self.owned) + 1, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.group, self.cp_ranks, self.cp_rank = group, cp_ranks, cp_rank
        self.prefix_slots = torch.zeros(0, dtype=torch.long, device=device)

    def _index(self, layer: int) -> int:
        """Row of ``layer`` in the storage: its own row when owned, else the scratch row (the last)."""
        return layer - self.owned.start if layer in self.owned else len(self.owned)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[self._index(layer)]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[self._index(layer)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write(self._index(layer), slots, k, v)

    def held_layers(self, stage_layers: range) -> range:
        return self.owned

    def begin_batch(self, rows: list[list[int]], prefix_lens: list[int]) -> None:
        ps = self.page_size
        slots = [row[p // ps] * ps + p % ps for row, n in zip(rows, prefix_lens) for p in range(n)]
        self.prefix_slots = torch.tensor(slots, dtype=torch.long, device=self.k.device)

    def prepare(self, layer: int) -> None:
        """Before a layer's attention: the owner broadcasts the batch's cached-prefix rows into the scratch
        layer of every other CP rank (nothing to do for a batch without prefixes)."""
        if self.prefix_slots.numel() == 0:
            return
        owner = self.owners[layer]
        if owner == self.cp_rank:
            rows = torch.stack([self.keys(layer).index_select(0, self.prefix_slots),
                                self.values(layer).index_select(0, self.prefix_slots)])
        else:
            rows = self.k.new_empty((2, self.prefix_slots.numel()) + tuple(self.k.shape[2:]))
        dist.broadcast(rows, src=self.cp_ranks[owner], group=self.group)
        if owner != self.cp_rank:
            super().write(len(self.owned), self.prefix_slots, rows[0], rows[1])

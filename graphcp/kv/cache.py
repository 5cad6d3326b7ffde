"""The KV pool: per layer, K and V as [slots, kv_heads, head_dim] with slot = page * page_size + offset.

Page 0 is reserved: its first slot is the dummy slot that padding rows write to, so padded graph
replays never touch a real cache entry.
"""
from __future__ import annotations

from typing import Callable

import torch

DUMMY_SLOT = 0


class PoolHooks:
    """What the runner and the attention ops ask of every pool, as a pool that holds every layer answers.
    LayerSplit pools (graphcp/pd/layer_split.py) override them."""

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


class KVPool(PoolHooks):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, layer_offset: int = 0,
                 write_kernel: Callable | None = None) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.layer_offset = layer_offset     # a pipeline stage stores layers [offset, offset + num_layers)
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.k.device
        self._write_kernel = write_kernel     # a fused scatter of K and V (Triton on CUDA), else index_copy_

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer - self.layer_offset]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer - self.layer_offset]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        layer -= self.layer_offset
        if self._write_kernel is not None:
            self._write_kernel(self.k[layer], self.v[layer], slots, k, v)
            return
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys(layer).index_select(0, slots), self.values(layer).index_select(0, slots)

    def export(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of ``slots`` as the engine returns them: [kv_heads, n, head_dim], CPU fp32."""
        k, v = self.read(layer, slots)
        return k.transpose(0, 1).float().cpu(), v.transpose(0, 1).float().cpu()

    # -- what a PD sender reads (graphcp/pd/sender.py): rows [slots, ...], one token each -----------------
    def transfer_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self.keys(layer), self.values(layer)

    def registered(self) -> tuple[torch.Tensor, ...]:
        """The tensors a sender registers with its transfer engine: every part lies in one of them."""
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

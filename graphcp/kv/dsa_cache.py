"""The DSA KV pool: per layer the MLA rows ``[kv_latent | k_rope]`` and, on layers that run their
own indexer, the indexer keys; slot = page * page_size + offset, page 0 reserved (the dummy
slot)."""
from __future__ import annotations

import torch

from graphcp.kv.cache import PoolHooks


class DSAPool(PoolHooks):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
                 rope_dim: int, index_dim: int, shared_indexer: tuple[bool, ...],
                 dtype: torch.dtype, device: torch.device, held: range | None = None) -> None:
        self.num_pages, self.page_size, self.kv_lora_rank = num_pages, page_size, kv_lora_rank
        self.shared_indexer = shared_indexer
        self.held = range(num_layers) if held is None else held    # LayerSplit keeps a range
        slots = num_pages * page_size
        width = kv_lora_rank + rope_dim
        self.kv = torch.zeros(len(self.held), slots, width, dtype=dtype, device=device)
        indexed = [i for i in self.held if not shared_indexer[i]]
        self.index_row = {layer: n for n, layer in enumerate(indexed)}   # layer -> indexer cache
        self.index_k = torch.zeros(len(indexed), slots, index_dim, dtype=dtype, device=device)
        self.device = self.kv.device

    def latent_kv(self, layer: int) -> torch.Tensor:
        return self.kv[layer - self.held.start]

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.index_k[self.index_row[layer]]

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.latent_kv(layer).index_copy_(0, slots, rows)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        self.index_keys(layer).index_copy_(0, slots, keys)

    def export(self, layer: int, slots: torch.Tensor) -> tuple:
        """(kv_latent [n, kv_lora_rank], k_rope [n, rope_dim], index_k [n, index_dim] or None),
        CPU fp32: the tensors HF keeps in its cache."""
        rows = self.latent_kv(layer).index_select(0, slots).float().cpu()
        index = None
        if not self.shared_indexer[layer]:
            index = self.index_keys(layer).index_select(0, slots).float().cpu()
        return rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:], index

    # -- what a PD sender reads, as KVPool's ---------------------------------------------------
    def transfer_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The MLA rows, then the indexer keys on a layer with its own indexer."""
        if layer in self.index_row:
            return self.latent_kv(layer), self.index_keys(layer)
        return (self.latent_kv(layer),)

    def registered(self) -> tuple[torch.Tensor, ...]:
        return self.kv, self.index_k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.index_k))

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype) -> int:
        d = cfg.dsa
        indexed = sum(not s for s in d.shared_indexer)
        size = torch.empty((), dtype=dtype).element_size()
        mla = cfg.num_hidden_layers * (d.kv_lora_rank + d.qk_rope_head_dim)
        return size * (mla + indexed * d.index_head_dim)

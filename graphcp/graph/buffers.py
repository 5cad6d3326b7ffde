"""Batch descriptors packed in one int64 tensor (one host-to-device copy per forward), and the graphs'
static inputs and outputs built on them (``GraphInputs``, owned by the graph runner).

The graph's static inputs are exactly these raw descriptors; everything else (block sizes, cu_seqlens,
zigzag page table, KV slots, restore indices, positions) is computed from them inside the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.forward_batch import BatchInputs
from graphcp.profiling import active_counter, paused


@dataclass
class Descriptors:
    packed: torch.Tensor
    extend_lens: torch.Tensor    # [req_cap]   new tokens per request (0 for padding requests)
    prefix_lens: torch.Tensor    # [req_cap]   cached tokens per request
    whole_on: torch.Tensor       # [req_cap]   0: split by the layout; r + 1: whole on CP rank r (adaptive)
    page_table: torch.Tensor     # [req_cap, pages_cap] page ids (0 = the reserved dummy page)
    input_ids: torch.Tensor      # [ids_cap]   the batch's new tokens, flattened in request order

    @classmethod
    def allocate(cls, req_cap: int, pages_cap: int, ids_cap: int, device: torch.device | str = "cpu",
                 pin: bool = False) -> "Descriptors":
        packed = torch.zeros(3 * req_cap + req_cap * pages_cap + ids_cap, dtype=torch.long, device=device,
                             pin_memory=pin)
        a, b, c = req_cap, 2 * req_cap, 3 * req_cap + req_cap * pages_cap
        return cls(packed, packed[:a], packed[a:b], packed[b:b + a], packed[b + a:c].view(req_cap, pages_cap),
                   packed[c:])

    @classmethod
    def for_batch(cls, batch: BatchInputs) -> "Descriptors":
        """Host descriptors sized for one batch (an eager forward builds its metadata on the host)."""
        desc = cls.allocate(len(batch.extend_lens), max(1, max(len(r) for r in batch.page_rows)),
                            max(1, sum(batch.extend_lens)))
        desc.set(batch)
        return desc

    def set(self, batch: BatchInputs) -> None:
        self.fill(batch.extend_lens, batch.prefix_lens, batch.page_rows, batch.ids, batch.whole_on)

    def fill(self, extend_lens: list[int], prefix_lens: list[int], page_rows: list[list[int]],
             ids: list[torch.Tensor], whole_on: list[int] | None = None) -> None:
        """Host side: write a batch in (the rest is zeroed, so unused rows are empty padding requests).
        No per-request tensor ops: the lengths and the ragged page rows go in through numpy."""
        packed = self.packed.numpy()
        ids_start = packed.shape[0] - self.input_ids.shape[0]
        packed[:ids_start] = 0           # ids past the batch's are never read (padding rows read row 0)
        n = len(extend_lens)
        cap = self.extend_lens.shape[0]
        packed[:n] = extend_lens
        packed[cap:cap + n] = prefix_lens
        if whole_on is not None:
            packed[2 * cap:2 * cap + n] = whole_on
        widths = np.fromiter(map(len, page_rows), dtype=np.int64, count=len(page_rows))
        if widths.sum():
            table = self.page_table.numpy()
            used = np.arange(table.shape[1])[None, :] < widths[:, None]
            table[:len(page_rows)][used] = np.concatenate(page_rows)      # rows are int64 arrays
        total = sum(t.numel() for t in ids)
        torch.cat(ids, out=self.input_ids[:total])


@dataclass
class GraphInputs:
    """The graphs' static inputs and outputs at fixed addresses, allocated once for the largest bucket
    (mini-sglang's capture buffer): the device descriptors, their host staging copy (pinned on CUDA),
    the logits every replay writes, and the speculative aux rows."""
    static: Descriptors
    staging: Descriptors
    logits: torch.Tensor
    aux: torch.Tensor | None

    @classmethod
    def allocate(cls, req_cap: int, pages_cap: int, ids_cap: int, vocab: int, aux_width: int,
                 aux_dtype: torch.dtype, device: torch.device) -> "GraphInputs":
        static = Descriptors.allocate(req_cap, pages_cap, ids_cap, device)
        staging = Descriptors.allocate(req_cap, pages_cap, ids_cap, "cpu", pin=device.type == "cuda")
        logits = torch.zeros(req_cap, vocab, dtype=torch.float32, device=device)
        # Aux rows of the largest bucket's batch, plus the row that takes padding.
        aux = torch.zeros(ids_cap + 1, aux_width, dtype=aux_dtype, device=device) if aux_width else None
        return cls(static, staging, logits, aux)

    def set_batch(self, batch: BatchInputs) -> None:
        """Write a batch into the staging copy (host work), then copy it in (one host-to-device copy)."""
        with paused(active_counter()):         # filling host memory launches nothing on the device
            self.staging.set(batch)
        self.static.packed.copy_(self.staging.packed, non_blocking=True)

    def tensors(self) -> list[torch.Tensor]:
        """Everything a graph reads or writes at a fixed address."""
        return [self.static.packed, self.logits] + ([self.aux] if self.aux is not None else [])

"""What one forward runs on, passed down the call (never shared by reference).

``BatchInputs`` is a batch as the host holds it; ``Descriptors`` are its raw descriptors packed in one
int64 tensor (one host-to-device copy per forward), filled from it (the graph runner's static ones for a
replay, fresh ones for an eager forward). ``ForwardBatch`` is what the forward reads: the descriptors,
the layout the planner decided (``cp.strategy.BatchLayout``: strategy, local capacity, host maxima), and
where speculative aux rows go.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class BatchInputs:
    extend_lens: list[int]
    prefix_lens: list[int]
    page_rows: list                       # per request, its page ids (int64 arrays)
    ids: list[torch.Tensor]             # per request, its new token ids
    whole_on: list[int] | None = None     # adaptive CP placement (see cp/adaptive.py)
    flat_ids: torch.Tensor | None = None  # ``ids`` concatenated already (one copy instead of a cat)
    state_in: list[int] | None = None     # per-request state slot each request reads (0: none)
    state_out: list[int] | None = None    # the slot its new state is written to (kv/pages.py)
    ids_staged: bool = False              # flat_ids are the graphs' staging ids already (no copy)


@dataclass
class Descriptors:
    packed: torch.Tensor
    extend_lens: torch.Tensor    # [req_cap]   new tokens per request (0 for padding requests)
    prefix_lens: torch.Tensor    # [req_cap]   cached tokens per request
    whole_on: torch.Tensor       # [req_cap]   0: split by the layout; r + 1: whole on CP rank r (adaptive)
    state_in: torch.Tensor       # [req_cap]   per-request state slot read (0: none, zeros)
    state_out: torch.Tensor      # [req_cap]   per-request state slot written (0: the dummy slot)
    page_table: torch.Tensor     # [req_cap, pages_cap] page ids (0 = the reserved dummy page)
    input_ids: torch.Tensor      # [ids_cap]   the batch's new tokens, flattened in request order
    # numpy views of packed, page_table and input_ids (host descriptors) and the column indices, made
    # on the first fill
    _views: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def allocate(cls, req_cap: int, pages_cap: int, ids_cap: int, device: torch.device | str = "cpu",
                 pin: bool = False) -> "Descriptors":
        a, c = 5 * req_cap, 5 * req_cap + req_cap * pages_cap      # five per-request rows first
        packed = torch.zeros(c + ids_cap, dtype=torch.long, device=device, pin_memory=pin)
        per_request = packed[:a].view(5, req_cap).unbind(0)
        return cls(packed, *per_request, packed[a:c].view(req_cap, pages_cap), packed[c:])

    @classmethod
    def for_batch(cls, batch: BatchInputs) -> "Descriptors":
        """Host descriptors sized for one batch (an eager forward builds its metadata on the host)."""
        desc = cls.allocate(len(batch.extend_lens), max(1, max(len(r) for r in batch.page_rows)),
                            max(1, sum(batch.extend_lens)))
        desc.set(batch)
        return desc

    def set(self, batch: BatchInputs, staging: bool = False) -> None:
        """``staging``: these are the graphs' staging descriptors, where validation may have
        concatenated the batch's ids already (``batch.ids_staged``)."""
        in_place = staging and batch.ids_staged
        self.fill(batch.extend_lens, batch.prefix_lens, batch.page_rows, batch.ids, batch.whole_on,
                  None if in_place else batch.flat_ids, (batch.state_in, batch.state_out),
                  ids_given=in_place)

    def fill(self, extend_lens: list[int], prefix_lens: list[int], page_rows: list[list[int]],
             ids: list[torch.Tensor], whole_on: list[int] | None = None,
             flat_ids: torch.Tensor | None = None,
             states: tuple[list[int] | None, list[int] | None] = (None, None),
             ids_given: bool = False) -> None:
        """Host side: write a batch in (the rest is zeroed, so unused rows are empty padding requests).
        No per-request tensor ops: the lengths and the ragged page rows go in through numpy.
        ``ids_given``: the ids are in ``input_ids`` already."""
        if self._views is None:
            table, packed, ids_view = self.page_table.numpy(), self.packed.numpy(), self.input_ids.numpy()
            self._views = (packed, table, ids_view, np.arange(table.shape[1]),
                           packed.shape[0] - ids_view.shape[0], self.extend_lens.shape[0])
        packed, table, ids_view, columns, ids_start, cap = self._views
        packed[:ids_start] = 0           # ids past the batch's are never read (padding rows read row 0)
        n = len(extend_lens)
        packed[:n] = extend_lens
        packed[cap:cap + n] = prefix_lens
        for row, values in ((2, whole_on), (3, states[0]), (4, states[1])):
            if values is not None:
                packed[row * cap:row * cap + n] = values
        widths, m = set(map(len, page_rows)), len(page_rows)
        if len(widths) == 1:          # equal rows (rows are int64 arrays): one block copy
            width = widths.pop()
            if width:
                table[:m, :width] = np.concatenate(page_rows).reshape(m, width)
        else:
            widths = np.fromiter(map(len, page_rows), dtype=np.int64, count=m)
            table[:m][columns < widths[:, None]] = np.concatenate(page_rows)
        if ids_given:
            pass
        elif flat_ids is not None:
            np.copyto(ids_view[:flat_ids.numel()], flat_ids.numpy())
        else:
            torch.cat(ids, out=self.input_ids[:sum(t.numel() for t in ids)])


@dataclass
class ForwardBatch:
    inputs: "Descriptors"                 # device descriptors: lengths, page rows, token ids
    layout: Any         # the batch's cp.strategy.BatchLayout, decided once by the planner
    aux_out: torch.Tensor | None = None  # speculative aux hidden states land here (static when graphed)

"""KV sequence sharding (``--enable-kv-cache-sharding``, SGLang #30501): each page stored once per
CP group, not once per rank.

The page table (``kv/pages.py``) numbers the group's pages 1..C x P (page 0 stays the dummy page);
a logical page is the C consecutive aligned pages ``C*L + 1 .. C*L + C``, one per rank: page ``g``
lives on rank ``(g - 1) % C`` as its local page ``(g - 1) // C + 1``. The allocator hands pages out
in order, so a request's pages and the group's running totals rotate over the ranks and per-rank
counts differ by at most one. ``--max-total-tokens`` stays the per-rank pool (P pages).

The kernels read a per-layer scratch in the group's numbering (one layer of every part, so page
tables and slots need no remapping): before a layer's attention its cached prefix pages are
all-gathered from their owners into the scratch (``prepare``, a graph break: the batch's pages are
host data), the chunk's rows (already all-gathered by the op) are written to the scratch and, on
their owner only, to the persistent pool (the others' rows go to the dummy slot).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from graphcp.distributed.comm import _gather_into, all_gather_into, all_reduce
from graphcp.graph.protocol import graph_break
from graphcp.kv.cache import LayerParts, PagedPool
from graphcp.profiling import nvtx_range


def page_owner(pages, cp_size: int):
    """The CP rank that stores each group page id (>= 1)."""
    return (pages - 1) % cp_size


def local_page(pages, cp_size: int):
    """Each group page id's page in its owner's pool (1..P; 0 is every pool's dummy page)."""
    return (pages - 1) // cp_size + 1


def group_pages(local_pages: int, cp_size: int) -> int:
    """Pages of the group's page table (dummy included) over pools of ``local_pages`` (dummy
    too)."""
    return (local_pages - 1) * cp_size + 1


def owned_slots(slots: torch.Tensor, page_size: int, cp_size: int, cp_rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(group slots -> this rank's pool slots, the dummy slot where another rank owns them; the
    mask of owned ones). Tensor ops only: runs inside captured graphs."""
    page = torch.div(slots, page_size, rounding_mode="floor")
    owned = (page > 0) & (page_owner(page, cp_size) == cp_rank)
    local = local_page(page, cp_size) * page_size + slots % page_size
    return local * owned, owned


def scratch_bytes_per_token(parts: LayerParts, dtype: torch.dtype, cp_size: int) -> int:
    """What the scratch adds per token of a rank's pool: one layer of every part name, C tokens."""
    size = torch.empty((), dtype=dtype).element_size()
    widths = {p.name: p.width for layer in parts.values() for p in layer}
    return cp_size * size * sum(widths.values())


class PrefixPlan:
    """One batch's cached-prefix pages, as the all-gather moves them: the local pages this rank
    sends (padded with the dummy page to the largest rank's count) and where every received page
    lands in the scratch (rank-major, padding to the dummy page)."""

    def __init__(self, rows: list, prefix_lens: list[int], page_size: int, cp_size: int,
                 cp_rank: int, device: torch.device) -> None:
        used = [np.asarray(row, dtype=np.int64)[:-(-n // page_size)]
                for row, n in zip(rows, prefix_lens) if n]
        pages = np.concatenate(used) if used else np.zeros(0, dtype=np.int64)
        owner = page_owner(pages, cp_size)
        counts = np.bincount(owner, minlength=cp_size)
        self.per_rank = counts.tolist()
        width = int(counts.max()) if len(pages) else 0
        dest = np.zeros((cp_size, width), dtype=np.int64)
        for c in range(cp_size):
            dest[c, :counts[c]] = pages[owner == c]
        send = np.zeros(width, dtype=np.int64)
        send[:counts[cp_rank]] = local_page(pages[owner == cp_rank], cp_size)
        self.width = width
        self.send = torch.from_numpy(send).to(device)
        self.dest = torch.from_numpy(dest.reshape(-1)).to(device)


@graph_break(collective=True)
def _gather_prefix(pool: "ShardedPool", layer: int) -> None:
    """Runs eagerly (inside a graph replay too): the live batch's prefix pages of ``layer``."""
    with nvtx_range("kv_prefix_gather"):
        pool.gather_prefix(layer)


class ShardedPool(PagedPool):
    """This rank's pages of every layer (a ``PagedPool`` of P + 1 local pages) and one scratch layer
    per part name in the group's numbering."""

    def __init__(self, parts: LayerParts, local_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup | None, cp_size: int,
                 cp_rank: int) -> None:
        super().__init__(parts, local_pages, page_size, dtype, device)
        self.group, self.cp_size, self.cp_rank = group, cp_size, cp_rank
        self.group_pages = group_pages(local_pages, cp_size)
        shapes = {p.name: p.shape for layer in parts.values() for p in layer}
        slots = self.group_pages * page_size
        self.scratch = {name: torch.zeros((slots,) + shape, dtype=dtype, device=device)
                        for name, shape in shapes.items()}
        self.plan: PrefixPlan | None = None
        self.prefix_gathered_bytes = 0       # every layer's prefix all-gathers so far (received)
        layers = sorted(self.layer_parts)
        self._next_layer = dict(zip(layers, layers[1:]))
        self.overlap = (self.device.type == "cpu" and group is not None
                        and dist.get_backend(group) == "gloo")
        self._ahead: tuple | None = None     # (layer, work, recv, send): a gather started ahead

    # -- what the kernels read: the scratch ------------------------------------------------------
    def part(self, layer: int, name: str) -> torch.Tensor:
        return self.scratch[name]

    def stored(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s persistent storage of part ``name`` on this rank: [local slots, *row]."""
        return super().part(layer, name)

    def write(self, layer: int, name: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Every row to the scratch; the rows whose page this rank owns to its pool too."""
        self.scratch[name].index_copy_(0, slots, rows)
        local, _ = owned_slots(slots, self.page_size, self.cp_size, self.cp_rank)
        self.stored(layer, name).index_copy_(0, local, rows)

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 runs: tuple | None = None) -> None:
        self.write(layer, "k", slots, k)
        self.write(layer, "v", slots, v)

    # -- the cached prefix, per layer ------------------------------------------------------------
    def begin_batch(self, rows: list, prefix_lens: list[int]) -> None:
        self._drain()
        plan = PrefixPlan(rows, prefix_lens, self.page_size, self.cp_size, self.cp_rank,
                          self.device)
        self.plan = plan if plan.width else None

    def prepare(self, layer: int) -> None:
        """Always the break (a capture records it, a replay runs it on the live batch's plan)."""
        _gather_prefix(self, layer)

    def gather_prefix(self, layer: int) -> None:
        """The batch's cached-prefix pages of ``layer`` from their owners into the scratch: one
        all-gather of every part (whole pages: a chunk's rows in the last one are written after).
        On gloo with host tensors the next layer's gather is started here, to run under this
        layer's attention (one layer ahead); NCCL gathers each layer in its break."""
        if self.plan is None:
            return
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == layer:
            _, work, recv, _ = ahead
            work.wait()
        else:
            if ahead is not None:
                ahead[1].wait()
            recv = self._start(layer)[1]
        self.prefix_gathered_bytes += recv.numel() * recv.element_size()
        parts, ps = self.layer_parts[layer], self.page_size
        for part, block in zip(parts, recv.split([p.width for p in parts], dim=2)):
            view = self.scratch[part.name].view(-1, ps, part.width)
            view.index_copy_(0, self.plan.dest, block.contiguous())
        later = self._next_layer.get(layer)
        if self.overlap and later is not None:
            self._ahead = (later, *self._start(later, async_op=True))

    def _start(self, layer: int, async_op: bool = False) -> tuple:
        """(work or None, the receive buffer, the send buffer: kept until the work is done)."""
        plan, ps, parts = self.plan, self.page_size, self.layer_parts[layer]
        send = torch.cat([self.stored(layer, p.name).view(-1, ps, p.width)
                          .index_select(0, plan.send) for p in parts], dim=2).contiguous()
        recv = send.new_empty((self.cp_size * plan.width, ps, send.shape[2]))
        if async_op:
            return _gather_into(recv, send, group=self.group, async_op=True), recv, send
        all_gather_into(recv, send, self.group)
        return None, recv, send

    def _drain(self) -> None:
        """A gather started ahead for a forward that did not reach its layer (it raised):
        finish it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].wait()

    # -- whole caches (engine.kv_cache): every CP rank calls it with the same slots ---------------
    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every part of ``layer`` at group ``slots``, gathered: each owner contributes its rows and
        zeros elsewhere, summed over the CP group (exact: one non-zero term per element)."""
        local, owned = owned_slots(slots, self.page_size, self.cp_size, self.cp_rank)
        parts = self.layer_parts[layer]
        rows = torch.cat([self.stored(layer, p.name).index_select(0, local).reshape(len(slots), -1)
                          for p in parts], dim=1)
        rows = torch.where(owned[:, None], rows, torch.zeros_like(rows))
        all_reduce(rows, self.group)
        blocks = rows.split([p.width for p in parts], dim=1)
        return tuple(b.reshape((len(slots),) + p.shape) for b, p in zip(blocks, parts))

    def usage(self, table) -> dict:
        """This rank's pages in use among the page table's (``kv/pages.PageTable``), its pool's
        pages, and the prefix bytes it has all-gathered."""
        held = [state.pages for state in table.requests.values() if len(state.pages)]
        pages = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
        used = int((page_owner(pages, self.cp_size) == self.cp_rank).sum())
        return {"kv_sharding": True, "kv_pages_used": used, "kv_pages_per_rank": self.num_pages - 1,
                "kv_prefix_gathered_bytes": self.prefix_gathered_bytes}

    def transfer_parts(self, layer: int) -> tuple[torch.Tensor, ...]:
        """What a PD sender reads: this rank's pages (``registered`` is the persistent storage)."""
        return tuple(self.stored(layer, p.name) for p in self.layer_parts[layer])

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * t.element_size() for t in self.scratch.values())

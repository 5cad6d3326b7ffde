"""One rank's half of a KV transfer: its Mooncake engine, with the KV pool registered, writes the rank's
share of a request's cache from the pool pages in place into the receiver's slot.

Who sends what: every CP rank holds the whole (all-gathered) cache of its attention-TP heads, so a pipeline
stage's layers are split over its CP ranks, which send in parallel; attention-TP ranks send their heads;
only the DP group holding the request sends. A layer's parts are the pool's (dense: K and V; DSA: the MLA
rows and, on indexed layers, the indexer keys). Each rank writes its data, then its part of the slot header
(tokens written per layer and head): the receiver sees a request whole only when every part has arrived.
Under KV sharding (``kv/sharding.py``) each CP rank sends the pages it owns of every layer; the CP
ranks agree that all their pages arrived before each marks its layers' header (one all-reduce).
"""
from __future__ import annotations

import threading
import time
from dataclasses import fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from graphcp.config import TORCH_DTYPES, EngineArgs
from graphcp.errors import ConfigError, RequestError, TransferError
from graphcp.kv.cache import PagedPool
from graphcp.kv.layer_split import layer_ranges
from graphcp.kv.pages import RequestKV
from graphcp.kv.sharding import ShardedPool, local_page, page_owner
from graphcp.models.config import ModelConfig
from graphcp.pd.layout import SlotLayout, layout_for, parse_destination

if TYPE_CHECKING:
    from graphcp.distributed.parallel import RankParallel
    from graphcp.planner import Planner
from graphcp.pd.mooncake import start_engine


class KVSender:
    """``pool`` gives each layer's parts (``transfer_parts``) and the memory to register (``registered``),
    dense or DSA alike; ``model_config`` (``read_model_config``) gives the layout the destination must have."""

    def __init__(self, pool: PagedPool, model_config: ModelConfig, stage_layers: range, cp_size: int,
                 cp_rank: int, attn_tp_rank: int, protocol: str, timeout_s: float,
                 host: str = "127.0.0.1") -> None:
        self.pool, self.protocol, self.timeout_s = pool, protocol, timeout_s
        registered = [t for t in pool.registered() if t.numel()]       # a DSA model may index no layer
        self.model = layout_for(model_config, 1, _dtype_name(registered[0].dtype))
        mine = layer_ranges(len(stage_layers), cp_size)[cp_rank]      # the LayerSplit ranges, split or not
        self.layers = range(stage_layers.start + mine.start, stage_layers.start + mine.stop)
        # the layers whose data this rank sends: its header's, or (sharded) every layer's pages
        self.sharded = isinstance(pool, ShardedPool)
        self.data_layers = stage_layers if self.sharded else self.layers
        # Header columns this rank marks: the KV heads of its attention-TP rank (dense), the one MLA row (DSA).
        first = pool.transfer_parts(stage_layers.start)[0]
        columns = _row_bytes(first) * self.model.num_kv_heads // self.model.row_bytes(stage_layers.start, 0)
        self.columns = range(attn_tp_rank * columns, (attn_tp_rank + 1) * columns)
        self.engine = start_engine(protocol, host, timeout_s=timeout_s)
        self.header = torch.zeros(max(1, len(self.layers)), columns, dtype=torch.int64)
        for t in (*registered, self.header):
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise ConfigError(f"--disaggregation-mode prefill: Mooncake could not register "
                                  f"{t.numel() * t.element_size()} bytes of KV pool memory")

    def send(self, rid: str, state: RequestKV, destination: dict) -> dict:
        """Write this rank's layers and heads of ``rid``; returns bytes moved and seconds taken."""
        layout, dest = parse_destination(rid, destination)
        self._check(rid, layout, dest, state.cached_len)
        if not self.data_layers:
            return {"bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        src, dst, lengths = self._writes(layout, dest["data_addr"], state)
        if self.sharded:
            self._write_sharded(rid, dest["session"], src, dst, lengths)
        else:
            self.write(rid, dest["session"], src, dst, lengths, "KV pages")
        if not self.layers:
            return {"bytes": sum(lengths), "seconds": time.perf_counter() - start}
        self.header.fill_(state.cached_len)
        row = self.header.shape[1] * 8
        marks = [(self.header.data_ptr() + i * row, dest["header_addr"] + layout.header_offset(layer, self.columns[0]))
                 for i, layer in enumerate(self.layers)]
        self.write(rid, dest["session"], [s for s, _ in marks], [d for _, d in marks], [row] * len(marks), "header")
        return {"bytes": sum(lengths), "seconds": time.perf_counter() - start}

    def _check(self, rid: str, layout: SlotLayout, dest: dict, cached_len: int) -> None:
        """The destination's layout is the engine's model's (but for max_tokens), key by key."""
        mine = replace(self.model, max_tokens=layout.max_tokens)
        for key in (f.name for f in fields(SlotLayout)):
            if getattr(mine, key) != getattr(layout, key):
                raise RequestError(f"request {rid!r}: destination[{key!r}] is {dest[key]!r}, the engine's model has "
                                   f"{getattr(mine, key)!r}; the receiver must load the same checkpoint (and dtype)")
        if dest["protocol"] != self.protocol:
            raise RequestError(f"request {rid!r}: destination['protocol'] is {dest['protocol']!r}, the engine sends "
                               f"over {self.protocol!r} (--disaggregation-transfer-protocol)")
        if cached_len > layout.max_tokens:
            raise RequestError(f"request {rid!r}: {cached_len} cached tokens exceed destination['max_tokens'] "
                               f"{layout.max_tokens}")

    def _write_sharded(self, rid: str, session: str, src: list, dst: list, lengths: list) -> None:
        """This rank's pages, then the CP group's agreement that every rank's arrived (a rank whose
        write failed raises its own error; its peers name it as another rank's)."""
        error = None
        try:
            if src:                     # a short request may have no page on this rank
                self.write(rid, session, src, dst, lengths, "KV pages")
        except TransferError as e:
            error = e
        pool = self.pool
        ok = torch.tensor([0 if error else 1], dtype=torch.int64)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=pool.group)
        if error is not None:
            raise error
        if not int(ok):
            raise TransferError(f"request {rid!r}: another CP rank's write of its KV pages failed; "
                                "the KV stays cached until released")

    def _writes(self, layout: SlotLayout, data_addr: int, state: RequestKV) -> tuple[list, list, list]:
        """(source, target, length) of every write, read in place from the pool's pages; a page of a part
        is one write when this rank holds the whole row, else one write per token (its heads of the
        row). Sharded: only the pages this rank owns, from their places in its pool."""
        ps, n = self.pool.page_size, state.cached_len
        pages = np.asarray(state.pages)[:-(-n // ps)]
        index = np.arange(len(pages))
        if self.sharded:
            cp, me = self.pool.cp_size, self.pool.cp_rank
            mine = page_owner(pages, cp) == me
            index, pages = index[mine], local_page(pages[mine], cp)
        src, dst, lengths = [], [], []
        for layer in self.data_layers:
            for part, rows in enumerate(self.pool.transfer_parts(layer)):
                base, local_row = rows.data_ptr(), _row_bytes(rows)
                whole = local_row == layout.row_bytes(layer, part)
                for i, page in zip(index.tolist(), pages.tolist()):
                    tokens = range(i * ps, min(n, (i + 1) * ps))
                    if whole:
                        _append(src, dst, lengths, base + page * ps * local_row,
                                data_addr + layout.row_offset(layer, part, tokens.start), len(tokens) * local_row)
                        continue
                    for j, t in enumerate(tokens):
                        _append(src, dst, lengths, base + (page * ps + j) * local_row,
                                data_addr + layout.row_offset(layer, part, t, self.columns[0]), local_row)
        return src, dst, lengths

    def write(self, rid: str, session: str, src: list, dst: list, lengths: list, what: str) -> None:
        """One batch of Mooncake writes, waited for at most the transfer timeout. Mooncake bounds a stalled
        data stream itself, but not its handshake with a peer that accepts and never answers (a frozen
        process): that call is left behind in its thread, which ends when the peer's socket closes."""
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(
            self.engine.batch_transfer_sync_write(session, src, dst, lengths)), name="graphcp-kv-send", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not result:
            raise TransferError(f"request {rid!r}: Mooncake write of {what} to {session} did not complete within "
                                f"{self.timeout_s:g} s (--disaggregation-transfer-timeout); the KV stays cached "
                                f"until released")
        code = result[0]
        if code != 0:
            raise TransferError(f"request {rid!r}: Mooncake write of {what} ({sum(lengths)} bytes in {len(src)} "
                                f"pieces) to {session} failed with code {code}; the KV stays cached until released")


def _append(src: list, dst: list, lengths: list, s: int, d: int, n: int) -> None:
    """Add a write, merged into the last one when both ends continue it (consecutive pages)."""
    if src and src[-1] + lengths[-1] == s and dst[-1] + lengths[-1] == d:
        lengths[-1] += n
        return
    src.append(s)
    dst.append(d)
    lengths.append(n)


def _row_bytes(rows: torch.Tensor) -> int:
    """One token's row of a part [slots, ...]."""
    return rows[0].numel() * rows.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in TORCH_DTYPES.items() if d == dtype)


def start_sender(args: EngineArgs, model_config: ModelConfig, pool: PagedPool,
                 par: "RankParallel") -> KVSender | None:
    """The rank's sender in prefill mode (None otherwise); started once, after the KV pool exists. ``par``
    is the rank's ``RankParallel`` (its stage's layers, its CP and attention-TP ranks)."""
    if args.disaggregation_mode != "prefill":
        return None
    host = "127.0.0.1"
    if args.disaggregation_bootstrap_port is not None:      # decode workers elsewhere reach this engine
        from graphcp.pd.sglang.bootstrap import local_ip
        host = local_ip()
    return KVSender(pool, model_config, par.layers, args.cp_size, par.me.cp_rank, par.me.attn_tp_rank,
                    args.resolved_transfer_protocol(), args.disaggregation_transfer_timeout_s, host)


def transfer_kv(planner: "Planner", sender: KVSender | None, rid: str, destination: dict) -> dict | None:
    """The ``transfer_kv`` command on one rank (``planner`` knows the request's pages): None on ranks
    whose DP group does not hold ``rid``."""
    if sender is None:
        raise ConfigError("transfer_kv needs --disaggregation-mode prefill")
    if planner.owner(rid) is None:
        raise RequestError(f"request {rid!r} is unknown: it holds no cached KV")
    state = planner.pages.requests.get(rid)
    if state is None:
        return None
    return sender.send(rid, state, destination)


def merge_reports(replies: list) -> dict:
    """One answer from every rank's report: total bytes, and the slowest rank's time (they send at once)."""
    sent = [r for r in replies if r is not None]
    return {"bytes": sum(r["bytes"] for r in sent), "seconds": max((r["seconds"] for r in sent), default=0.0),
            "ranks": sum(1 for r in sent if r["bytes"])}

"""The DeepSeek V4 attention op the V4 layers call through the forward context:
``op(layer, q, kv, *compressor_rows, sinks, scale, compressors, index)``, and its cache layout.

Every part is per token, in the paged pool: the K = V row of each token (the sliding branch reads
the last ``sliding_window`` of them), each compressor's kv | gate projections of each token (an open
window and the overlap a CSA entry pools from the previous window are the last rows of a request's
tokens, so chunked prefill needs no other state), and each compressor's entry (CSA: also the indexer
key), written at the slot of the last token of the window it pools. The entry rows of other slots
are never read.

Per layer, on one rank or under interleave CP: the new rows of every part travel in one all-gather
(rank-major, padded) and are written to every rank's pool at their slots (``meta.gather_slots``), so
every rank holds the whole cache; every rank then pools every window this batch closes, on the
full-order rows. Each rank scores the indexer and attends for its own queries only: the keys of
its sliding window and the compressed entries whose window has closed (HCA: all of them, CSA: the
indexer's ``index_topk`` best) in one softmax with the per-head sinks. The windows closing in a
batch and the top-k have data-dependent shapes: V4 layers run eagerly, as DSA's."""
from __future__ import annotations

from typing import Callable

import torch

from graphcp.attention.context import AttentionContext
from graphcp.kernels.dsa_torch import key_slots, select_topk
from graphcp.kernels.v4_torch import attend_with_sinks
from graphcp.kv.cache import CachePart
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from graphcp.profiling import nvtx_range

# Query rows run in chunks whose gathered keys (and indexer scores) hold at most this many elements.
CHUNK_ELEMENTS = 2**24
GRAPH_REASON = ("DeepSeek V4 runs eagerly (the compressor windows a batch closes and the indexer "
                "top-k have data-dependent shapes, as DSA)")


class V4SlidingAttention:
    """A sliding-window layer; the CSA and HCA ops below add their compressors' parts."""

    compressed: tuple[tuple[str, str], ...] = ()      # per compressor: (its rows part, its entries)

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx, self.pool, self.meta = ctx, ctx.pool, ctx.meta
        v4, meta = DeepseekV4Config.of(ctx.cfg), ctx.meta
        self.window, self.topk = v4.sliding_window, v4.index_topk
        rows = torch.arange(meta.local_cap, device=meta.positions.device)
        seq = torch.searchsorted(meta.cu_seqlens_q[1:].contiguous(), rows, right=True)
        self.row_seq = seq.clamp(max=meta.page_rows.shape[0] - 1)
        self.seq_slots = key_slots(meta.page_rows, self.pool.page_size)     # [S, K]
        offsets = torch.arange(1 - self.window, 1, device=rows.device)
        window = meta.positions[:, None] + offsets                          # [B, W] positions
        self.window_seen = (window >= 0) & meta.valid.bool()[:, None]
        self.window_slots = self.seq_slots[self.row_seq[:, None], window.clamp(min=0)]

    def __call__(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor, *rows: torch.Tensor,
                 sinks: torch.Tensor, scale: float, compressors: tuple = (),
                 index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, D] and kv [T, D] (rotated), ``rows``: each compressor's kv | gate rows [T, 2w]
        with the compressor modules (``Compressor.entries``); index (CSA): the indexer's queries
        [T, Hi, Di] and head weights [T, Hi] -> [T, H, D]."""
        pool, meta = self.pool, self.meta
        pool.prepare(layer_id)       # LayerSplit: a non-owned layer's cached prefix from its owner
        names = ("kv",) + tuple(raw for raw, _ in self.compressed)
        widths = [kv.shape[-1]] + [r.shape[-1] for r in rows]
        full = self.ctx.all_gather(torch.cat([kv, *rows], dim=-1))          # one collective
        for name, block in zip(names, full.split(widths, dim=-1)):
            pool.write(layer_id, name, meta.gather_slots, block)
        for (raw, entries), compressor in zip(self.compressed, compressors):
            self._close_windows(layer_id, raw, entries, compressor)
        return self._attend(layer_id, q, sinks, scale, compressors, index)

    def _close_windows(self, layer: int, raw: str, entries: str,
                       compressor: torch.nn.Module) -> None:
        """Pool every window whose last token is new in this batch (any rank's), from the pool's
        rows of its ``span`` tokens, and write its entry at that token's slot."""
        meta, pool, rate = self.meta, self.pool, compressor.rate
        pos = meta.gather_positions
        ends = torch.nonzero((meta.gather_token_index >= 0) & ((pos + 1) % rate == 0)).squeeze(1)
        if ends.numel() == 0:
            return
        last = pos.index_select(0, ends)
        window = last[:, None] + torch.arange(1 - compressor.span, 1, device=last.device)
        requests = meta.gather_requests.index_select(0, ends)
        slots = self.seq_slots[requests[:, None], window.clamp(min=0)]
        rows = pool.part(layer, raw)[pool.map_slots(layer, slots)]
        pooled = compressor.entries(rows, window >= 0, (last + 1) // rate - 1)
        pool.write(layer, entries, meta.gather_slots.index_select(0, ends), pooled)

    def _attend(self, layer: int, q: torch.Tensor, sinks: torch.Tensor, scale: float,
                compressors: tuple, index: tuple | None) -> torch.Tensor:
        pool, dim = self.pool, q.shape[-1]
        kv = pool.part(layer, "kv")
        window_slots = pool.map_slots(layer, self.window_slots)
        entry_slots, limits, keys, scored = None, None, self.window, None
        if compressors:
            rate = compressors[0].rate
            entry_slots = pool.map_slots(layer, self.seq_slots[:, rate - 1::rate].contiguous())
            limits = (self.meta.positions + 1) // rate * self.meta.valid
            entries = pool.part(layer, self.compressed[0][1])
            keys += min(entry_slots.shape[1], self.topk) if index else entry_slots.shape[1]
            scored = (entry_slots.shape[1], index[0].shape[-1]) if index else None
        step, score_step, attend_step = v4_row_chunks(self.ctx.kernels.dsa.row_chunk, keys, dim,
                                                      scored)
        out = []
        with nvtx_range("attention"):
            for start in range(0, q.shape[0], step):
                rows = slice(start, min(start + step, q.shape[0]))
                if compressors:
                    chosen, shown = self._entries(layer, rows, entry_slots, limits, index,
                                                  score_step)
                for sub in range(rows.start, rows.stop, attend_step):
                    part = slice(sub, min(sub + attend_step, rows.stop))
                    gathered, seen = kv[window_slots[part]], self.window_seen[part]
                    if compressors:
                        mine = slice(part.start - start, part.stop - start)
                        gathered = torch.cat([gathered, entries[chosen[mine]]], dim=1)
                        seen = torch.cat([seen, shown[mine]], dim=1)
                    out.append(attend_with_sinks(q[part], gathered, seen, sinks, scale))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _entries(self, layer: int, rows: slice, entry_slots: torch.Tensor, limits: torch.Tensor,
                 index: tuple | None, score_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry slots each query row attends and which of them it may see: every closed window
        (HCA), or the indexer's top-k of them (CSA), scored ``score_step`` rows a call."""
        if index is None:
            seq, limit = self.row_seq[rows], limits[rows]
            count = entry_slots.shape[1]
            shown = torch.arange(count, device=limit.device)[None, :] < limit[:, None]
            return entry_slots.index_select(0, seq), shown
        index_q, weights = index
        keys, parts = self.pool.part(layer, "index_k"), []
        with nvtx_range("v4_indexer"):
            for start in range(rows.start, rows.stop, score_step):
                part = slice(start, min(start + score_step, rows.stop))
                seq, limit = self.row_seq[part], limits[part]
                scores = self.ctx.kernels.dsa.indexer_scores(index_q[part], weights[part], keys,
                                                             entry_slots, seq, limit)
                parts.append(select_topk(scores, entry_slots, seq, limit, self.topk))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def v4_row_chunks(scoring_chunk: Callable[[int, int], int], keys: int, dim: int,
                  scored: tuple[int, int] | None) -> tuple[int, int, int]:
    """(rows per step, per indexer call, per attention call). The torch attention gathers
    [rows, keys, dim]: CHUNK_ELEMENTS of them a call. The indexer's calls are sized by the kernel
    that scores (``scoring_chunk(entries, index_dim)``, the DSA kernels' ``row_chunk``): the torch
    form gathers [rows, entries, index_dim], the Triton kernel only writes [rows, entries] scores,
    so at 32K entries it takes 512 rows a call where the torch form takes 4. A step covers the
    larger of the two, so neither loop runs more calls than its own size needs."""
    attend = max(1, CHUNK_ELEMENTS // (keys * dim))
    if scored is None:
        return attend, attend, attend
    score = max(1, scoring_chunk(*scored))
    return max(attend, score), score, attend


class V4HCAAttention(V4SlidingAttention):
    compressed = (("hca_rows", "entries"),)


class V4CSAAttention(V4SlidingAttention):
    compressed = (("csa_rows", "entries"), ("index_rows", "index_k"))


# -- the cache layout (attention/kinds.py) ------------------------------------------------------
def v4_parts(cfg: ModelConfig, layer: int, attn_tp: int) -> tuple[CachePart, ...]:
    """Per token: K = V; HCA its compressor's kv | gate (2 x head_dim) and entry; CSA its
    overlapping compressor's (4 x head_dim) and entry, the indexer's (4 x index_head_dim) and
    key."""
    v4, d = DeepseekV4Config.of(cfg), cfg.head_dim
    kind, parts = v4.layer_types[layer], [CachePart("kv", (d,))]
    if kind == HCA:
        parts += [CachePart("hca_rows", (2 * d,)), CachePart("entries", (d,))]
    elif kind == CSA:
        di = v4.index_head_dim
        parts += [CachePart("csa_rows", (4 * d,)), CachePart("entries", (d,)),
                  CachePart("index_rows", (4 * di,)), CachePart("index_k", (di,))]
    return tuple(parts)


def v4_export(cfg: ModelConfig, rows: tuple[torch.Tensor, ...]) -> tuple:
    """A layer's rows [n, ...] per part -> (kv [n, head_dim], entries [n // rate, head_dim],
    index_k [n // rate, index_head_dim], compressor_rows [n, 2 x width], indexer_rows
    [n, 4 x index_head_dim]), None where the layer has no such part; fp32 on the CPU."""
    rows = tuple(r.float().cpu() for r in rows)
    kv, n = rows[0], rows[0].shape[0]
    if len(rows) == 1:
        return kv, None, None, None, None
    kinds = DeepseekV4Config.of(cfg).layer_types
    kind = CSA if len(rows) == 5 else HCA
    rate = DeepseekV4Config.of(cfg).compress_rates[kinds.index(kind)]
    ends = slice(rate - 1, n // rate * rate, rate)       # entry e sits at token (e + 1) * rate - 1
    if kind == HCA:
        return kv, rows[2][ends], None, rows[1], None
    return kv, rows[2][ends], rows[4][ends], rows[1], rows[3]

"""The DeepSeek V4 attention op the V4 layers call through the forward context, over explicit
per-request caches (``V4LayerState``: torch tensors per request and layer; the paged pool comes
with the engine integration).

Per layer, one rank or one rank of interleave CP (flat token t on rank t % C): the new rows every
part of the cache needs (the shared K = V row, the compressor's and the indexer's kv | gate
projections) travel in one all-gather, in token order; every rank then extends each request's
sliding window and runs its compressors on the full-order rows (so every rank holds the whole
cache), and scores the indexer and attends for its own queries only."""
from __future__ import annotations

from collections.abc import Callable

import torch

from graphcp.cp import build_layout
from graphcp.dist.comm import all_gather_into
from graphcp.kernels import dsa_torch
from graphcp.kernels.v4_torch import attend_with_sinks
from graphcp.models.deepseek_v4_attention import V4Attention, V4LayerState, V4Rows
from graphcp.models.deepseek_v4_config import CSA


def extend_layer(layer: V4Attention, state: V4LayerState, rows: torch.Tensor
                 ) -> tuple[V4LayerState, torch.Tensor, int]:
    """One request's new full-order rows ``[kv | compressor | indexer]`` -> (its new state, the
    keys its new queries may see in the sliding branch, the position of the first of them)."""
    kv, comp, index = _split(layer, rows)
    keys = torch.cat([state.window, kv])
    first = state.length - state.window.shape[0]
    keep = min(layer.window - 1, keys.shape[0])
    compressor = state.compressor
    if layer.compressor is not None:
        compressor = layer.compressor.compress(comp, state.compressor)
    indexer = layer.compressor.indexer.compress(index, state.indexer) if layer.kind == CSA else None
    new = V4LayerState(state.length + kv.shape[0], keys[keys.shape[0] - keep:], compressor, indexer)
    return new, keys, first


def attend_layer(layer: V4Attention, state: V4LayerState, q: torch.Tensor,
                 positions: torch.Tensor, keys: torch.Tensor, first: int,
                 index_q: torch.Tensor | None, index_weights: torch.Tensor | None) -> torch.Tensor:
    """Queries [B, H, D] of one request at ``positions`` [B], after ``extend_layer``: the keys of
    the last ``sliding_window`` positions and the compressed entries whose window has closed
    (HCA: all of them; CSA: the indexer's ``index_topk`` best) in one softmax with the sinks."""
    rows = q.shape[0]
    key_pos = torch.arange(keys.shape[0], device=q.device) + first
    seen = key_pos[None, :] <= positions[:, None]
    visible = seen & (key_pos[None, :] > positions[:, None] - layer.window)
    keys = keys.expand(rows, -1, -1)
    if layer.compressor is not None and state.compressor.entries.shape[0]:
        entries = state.compressor.entries
        count = entries.shape[0]
        limits = (positions + 1) // layer.rate          # entries whose window has closed
        if layer.kind == CSA:
            slots = torch.arange(count, device=q.device)[None]
            row_seq = torch.zeros_like(positions)
            scores = dsa_torch.indexer_scores(index_q, index_weights, state.indexer.entries, slots,
                                              row_seq, limits)
            picked, shown = dsa_torch.select_topk(scores, slots, row_seq, limits, layer.topk)
            chosen = entries[picked]
        else:
            chosen = entries.expand(rows, -1, -1)
            shown = torch.arange(count, device=q.device)[None, :] < limits[:, None]
        keys, visible = torch.cat([keys, chosen], dim=1), torch.cat([visible, shown], dim=1)
    return attend_with_sinks(q, keys, visible, layer.sinks, layer.scale)


def _split(layer: V4Attention, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    widths = [layer.head_dim, 0, 0]
    if layer.compressor is not None:
        widths[1] = 2 * layer.compressor.width
    if layer.kind == CSA:
        widths[2] = 2 * layer.compressor.indexer.width
    return rows.split(widths, dim=-1)


class V4ReferenceAttention:
    """The op of one forward: ``caches[rid]`` (a list over layers, grown here) for each request
    of the batch, whose new tokens are ``extend_lens`` in batch order; ``local_index``: the flat
    indices of this rank's tokens (all of them on one rank); ``gather``: this rank's rows -> every
    token's rows in batch order (None on one rank)."""

    def __init__(self, caches: dict[str, list[V4LayerState]], rids: list[str],
                 extend_lens: list[int], local_index: torch.Tensor | None = None,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.caches, self.rids, self.extend_lens = caches, rids, extend_lens
        self.starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
        total = sum(extend_lens)
        self.local_index = torch.arange(total) if local_index is None else local_index.cpu()
        self.gather = gather
        request = torch.repeat_interleave(torch.arange(len(rids)), torch.tensor(extend_lens))
        self.local_request = request[self.local_index]

    def __call__(self, layer_id: int, layer: V4Attention, rows: V4Rows) -> torch.Tensor:
        parts = [rows.kv] + [p for p in (rows.compressor, rows.indexer) if p is not None]
        mine = torch.cat(parts, dim=-1)
        full = mine if self.gather is None else self.gather(mine)
        out = torch.zeros_like(rows.q)
        for r, rid in enumerate(self.rids):
            states = self.caches.setdefault(rid, [])
            if len(states) == layer_id:
                states.append(layer.empty_state(rows.kv))
            state = states[layer_id]
            start, count = self.starts[r], self.extend_lens[r]
            states[layer_id], keys, first = extend_layer(layer, state, full[start:start + count])
            local = (self.local_request == r).nonzero().squeeze(1).to(rows.q.device)
            if local.numel() == 0:
                continue
            positions = state.length + self.local_index.to(local.device)[local] - start
            index_q = None if rows.index_q is None else rows.index_q[local]
            weights = None if rows.index_weights is None else rows.index_weights[local]
            out[local] = attend_layer(layer, states[layer_id], rows.q[local], positions, keys,
                                      first, index_q, weights)
        return out


class InterleaveGather:
    """Interleave CP's gather of new rows: every rank's rows (padded to the largest rank), one
    all-gather, put back in batch order."""

    def __init__(self, group, cp_size: int, extend_lens: list[int]) -> None:  # noqa: ANN001
        layouts = [build_layout("interleave", cp_size, r, extend_lens) for r in range(cp_size)]
        self.group, self.cp_size = group, cp_size
        self.cap = max(len(lay.local_indices) for lay in layouts)
        order = [i for lay in layouts for i in lay.local_indices]
        self.order = torch.tensor(order, dtype=torch.long)
        self.held = torch.cat([torch.arange(len(lay.local_indices)) + r * self.cap
                               for r, lay in enumerate(layouts)])
        self.total = sum(extend_lens)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        padded = rows.new_zeros((self.cap,) + rows.shape[1:])
        padded[:rows.shape[0]] = rows
        gathered = rows.new_empty((self.cp_size * self.cap,) + rows.shape[1:])
        all_gather_into(gathered, padded, self.group)
        full = rows.new_empty((self.total,) + rows.shape[1:])
        full[self.order.to(rows.device)] = gathered[self.held.to(rows.device)]
        return full

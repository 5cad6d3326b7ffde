"""The DSA attention op the MLA layers call through the forward context:
``op(layer, q, mla_rows, index=(queries, weights, keys) or None)``.

Per layer, under interleave CP: one all-gather of the new MLA rows ``[kv_latent | k_rope]`` and one
of the new indexer keys (padded to the largest rank, rank-major), each written to every rank's paged
cache at the rows' slots (``meta.gather_slots``: the slots restore token order; padding rows go to
the dummy slot). Then each rank scores the indexer and runs sparse attention for its own queries
only: top-k indices never leave the rank. A layer without an indexer (GLM-5 "shared") reuses the
previous layer's selection, which this op keeps for the forward."""
from __future__ import annotations

import torch

from graphcp.attention.context import AttentionContext
from graphcp.kernels.dsa_torch import key_slots, select_topk
from graphcp.models.deepseek.config import MLAConfig
from graphcp.models.deepseek.rope import softmax_scale
from graphcp.profiling import nvtx_range


class DSAAttention:
    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx, self.pool, self.meta = ctx, ctx.pool, ctx.meta
        self.kernels = ctx.kernels.dsa
        d, meta = MLAConfig.of(ctx.cfg), ctx.meta
        self.topk, self.latent_dim, self.scale = d.index_topk, d.kv_lora_rank, softmax_scale(ctx.cfg)
        rows = torch.arange(meta.local_cap, device=meta.q_limits.device)
        seq = torch.searchsorted(meta.cu_seqlens_q[1:].contiguous(), rows, right=True)
        self.row_seq = seq.clamp(max=meta.page_rows.shape[0] - 1)
        self.seq_slots = key_slots(meta.page_rows, self.pool.page_size)    # [S, K] each sequence's keys
        keys, width = self.seq_slots.shape[1], d.kv_lora_rank + d.qk_rope_head_dim
        # Query rows in chunks sized by the kernel in use (its largest per-chunk intermediate).
        self.score_chunk = self.kernels.row_chunk(keys, d.index_head_dim)
        self.attend_chunk = self.kernels.row_chunk(min(keys, self.topk), width)
        self.selected: tuple[torch.Tensor, torch.Tensor] | None = None

    def _select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                seq_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's top-k for every local query row, scored a chunk of rows at a time."""
        parts = []
        for start in range(0, q.shape[0], self.score_chunk):
            rows = slice(start, start + self.score_chunk)
            seq, limits = self.row_seq[rows], self.meta.q_limits[rows]
            scores = self.kernels.indexer_scores(q[rows], weights[rows], keys, seq_slots, seq, limits)
            parts.append(select_topk(scores, seq_slots, seq, limits, self.topk))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def __call__(self, layer_id: int, q: torch.Tensor, mla_rows: torch.Tensor,
                 index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, latent + rope] (absorbed), mla_rows [T, latent + rope] (``[kv_latent | k_rope]``),
        index (queries, weights, keys) or None on a shared layer -> latent outputs [T, H, latent]."""
        meta, pool, ctx = self.meta, self.pool, self.ctx
        pool.prepare(layer_id)          # LayerSplit: a non-owned layer's cached prefix comes from its owner
        pool.write(layer_id, "mla", meta.gather_slots, ctx.all_gather(mla_rows))
        if index is not None:
            index_q, weights, index_k = index
            pool.write(layer_id, "index_k", meta.gather_slots, ctx.all_gather(index_k))
            seq_slots = pool.map_slots(layer_id, self.seq_slots)       # the layer's storage numbering
            with nvtx_range("dsa_indexer"):
                selected, visible = self._select(index_q, weights, pool.part(layer_id, "index_k"), seq_slots)
            self.selected = (pool.unmap_slots(layer_id, selected), visible)   # kept in engine slots
        if self.selected is None:
            raise RuntimeError(f"layer {layer_id} reuses the previous top-k, but no layer before "
                               "it ran one")
        selected, visible = self.selected
        selected = pool.map_slots(layer_id, selected)
        kv, step, parts = pool.part(layer_id, "mla"), self.attend_chunk, []
        with nvtx_range("attention"):
            for start in range(0, q.shape[0], step):
                rows = slice(start, start + step)
                parts.append(self.kernels.sparse_mla(q[rows], kv, selected[rows], visible[rows],
                                                     self.scale, self.latent_dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

"""The DSA attention op the MLA layers call through the forward context.

Per layer, under interleave CP: one all-gather of the new MLA rows ``[kv_latent | k_rope]`` and one
of the new indexer keys (padded to the largest rank, rank-major), each written to every rank's paged
cache at the rows' slots (``meta.gather_slots``: the slots restore token order; padding rows go to
the dummy slot). Then each rank scores the indexer and runs sparse attention for its own queries
only: top-k indices never leave the rank. A layer without an indexer (GLM-5 "shared") reuses the
previous layer's selection, which this op keeps for the forward."""
from __future__ import annotations

import functools
import logging

import torch

from graphcp.kernels import dsa_torch
from graphcp.kernels.dsa_torch import key_slots, select_topk
from graphcp.kernels.registry import triton_available
from graphcp.cp.metadata import CPMetadata
from graphcp.dist.comm import CPComm
from graphcp.kv.dsa_cache import DSAPool
from graphcp.models.config import ModelConfig
from graphcp.models.dsa_rope import softmax_scale
from graphcp.profiling import nvtx_range

log = logging.getLogger("graphcp")


@functools.cache
def dsa_kernels(requested: str, device: torch.device):
    """``indexer_scores`` and ``sparse_mla``: Triton on CUDA (auto) or when asked (the interpreter
    on CPU); the torch reference otherwise. On CUDA the Triton pair is checked once against the
    torch pair; one that fails or disagrees is replaced by the torch pair with a warning."""
    wants = requested == "triton" or (requested == "auto" and device.type == "cuda")
    if not wants or not triton_available(device):
        return dsa_torch
    from graphcp.kernels import triton_dsa
    if device.type != "cuda":
        return triton_dsa
    try:
        err = max(_probe(triton_dsa, device, dtype) for dtype in (torch.float32, torch.bfloat16))
        reason = None if err <= 2e-2 else f"differs from the torch form (rel err {err:.1e})"
    except Exception as e:  # noqa: BLE001 - any compile or launch failure falls back
        reason = f"failed: {type(e).__name__}: {e}"
    if reason is None:
        return triton_dsa
    log.warning("graphcp: the Triton DSA kernels %s; using the torch kernels", reason)
    return dsa_torch


def _probe(kernels, device: torch.device, dtype: torch.dtype) -> float:
    """Both kernels once on small random inputs; the worst relative error against the torch form."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, weights, keys, kv = rand(3, 16, 64), rand(3, 16).float(), rand(40, 64), rand(40, 96)
    slots = torch.randperm(40, generator=gen)[:32].view(2, 16).to(device)       # two sequences
    row_seq = torch.tensor([0, 1, 1], device=device)
    limits = torch.tensor([16, 5, 0], device=device)
    errs = []
    scores = dsa_torch.indexer_scores(q, weights, keys, slots, row_seq, limits)
    got = kernels.indexer_scores(q, weights, keys, slots, row_seq, limits)
    seen = torch.isfinite(scores)
    errs.append(_rel(got[seen], scores[seen]) if torch.equal(seen, torch.isfinite(got)) else 1.0)
    selected, visible = select_topk(scores, slots, row_seq, limits, 8)
    q_mla = rand(3, 8, 96)
    want = dsa_torch.sparse_mla(q_mla, kv, selected, visible, 0.1, 64)
    errs.append(_rel(kernels.sparse_mla(q_mla, kv, selected, visible, 0.1, 64), want))
    return max(errs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


class DSAAttention:
    def __init__(self, pool: DSAPool, meta: CPMetadata, comm: CPComm | None, cfg: ModelConfig,
                 kernel: str = "auto") -> None:
        self.pool, self.meta, self.comm = pool, meta, comm
        self.kernels = dsa_kernels(kernel, pool.device)
        d = cfg.dsa
        self.topk, self.latent_dim, self.scale = d.index_topk, d.kv_lora_rank, softmax_scale(cfg)
        rows = torch.arange(meta.local_cap, device=meta.q_limits.device)
        seq = torch.searchsorted(meta.cu_seqlens_q[1:].contiguous(), rows, right=True)
        self.row_seq = seq.clamp(max=meta.page_rows.shape[0] - 1)
        self.seq_slots = key_slots(meta.page_rows, pool.page_size)    # [S, K] each sequence's keys
        keys, width = self.seq_slots.shape[1], d.kv_lora_rank + d.qk_rope_head_dim
        self.score_chunk = self.kernels.row_chunk(keys, d.index_head_dim)       # rows per call,
        self.attend_chunk = self.kernels.row_chunk(min(keys, self.topk), width)  # sized by the kernel
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

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        if self.meta.cp_size == 1:
            return rows
        out = rows.new_empty((self.meta.cp_size * rows.shape[0],) + rows.shape[1:])
        return self.comm.all_gather(out, rows.contiguous())

    def __call__(self, layer_id: int, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """q [T, H, latent + rope] (absorbed), latent [T, C], k_rope [T, R], index (queries,
        weights, keys) or None on a shared layer -> latent outputs [T, H, C]."""
        meta, pool = self.meta, self.pool
        pool.prepare(layer_id)          # LayerSplit: a non-owned layer's cached prefix comes from its owner
        pool.write(layer_id, meta.gather_slots, self._gather(torch.cat([latent, k_rope], dim=-1)))
        if index is not None:
            index_q, weights, index_k = index
            pool.write_index(layer_id, meta.gather_slots, self._gather(index_k))
            seq_slots = pool.map_slots(layer_id, self.seq_slots)       # the layer's storage numbering
            with nvtx_range("dsa_indexer"):
                selected, visible = self._select(index_q, weights, pool.index_keys(layer_id), seq_slots)
            self.selected = (pool.unmap_slots(layer_id, selected), visible)   # kept in engine slots
        if self.selected is None:
            raise RuntimeError(f"layer {layer_id} reuses the previous top-k, but no layer before "
                               "it ran one")
        selected, visible = self.selected
        selected = pool.map_slots(layer_id, selected)
        kv, step, parts = pool.latent_kv(layer_id), self.attend_chunk, []
        with nvtx_range("attention"):
            for start in range(0, q.shape[0], step):
                rows = slice(start, start + step)
                parts.append(self.kernels.sparse_mla(q[rows], kv, selected[rows], visible[rows],
                                                     self.scale, self.latent_dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

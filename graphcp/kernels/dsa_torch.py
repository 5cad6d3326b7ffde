"""Torch reference kernels of DSA (the oracle of ``kernels/triton_dsa.py``): the lightning indexer's
scores, its top-k, and MLA attention over the selected keys. Every local query row carries its own
key range (its request's page row and causal limit), so the same code serves one rank, interleave CP
and chunked prefill. Static shapes, no host syncs."""
from __future__ import annotations

import torch

# Query rows run in chunks (``row_chunk``) whose per-call intermediates hold at most this many
# elements.
CHUNK_ELEMENTS = 2**24


def row_chunk(keys: int, width: int) -> int:
    """Query rows per call: the torch forms gather [rows, keys, width] tensors (the indexer's keys,
    the selected MLA rows), so a chunk holds CHUNK_ELEMENTS // (keys x width) rows."""
    return max(1, CHUNK_ELEMENTS // (keys * width))


def key_slots(page_rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """[rows, P] page-table rows -> [rows, P * page_size] cache slot of each key position."""
    offsets = torch.arange(page_size, device=page_rows.device)
    return (page_rows[:, :, None] * page_size + offsets).flatten(1)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                   seq_slots: torch.Tensor, row_seq: torch.Tensor,
                   limits: torch.Tensor) -> torch.Tensor:
    """Sum over heads of weight x ReLU(scale q.k) for every key position of each query row.
    q [B, Hi, Di], weights [B, Hi] fp32, index_keys [slots, Di] (the pool), seq_slots [S, K] (key
    position -> slot per sequence), row_seq [B] (each row's sequence), limits [B] (keys each query
    sees) -> [B, K] fp32, -inf past the limit."""
    slots = seq_slots.index_select(0, row_seq)
    keys = index_keys[slots].float()                                                 # [B, K, Di]
    scores = torch.relu(torch.matmul(q.float(), keys.transpose(1, 2)) * q.shape[-1] ** -0.5)
    scores = torch.matmul(weights.float().unsqueeze(1), scores).squeeze(1)           # [B, K]
    pos = torch.arange(slots.shape[1], device=slots.device)
    return torch.where(pos[None, :] < limits[:, None], scores, float("-inf"))


def select_topk(scores: torch.Tensor, seq_slots: torch.Tensor, row_seq: torch.Tensor,
                limits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` best positions of each row -> (their slots [B, k], visible [B, k]), k =
    min(topk, K). A row seeing fewer keys than k keeps them all (the rest are marked invisible)."""
    picked = scores.topk(min(topk, scores.shape[1]), dim=-1).indices
    flat = row_seq[:, None] * seq_slots.shape[1] + picked
    return seq_slots.reshape(-1)[flat], picked < limits[:, None]


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, selected_slots: torch.Tensor,
               visible: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """Absorbed MLA over each query's selected keys: one KV head of rows [latent | rope], values the
    latent part. q [B, H, latent + rope], kv [slots, latent + rope] (the pool), selected_slots /
    visible [B, k] -> [B, H, latent]; zeros on a row without a visible key (padding)."""
    rows = kv[selected_slots]                                                        # [B, k, D]
    scores = torch.matmul(q, rows.transpose(1, 2)) * scale                           # [B, H, k]
    scores = torch.where(visible[:, None, :], scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = probs * visible.any(-1).to(probs.dtype)[:, None, None]
    return torch.matmul(probs, rows[..., :latent_dim])

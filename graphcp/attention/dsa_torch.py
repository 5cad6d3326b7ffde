"""Torch reference kernels of DSA: the lightning indexer's scores and top-k, and MLA attention over the
selected keys. Every local query row carries its own key range (its request's page row and causal limit),
so the same code serves one rank, interleave CP and chunked prefill. Static shapes, no host syncs."""
from __future__ import annotations

import torch


def key_slots(page_rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """[rows, P] page-table rows -> [rows, P * page_size] cache slot of each key position."""
    offsets = torch.arange(page_size, device=page_rows.device)
    return (page_rows[:, :, None] * page_size + offsets).flatten(1)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, slots: torch.Tensor,
                 limits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every visible key of each query: sum over heads of weight x ReLU(scale q.k); keep the
    ``topk`` best. q [B, Hi, Di], weights [B, Hi] fp32, index_keys [slots, Di] (the pool),
    slots [B, K] (key position -> slot), limits [B] (keys each query sees).
    -> (selected key positions [B, k], visible [B, k]) with k = min(topk, K)."""
    keys = index_keys[slots].float()                                                 # [B, K, Di]
    scores = torch.relu(torch.matmul(q.float(), keys.transpose(1, 2)) * q.shape[-1] ** -0.5)
    scores = torch.matmul(weights.unsqueeze(1), scores).squeeze(1)                   # [B, K]
    pos = torch.arange(slots.shape[1], device=slots.device)
    scores = torch.where(pos[None, :] < limits[:, None], scores, float("-inf"))
    picked = scores.topk(min(topk, slots.shape[1]), dim=-1).indices
    return picked, picked < limits[:, None]


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, picked: torch.Tensor,
               visible: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """Absorbed MLA over each query's selected keys: one KV head of rows [latent | rope], values the
    latent part. q [B, H, latent + rope], kv [slots, latent + rope] (the pool) -> [B, H, latent]."""
    rows = kv[slots.gather(1, picked)]                                                # [B, k, D]
    scores = torch.matmul(q, rows.transpose(1, 2)) * scale                           # [B, H, k]
    scores = torch.where(visible[:, None, :], scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, rows[..., :latent_dim])

"""Torch forms of DeepSeek V4's attention parts: the compressor's softmax-gated pooling of one
window per compressed entry, and attention with per-head sinks over keys gathered per query row.
Both take rows already gathered from the paged cache, so one rank, interleave CP and chunked prefill
run the same code."""
from __future__ import annotations

import torch


def pool_windows(rows: torch.Tensor, present: torch.Tensor, bias: torch.Tensor,
                 overlapping: bool) -> torch.Tensor:
    """The entries of ``E`` closed windows, before their norm: rows [E, span, 2 * width] (each
    token's kv | gate projections, in position order), present [E, span] (False: before the first
    token), bias [rate, width] the per-slot position bias of the gates -> [E, d].

    Plain (HCA): span = rate, d = width. Overlapping (CSA and its indexer, width = 2d, span =
    2 * rate): the entry softmax-pools the first d features of the previous window with the last d
    of its own over 2 * rate slots, as transformers lays them out."""
    width, rate = bias.shape[-1], bias.shape[0]
    kv, gate = rows[..., :width], rows[..., width:]
    if overlapping:
        d = width // 2
        gate_prev, gate_own = gate[:, :rate] + bias, gate[:, rate:] + bias
        kv = torch.cat([kv[:, :rate, :d], kv[:, rate:, d:]], dim=1)
        gate = torch.cat([gate_prev[..., :d], gate_own[..., d:]], dim=1)
    else:
        gate = gate + bias
    gate = gate.masked_fill(~present[..., None], float("-inf"))
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                      sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Shared-KV attention (values are the keys) whose softmax also counts one learned logit per
    head that attends nothing. q [B, H, D], keys [B, K, D] (each row's own keys), visible [B, K],
    sinks [H] fp32 -> [B, H, D]. The softmax runs in fp32 (transformers' fp32 sinks promote it).
    A row without a visible key (padding) gets zeros."""
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale                     # [B, H, K]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf")).float()
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` features of ``x`` as pairs (x0, x1), (x2, x3), ... in
    fp32; the leading features pass through. cos/sin broadcast against ``x[..., :dim / 2]``; the
    inverse rotation is ``sin`` negated."""
    dim = 2 * cos.shape[-1]
    rope = x[..., -dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-dim], rotated.to(x.dtype)], dim=-1)

"""Torch forms of DeepSeek V4's attention parts: the compressor's softmax-gated pooling of closed
windows (with the state that carries an open window and the overlap across forwards, so chunked
prefill equals one pass) and attention with per-head sinks over keys gathered per query row."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompressorState:
    """One request's compressor of one layer, as transformers' V4 cache layers hold it.

    ``entries`` [E, d]: compressed entries so far (entry e pools tokens [e*rate, (e+1)*rate), an
    overlapping compressor also the previous window's first half). ``buffer`` [b < rate, 2 * width]:
    the kv | gate projections of the open window's tokens. ``overlap`` [rate, 2 * d] (overlapping
    compressors): the first-half kv | gate (position bias added) of the last closed window."""
    entries: torch.Tensor
    buffer: torch.Tensor
    overlap: torch.Tensor | None = None

    @classmethod
    def empty(cls, entry_dim: int, width: int, like: torch.Tensor) -> "CompressorState":
        return cls(like.new_zeros((0, entry_dim)), like.new_zeros((0, 2 * width)))


def close_windows(rows: torch.Tensor, state: CompressorState, rate: int, bias: torch.Tensor,
                  overlapping: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Append a request's new ``rows`` [n, 2 * width] (kv | gate projections, in token order) to
    its open window and pool every window that closes -> (pooled [w, d] before the norm, the new
    buffer, the new overlap). ``bias`` [rate, width]: the per-slot position bias of the gates.

    Overlapping (CSA and its indexer, width = 2d): entry e softmax-pools the first d features of
    window e-1 with the last d of window e over 2 * rate slots; window 0 has no first half."""
    width = bias.shape[-1]
    rows = torch.cat([state.buffer, rows])
    closed = rows.shape[0] // rate * rate
    windows, buffer = rows[:closed], rows[closed:]
    count = closed // rate
    if count == 0:
        return rows.new_zeros((0, width // 2 if overlapping else width)), buffer, state.overlap
    kv = windows[:, :width].view(count, rate, width)
    gate = windows[:, width:].view(count, rate, width) + bias
    overlap = state.overlap
    if overlapping:
        d = width // 2
        slots_kv = kv.new_zeros((count, 2 * rate, d))
        slots_gate = gate.new_full((count, 2 * rate, d), float("-inf"))
        slots_kv[:, rate:], slots_gate[:, rate:] = kv[..., d:], gate[..., d:]
        slots_kv[1:, :rate], slots_gate[1:, :rate] = kv[:-1, :, :d], gate[:-1, :, :d]
        if overlap is not None:
            slots_kv[0, :rate], slots_gate[0, :rate] = overlap[:, :d], overlap[:, d:]
        overlap = torch.cat([kv[-1, :, :d], gate[-1, :, :d]], dim=-1)
        kv, gate = slots_kv, slots_gate
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    return pooled, buffer, overlap


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                      sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Shared-KV attention (values are the keys) whose softmax also counts one learned logit per
    head that attends nothing. q [B, H, D], keys [B, K, D] (each row's own keys), visible [B, K],
    sinks [H] fp32 -> [B, H, D]. The softmax runs in fp32 (transformers' fp32 sinks promote it)."""
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale                     # [B, H, K]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf")).float()
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)

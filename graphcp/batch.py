"""What the serving loop passes in (Request) and gets back (PrefillOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from graphcp.errors import RequestError


@dataclass
class Request:
    """``input_ids`` are the new tokens; a rid that still holds cached KV is extended by them."""
    rid: str
    input_ids: Sequence[int]


@dataclass
class PrefillOutput:
    logits: torch.Tensor                   # float32 [num_requests, vocab], CPU: at each request's last new token
    next_token_ids: list[int]              # greedy
    mode: str                              # "graph" | "eager"
    graph_bucket: int | None               # CP-local bucket replayed
    eager_reason: str | None               # why the graph path was not taken
    cp_applied: bool                       # False when the batch ran without token sharding
    per_rank_tokens: list[int] = field(default_factory=list)
    host_ops: int | None = None            # ops launched outside captured segments (when counted)
    request_indices: list[int] | None = None   # internal: the batch positions one DP group answered for
    dp_group: int = 0


def validate_requests(requests: Sequence[Request], vocab_size: int) -> tuple[list[str], list[torch.Tensor]]:
    """Check a batch before anything is written; raise RequestError naming the first bad request."""
    if not isinstance(requests, (list, tuple)) or not requests:
        raise RequestError("empty batch: prefill needs at least one Request")
    rids, ids, seen = [], [], set()
    for req in requests:
        if not isinstance(req, Request):
            raise RequestError(f"batch item {req!r} is not a graphcp.Request")
        rid = req.rid
        if not isinstance(rid, str) or not rid:
            raise RequestError(f"request {rid!r}: rid must be a non-empty string")
        if rid in seen:
            raise RequestError(f"request {rid!r} appears twice in one batch")
        seen.add(rid)
        try:
            tokens = torch.as_tensor(list(req.input_ids))
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise RequestError(f"request {rid!r}: input_ids must be a list of ints ({e})") from e
        if tokens.numel() == 0:
            raise RequestError(f"request {rid!r}: input_ids is empty; send at least one new token")
        if tokens.ndim != 1 or tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            # as_tensor(..., dtype=long) would truncate 1.5 to 1 silently: refuse anything but integer ids
            raise RequestError(f"request {rid!r}: input_ids must be a flat list of ints, got {tokens.dtype} "
                               f"with shape {list(tokens.shape)}")
        tokens = tokens.to(torch.long)
        rids.append(rid)
        ids.append(tokens)
    # One range check for the whole batch; the per-request search runs only when it fails.
    every = torch.cat(ids)
    if int(every.min()) < 0 or int(every.max()) >= vocab_size:
        for rid, tokens in zip(rids, ids):
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise RequestError(f"request {rid!r}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return rids, ids

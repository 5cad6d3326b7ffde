"""What the serving loop passes in (Request) and gets back (PrefillOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from graphcp.errors import RequestError


@dataclass
class Request:
    """``input_ids`` are the new tokens; a rid that still holds cached KV is extended by them.
    ``bootstrap_room`` (SGLang PD, the request's last chunk): once prefilled, its KV goes to the
    SGLang decode that sends metadata for that room, with the first token sampled per
    ``sampling_params`` (SGLang's dict: temperature, top_p, top_k, min_p, sampling_seed)."""
    rid: str
    input_ids: Sequence[int]           # a list or tuple of ints, a 1-D integer tensor or numpy array
    bootstrap_room: int | None = None
    sampling_params: dict | None = None


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
    aux_hidden_states: torch.Tensor | None = None   # float32 [new tokens, layers x hidden] (speculative)


@dataclass
class RankReply:
    """One rank's answer to a prefill, merged by the engine into the caller's PrefillOutput."""
    output: PrefillOutput
    request_indices: list[int]             # the batch positions this rank's DP group answered for
    dp_group: int
    extend_lens: list[int] = field(default_factory=list)   # new tokens of each answered request


def _token_tensor(rid: str, ids: object) -> torch.Tensor:
    """A request's ids as a 1-D int64 CPU tensor. Tensors and numpy arrays are taken as they are (no
    Python round trip); lists and tuples go through numpy. Anything but flat integers is refused:
    casting would truncate 1.5 to 1 silently."""
    if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.dim() == 1 and ids.numel() \
            and not ids.is_cuda and not ids.requires_grad:
        return ids                  # the serving path: already a flat int64 CPU tensor, nothing to do
    if isinstance(ids, torch.Tensor):
        tokens, dtype = ids, ids.dtype
        integral = not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)
    else:
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError) as e:     # ragged nesting
            raise RequestError(f"request {rid!r}: input_ids must be a flat list of ints ({e})") from e
        integral = arr.dtype.kind in "iu"
        tokens = torch.from_numpy(arr.astype(np.int64, copy=False)) if integral else torch.empty(arr.shape)
        numeric = arr.dtype.kind in "biufc"
        dtype = torch.from_numpy(np.zeros(1, dtype=arr.dtype)).dtype if numeric else arr.dtype
    if tokens.numel() == 0:
        raise RequestError(f"request {rid!r}: input_ids is empty; send at least one new token")
    if not integral or tokens.ndim != 1:
        raise RequestError(f"request {rid!r}: input_ids must be a flat list of ints, got {dtype} "
                           f"with shape {list(tokens.shape)}")
    if tokens.dtype != torch.long or tokens.device.type != "cpu" or tokens.requires_grad:
        tokens = tokens.detach().to("cpu", torch.long)
    return tokens


def _checked(requests: Sequence[Request]) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """Each request checked and its ids converted, raising RequestError for the first bad one."""
    rids, ids = [], []
    for req in requests:
        if not isinstance(req, Request):
            raise RequestError(f"batch item {req!r} is not a graphcp.Request")
        if not isinstance(req.rid, str) or not req.rid:
            raise RequestError(f"request {req.rid!r}: rid must be a non-empty string")
        rids.append(req.rid)
        ids.append(_token_tensor(req.rid, req.input_ids))
    return rids, ids, [t.numel() for t in ids]


def validate_requests(requests: Sequence[Request], vocab_size: int, into: torch.Tensor | None = None
                      ) -> tuple[list[str], list[torch.Tensor], list[int], torch.Tensor, bool]:
    """Check a batch before anything is written; raise RequestError naming the first bad request.
    Returns the rids, each request's ids and length, all ids concatenated (the descriptors copy
    that), and whether that concatenation is in ``into``: a host int64 buffer it is written to when
    it fits (the graphs' staging ids, so their fill copies nothing; it holds no state between
    batches)."""
    if not isinstance(requests, (list, tuple)) or not requests:
        raise RequestError("empty batch: prefill needs at least one Request")
    # The serving path first: Requests holding int64 tensors, taken as they are (types checked by
    # sets over C-level maps; dims and device once, on the concatenation below); anything else goes
    # through the per-request checks.
    fast = set(map(type, requests)) == {Request}
    if fast:
        rids, ids = [r.rid for r in requests], [r.input_ids for r in requests]
        fast = (set(map(type, rids)) == {str} and all(rids) and set(map(type, ids)) == {torch.Tensor}
                and {t.dtype for t in ids} == {torch.int64})
        lens = list(map(torch.Tensor.numel, ids)) if fast else []
        fast = fast and all(lens)
    if not fast:
        rids, ids, lens = _checked(requests)
    if len(set(rids)) != len(rids):
        seen: set[str] = set()
        rid = next(r for r in rids if r in seen or seen.add(r))
        raise RequestError(f"request {rid!r} appears twice in one batch")
    staged = False
    try:
        total = sum(lens)
        if len(ids) == 1:
            every = ids[0]
        elif into is not None and total <= into.numel():
            every, staged = torch.cat(ids, out=into[:total]), True
        else:
            every = torch.cat(ids)
    except RuntimeError:            # tensors on different devices
        every = None
    if every is None or every.dim() != 1 or every.device.type != "cpu" or every.requires_grad:
        ids = [_token_tensor(rid, t) for rid, t in zip(rids, ids)]
        every, staged = torch.cat(ids), False
    # One range check for the whole batch; the per-request search runs only when it fails.
    lo, hi = torch.aminmax(every)
    if int(lo) < 0 or int(hi) >= vocab_size:
        for rid, tokens in zip(rids, ids):
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise RequestError(f"request {rid!r}: token id {bad} is outside the vocabulary "
                                   f"[0, {vocab_size})")
    return rids, ids, lens, every, staged

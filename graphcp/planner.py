"""The planner: host-side decisions for a batch, made identically on every rank, without processes.

It validates the batch, assigns requests to DP groups, decides the layout (sharded or not), the graph
bucket or the reason to run eagerly, and owns the page tables: every rank mirrors every DP group's table,
so all ranks accept or refuse a batch alike. Pages move in transactions (allocate, then commit or
rollback), so a failed forward leaves no trace.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from graphcp.batch import Request, validate_requests
from graphcp.config import EngineArgs
from graphcp.cp.strategy import BatchLayout, ContextParallelStrategy, make_strategy
from graphcp.errors import RequestError
from graphcp.forward_batch import BatchInputs
from graphcp.graph.runner import select_bucket
from graphcp.kv.pages import PageTable


def config_ineligibility(args: EngineArgs, backend: str, model_reason: str | None = None) -> str | None:
    """The one eligibility predicate for configurations; None means graphs are used. ``model_reason``:
    why the model's layer kinds run eagerly (``AttentionBackend.graph_reason``)."""
    if args.disable_cuda_graph:
        return "graphs disabled by --disable-cuda-graph"
    if model_reason is not None:
        return model_reason
    if args.pp_size > 1:
        return "pipeline parallelism (--pp > 1) runs eagerly, as in SGLang"
    if args.dp_size > 1:
        return "data-parallel attention (--dp > 1) runs eagerly, as in SGLang"
    if args.cp_size > 1:
        reason = make_strategy(args.cp_strategy, args.cp_size).graph_reason
        if reason is not None:
            return reason
    if backend != "trtllm_mha":
        return f"--attention-backend {backend} runs eagerly (graphs need trtllm_mha)"
    return None


@dataclass(slots=True)
class BatchPlan:
    """This rank's part of a batch: its DP group's requests, their layout, and graph or eager."""
    rids: list[str]
    ids: list[torch.Tensor]
    extend_lens: list[int]
    prefix_lens: list[int]
    layout: BatchLayout           # decided once: strategy, per-rank tokens, local capacity, host maxima
    bucket: int | None
    eager_reason: str | None
    indices: list[int]           # positions of these requests in the caller's batch (DP splits batches)
    dp_groups: list[int]         # DP group of every request of the batch
    all_rids: list[str] = field(default_factory=list)
    all_extend_lens: list[int] = field(default_factory=list)
    flat_ids: torch.Tensor | None = None   # ``ids`` concatenated, when validation made it already
    ids_staged: bool = False               # flat_ids is the graphs' staging ids already

    @property
    def strategy(self) -> ContextParallelStrategy:
        return self.layout.strategy

    @property
    def cp_applied(self) -> bool:
        return self.layout.cp_applied

    @property
    def per_rank_tokens(self) -> list[int]:
        return self.layout.per_rank_tokens

    @property
    def local_cap(self) -> int:
        return self.layout.local_cap

    def inputs(self, page_rows: list,
               state_rows: tuple[list[int], list[int]] | None = None) -> BatchInputs:
        """The descriptors' source; a DP group without requests joins with one zero-length request.
        ``state_rows``: the per-request state slots each request reads and writes (kv/pages.py)."""
        if not self.rids:
            return BatchInputs([0], [0], [[]], [torch.zeros(0, dtype=torch.long)])
        state_in, state_out = state_rows or (None, None)
        return BatchInputs(self.extend_lens, self.prefix_lens, page_rows, self.ids, self.layout.whole_on,
                           self.flat_ids, state_in, state_out, self.ids_staged)


@dataclass
class PageTransaction:
    """Pages added for a batch in every DP group's table: [(table, rids, new lengths, pages added)]."""
    parts: list[tuple[PageTable, list[str], list[int], list[list[int]]]]


class Planner:
    def __init__(self, strategy: ContextParallelStrategy, cp_size: int, dp_size: int, dp_rank: int,
                 vocab_size: int, num_pages: int, page_size: int, max_context: int,
                 max_batch_requests: int, cp_rank: int = 0, state_slots: int = 0,
                 ids_buffer: torch.Tensor | None = None) -> None:
        """``ids_buffer``: the graphs' staging ids, where validation concatenates a batch's ids (their
        fill then copies nothing)."""
        self.strategy, self.cp_size, self.dp_rank, self.cp_rank = strategy, cp_size, dp_rank, cp_rank
        self.vocab_size, self.max_batch_requests = vocab_size, max_batch_requests
        self.dp_pages = [PageTable(num_pages, page_size, max_context, state_slots) for _ in range(dp_size)]
        self.pages = self.dp_pages[dp_rank]
        self.ids_buffer = ids_buffer

    # -- decisions -------------------------------------------------------------------------------
    def assign_dp(self, rids: list[str], extend_lens: list[int]) -> list[int]:
        """DP group of each request: where its KV already lives, else the group with the fewest new tokens."""
        if len(self.dp_pages) == 1:
            return [0] * len(rids)
        load = [0] * len(self.dp_pages)
        groups = []
        for rid, n in zip(rids, extend_lens):
            owner = self.owner(rid)
            g = owner if owner is not None else min(range(len(load)), key=lambda d: (load[d], d))
            load[g] += n
            groups.append(g)
        return groups

    def plan(self, requests: Sequence[Request], force_eager: bool = False, graph_reason: str | None = None,
             buckets: Sequence[int] = (), failures: dict[int, str] | None = None) -> BatchPlan:
        """Validate and place a batch; raises RequestError (changing nothing) when it cannot run."""
        single = len(self.dp_pages) == 1
        into = self.ids_buffer if single else None     # DP: a group's ids are a subset
        all_rids, all_ids, all_ext, flat, staged = validate_requests(requests, self.vocab_size, into)
        if single:
            groups, prefix = [0] * len(all_rids), self.pages.check(all_rids, all_ext)
            indices, rids, ids, ext = list(range(len(all_rids))), all_rids, all_ids, all_ext
        else:
            groups = self.assign_dp(all_rids, all_ext)
            for g, pages in enumerate(self.dp_pages):          # every group's check, on every rank
                mine = [i for i, d in enumerate(groups) if d == g]
                pages.check([all_rids[i] for i in mine], [all_ext[i] for i in mine])
            indices = [i for i, d in enumerate(groups) if d == self.dp_rank]
            rids, ids = [all_rids[i] for i in indices], [all_ids[i] for i in indices]
            ext = [all_ext[i] for i in indices]
            flat, staged = None, False    # this group's ids are a subset: the descriptors concatenate
            prefix = [self.pages.prefix_len(r) for r in rids]
        layout = self.strategy.layout(ext, prefix, self.cp_rank)
        # Every DP group pads to the widest group's rows: the FFN layout gathers equal blocks from all.
        if not single:
            caps = [self.strategy.layout([n for n, d in zip(all_ext, groups) if d == g],
                                       [self.dp_pages[g].prefix_len(r) for r, d in zip(all_rids, groups) if d == g],
                                       self.cp_rank).local_cap if g != self.dp_rank else layout.local_cap
                    for g in range(len(self.dp_pages))]
            layout = replace(layout, local_cap=max(caps))
        bucket, reason = None, graph_reason
        if reason is None and force_eager:
            reason = "eager forced by the caller (force_eager=True)"
        if reason is None:
            if layout.unsharded_reason is not None:
                reason = layout.unsharded_reason
            elif len(rids) > self.max_batch_requests:
                reason = (f"{len(rids)} requests exceed the graphs' capacity of {self.max_batch_requests} "
                          f"(--max-batch-requests)")
            else:
                real = max(layout.per_rank_tokens)
                bucket, reason = select_bucket(list(buckets), real, layout.strategy.aligned(real), failures)
        return BatchPlan(rids, ids, ext, prefix, layout, bucket, reason, indices, groups, all_rids, all_ext,
                         flat, staged)

    # -- pages -----------------------------------------------------------------------------------
    def allocate(self, plan: BatchPlan) -> PageTransaction:
        """Pages for every DP group's requests: this rank's group, and its mirrors of the others."""
        parts = []
        for g, pages in enumerate(self.dp_pages):
            picked = [(r, n) for r, n, d in zip(plan.all_rids, plan.all_extend_lens, plan.dp_groups) if d == g]
            rids, lens = [r for r, _ in picked], [n for _, n in picked]
            parts.append((pages, rids, lens, pages.allocate(rids, lens)))
        return PageTransaction(parts)

    def commit(self, txn: PageTransaction) -> None:
        for pages, rids, lens, _ in txn.parts:
            pages.commit(rids, lens)

    def rollback(self, txn: PageTransaction) -> None:
        for pages, rids, _, added in txn.parts:
            pages.rollback(rids, added)

    def owner(self, rid: str) -> int | None:
        """The DP group holding ``rid``'s KV, or None."""
        return next((g for g, pages in enumerate(self.dp_pages) if rid in pages.requests), None)

    def release(self, rid: str) -> None:
        owner = self.owner(rid)
        if owner is None:
            raise RequestError(f"request {rid!r} is unknown: nothing to release")
        self.dp_pages[owner].release(rid)

    def slots(self, rid: str) -> torch.Tensor | None:
        """KV slots of ``rid``'s cached tokens in order (None when another DP group holds it)."""
        if self.owner(rid) is None:
            raise RequestError(f"request {rid!r} is unknown: it holds no cached KV")
        state = self.pages.requests.get(rid)
        if state is None:
            return None
        ps = self.pages.page_size
        pos = torch.arange(state.cached_len)
        return torch.from_numpy(state.pages)[pos // ps] * ps + pos % ps

    def state_slot(self, rid: str) -> int:
        """``rid``'s committed per-request state slot on this rank (0: none, or another DP group's)."""
        state = self.pages.requests.get(rid)
        return state.state_slot if state else 0

    @property
    def state_slots_total(self) -> int:
        return sum(p.state_slots for p in self.dp_pages)

    @property
    def state_slots_free(self) -> int:
        return sum(p.state_slots_free for p in self.dp_pages)

    @property
    def tokens_total(self) -> int:
        return sum(p.tokens_total for p in self.dp_pages)

    @property
    def tokens_free(self) -> int:
        return sum(p.tokens_free for p in self.dp_pages)

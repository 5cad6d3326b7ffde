"""Context-parallel strategies: the token-layout policy and all of its geometry, kept apart from models,
kernels and graphs. Nothing outside ``cp/`` needs to know what zigzag or interleave is."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.cp.host_metadata import interleave_metadata_host, zigzag_metadata_host
from graphcp.cp.metadata import CPMetadata, HostMaxima, interleave_metadata, zigzag_metadata


@dataclass(slots=True)
class BatchLayout:
    """A batch's layout, decided once on the host (``ContextParallelStrategy.layout``): the strategy it runs
    with, what each CP rank holds, the padded local capacity and this rank's host maxima. The planner makes
    it; the runner, the attention ops and the graphs only read it."""
    strategy: "ContextParallelStrategy"  # the strategy the batch runs with (unsharded when CP is off)
    cp_applied: bool                     # False: every rank holds the whole batch
    per_rank_tokens: list[int]           # real new tokens each CP rank holds
    local_cap: int                       # rows of this rank's padded buffers (>= 1)
    host: HostMaxima                     # this rank's host maxima
    whole_on: list[int] | None = None    # adaptive CP: 0 split, r + 1 whole on CP rank r
    unsharded_reason: str | None = None  # why a CP group runs the batch unsharded


class ContextParallelStrategy:
    """How a batch's new tokens are split over a CP group of ``cp_size`` ranks."""

    name = ""
    build: Callable[..., CPMetadata]
    splits_early_late = False        # the flashattention path makes one call per half (zigzag)
    bottom_right_causal = True       # each query sequence ends at its KV length (interleave: per-token limits)
    graph_reason: str | None = None  # why graphs cannot serve this layout (None: they can)
    whole_on: list[int] | None = None  # per-batch placement (adaptive CP); None: every request split

    def __init__(self, cp_size: int) -> None:
        self.cp_size = cp_size

    @property
    def align(self) -> int:
        """Communication buffers are padded to a multiple of this."""
        raise NotImplementedError

    @property
    def min_request_len(self) -> int:
        """Fewest new tokens a request may have for the layout to shard the batch."""
        return 1

    def for_batch(self, extend_lens: list[int], prefix_lens: list[int]) -> "ContextParallelStrategy":
        """The strategy a batch runs with (adaptive CP decides its placement here)."""
        return self

    def layout(self, extend_lens: list[int], prefix_lens: list[int], rank: int) -> BatchLayout:
        """The batch's layout, decided once: placement, per-rank tokens, local capacity and this CP
        rank's host maxima. A batch the layout cannot shard runs unsharded (every rank holds all of it,
        as rank 0 of a one-rank zigzag)."""
        if not extend_lens:          # an empty DP group: one zero-length padding request joins
            extend_lens, prefix_lens = [0], [0]
        placed = self.for_batch(extend_lens, prefix_lens)
        if self.cp_size > 1 and placed.applies(extend_lens):
            counts, host = placed.counts_and_maxima(extend_lens, prefix_lens, rank)
            return BatchLayout(placed, True, counts, max(1, placed.aligned(max(counts))), host,
                              placed.whole_on)
        whole = unsharded()
        reason = self.unsharded_reason() if self.cp_size > 1 else None
        return BatchLayout(whole, False, [sum(extend_lens)] * self.cp_size, max(1, sum(extend_lens)),
                          whole.host_maxima(extend_lens, prefix_lens, 0), None, reason)

    def describe_cost(self) -> dict | None:
        """The placement cost model (adaptive CP), for stats; None for a static layout."""
        return None

    def applies(self, extend_lens: list[int]) -> bool:
        return min(extend_lens) >= self.min_request_len

    def unsharded_reason(self) -> str:
        return f"{self.name} needs every request to have >= {self.min_request_len} new tokens"

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        raise NotImplementedError

    def aligned(self, tokens: int) -> int:
        return -(-tokens // self.align) * self.align

    def counts_and_maxima(self, extend_lens: list[int], prefix_lens: list[int], rank: int
                          ) -> tuple[list[int], HostMaxima]:
        """``per_rank_tokens`` and ``host_maxima`` together (a layout may share their work)."""
        return self.per_rank_tokens(extend_lens), self.host_maxima(extend_lens, prefix_lens, rank)

    def host_maxima(self, extend_lens: list[int], prefix_lens: list[int], rank: int) -> HostMaxima:
        """The live batch's host-side maxima that kernels run in a graph break need (``rank`` is the CP
        rank; a batch that runs unsharded uses this one-rank strategy, where every rank is rank 0)."""
        longest = max(extend_lens, default=0)
        max_kv = max(map(int.__add__, prefix_lens, extend_lens), default=0) if any(prefix_lens) else longest
        return HostMaxima(max_q=-(-longest // self.cp_size), max_kv=max_kv)

    def metadata(self, extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                 rank: int, local_cap: int, page_size: int, whole_on: torch.Tensor | None = None,
                 on_host: bool = False) -> CPMetadata:
        """``on_host``: an eager forward's host descriptors, built in numpy (the same values)."""
        build = type(self).build_host if on_host else type(self).build
        return build(extend_lens, prefix_lens, page_table, self.cp_size, rank, local_cap, page_size)

    def reduce_last_rows(self, rows: torch.Tensor, meta: CPMetadata, comm) -> torch.Tensor:
        """Make every request's last-token row valid where logits are read (rank 0 by default)."""
        return rows

    def dummy_batch(self, bucket: int, req_cap: int, max_context: int, seed: int,
                    prefixes: bool = True) -> tuple[list[int], list[int]] | None:
        """(new lengths, prefix lengths) of a random batch whose padded per-rank count fits ``bucket``
        and fills more than half of it (so that bucket serves it); None when no batch of <= ``req_cap``
        requests within ``max_context`` tokens does. ``prefixes=False``: fresh requests only (a
        warmup that sends real requests)."""
        rng = random.Random(seed)
        cp, min_len, ctx = self.cp_size, self.min_request_len, max_context
        n_min = max(1, -(-(bucket * cp // 2) // ctx))
        if n_min > req_cap:
            return None
        n_req = rng.randint(n_min, max(n_min, min(req_cap, bucket * cp // (2 * min_len))))
        hi = min(max(n_req * min_len, bucket * cp), n_req * ctx)
        for _ in range(1000):
            target = rng.randint(min(hi, max(n_req * min_len, bucket * cp // 2)), hi)
            extra = target - n_req * min_len
            cuts = sorted(rng.randint(0, extra) for _ in range(n_req - 1))
            ext = [min_len + b - a for a, b in zip([0] + cuts, cuts + [extra])]
            if max(ext) <= ctx:
                prefix = [rng.randint(0, min(64, ctx - e)) if prefixes else 0 for e in ext]
                if self.layout(ext, prefix, 0).local_cap <= bucket:
                    return ext, prefix
            hi = max(n_req * min_len, target - 1)
        return None


class ZigzagStrategy(ContextParallelStrategy):
    """Each request split in 2C blocks; rank r owns blocks r and 2C-1-r (see ``zigzag_metadata``)."""

    name = "zigzag"
    build = staticmethod(zigzag_metadata)
    build_host = staticmethod(zigzag_metadata_host)
    splits_early_late = True

    @property
    def align(self) -> int:
        return 2 * self.cp_size

    @property
    def min_request_len(self) -> int:
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        """Rank r holds 2 * (n // 2C) tokens of each request, plus one more for each of its blocks
        (r and 2C-1-r) that the remainder n % 2C reaches: counted once per remainder, not per request."""
        return self._counts(self._reach(extend_lens))

    def host_maxima(self, extend_lens: list[int], prefix_lens: list[int], rank: int) -> HostMaxima:
        return self._maxima(extend_lens, prefix_lens, rank, self._reach(extend_lens))

    def counts_and_maxima(self, extend_lens: list[int], prefix_lens: list[int], rank: int
                          ) -> tuple[list[int], HostMaxima]:
        """Both from one pass over the remainders (every batch on the serving path)."""
        if type(self).per_rank_tokens is not ZigzagStrategy.per_rank_tokens:    # adaptive placement
            return super().counts_and_maxima(extend_lens, prefix_lens, rank)
        counted = self._reach(extend_lens)
        return self._counts(counted), self._maxima(extend_lens, prefix_lens, rank, counted)

    def _reach(self, extend_lens: list[int]) -> tuple[int, list[int]]:
        """(sum of n // 2C, reach): reach[b] counts the requests whose remainder n % 2C covers block b."""
        c2 = 2 * self.cp_size
        rems = [n % c2 for n in extend_lens]
        reach = [0] * (c2 + 1)
        for r in rems:
            reach[r] += 1
        for b in range(c2 - 1, -1, -1):
            reach[b] += reach[b + 1]
        return (sum(extend_lens) - sum(rems)) // c2, reach

    def _counts(self, counted: tuple[int, list[int]]) -> list[int]:
        blocks, reach = counted
        c2 = 2 * self.cp_size
        return [2 * blocks + reach[r + 1] + reach[c2 - r] for r in range(self.cp_size)]

    def _maxima(self, extend_lens: list[int], prefix_lens: list[int], rank: int,
                counted: tuple[int, list[int]]) -> HostMaxima:
        """Early block r holds n // 2C + (r < n % 2C) tokens of each request (an unsharded batch runs
        as rank 0 of 1)."""
        blocks, reach = counted
        host = super().host_maxima(extend_lens, prefix_lens, rank)
        host.max_q = -(-max(extend_lens, default=0) // (2 * self.cp_size))
        host.early_rows = blocks + reach[rank % self.cp_size + 1]
        return host


class InterleaveStrategy(ContextParallelStrategy):
    """Flat new-token index t goes to rank t % C, across request boundaries."""

    name = "interleave"
    build = staticmethod(interleave_metadata)
    build_host = staticmethod(interleave_metadata_host)
    bottom_right_causal = False
    graph_reason = "--cp-strategy interleave runs eagerly (graphs need zigzag)"

    @property
    def align(self) -> int:
        return self.cp_size

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        base, extra = divmod(sum(extend_lens), self.cp_size)
        return [base + (r < extra) for r in range(self.cp_size)]

    def reduce_last_rows(self, rows: torch.Tensor, meta: CPMetadata, comm) -> torch.Tensor:
        """The last tokens are spread over ranks: zero the rows this rank does not own and sum."""
        if self.cp_size == 1:
            return rows
        rows = rows * meta.logit_owner[:, None].to(rows.dtype)
        comm.all_reduce(rows)
        return rows


def make_strategy(name: str, cp_size: int) -> ContextParallelStrategy:
    strategies = {"zigzag": ZigzagStrategy, "interleave": InterleaveStrategy}
    if name not in strategies:
        from graphcp.errors import ConfigError
        raise ConfigError(f"--cp-strategy {name!r} is not one of: {', '.join(strategies)}")
    return strategies[name](cp_size)


def unsharded() -> ContextParallelStrategy:
    """Every rank runs the whole batch: a one-rank zigzag (early half, then late half, of each request)."""
    return ZigzagStrategy(1)

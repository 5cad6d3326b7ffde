"""Adaptive CP (``--enable-adaptive-cp``): per batch, requests shorter than a threshold run whole on
one CP rank (placed to balance work), longer ones keep the zigzag split. A batch of only short
requests then no longer runs unsharded on every rank (the whole batch computed C times).

The placement is host data of the batch (``whole_on``: 0 split, r + 1 whole on rank r); it travels
in the descriptors and the metadata reads it with tensor ops, so every placement of a bucket replays
one graph. The threshold and the placement weights are measured at start (``graphcp/calibrate.py``).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from graphcp.cp.host_metadata import zigzag_metadata_host
from graphcp.cp.metadata import CPMetadata, HostMaxima, zigzag_metadata
from graphcp.cp.strategy import ContextParallelStrategy, ZigzagStrategy

UNSPLIT_CANDIDATES = 8   # placements a batch weighs beyond the threshold's (each an LPT pass)


@dataclass(frozen=True)
class CostModel:
    """Seconds of a forward's parts, measured by ``calibrate``: linear work per token, attention
    work per (query, key) pair, the all-gather of cache rows per token (every layer), a forward's
    fixed cost, and what splitting one request adds on every rank (its blocks' own calls)."""
    per_token: float
    per_pair: float
    per_gather_token: float = 0.0
    fixed: float = 0.0
    per_split: float = 0.0

    def work(self, new: int, prefix: int) -> float:
        """A request's work on the rank that runs it whole (the placement's weight)."""
        return new * (self.per_token + self.per_pair * (prefix + (new + 1) / 2))

    def seconds(self, strategy: ContextParallelStrategy, extend_lens: list[int],
                prefix_lens: list[int]) -> float:
        """Modelled seconds of one forward of a batch under ``strategy``'s layout. Every CP rank
        runs its padded rows (``local_cap``) through the linear layers and gathers them; each
        attends for its own rows; ranks meet at every layer's all-gather, so the busiest rank's
        attention sets the pace. A batch the layout cannot shard runs whole on every rank."""
        plan = strategy.layout(extend_lens, prefix_lens, 0)
        if not plan.cp_applied:
            return self.fixed + sum(self.work(n, p) for n, p in zip(extend_lens, prefix_lens))
        placed, lens, prefix = plan.strategy, torch.tensor(extend_lens), torch.tensor(prefix_lens)
        pages = torch.zeros(len(extend_lens), max(map(int.__add__, extend_lens, prefix_lens)),
                            dtype=torch.long)
        whole_on = placed.whole_on or [0] * len(extend_lens)
        pairs = []
        for rank in range(strategy.cp_size):
            meta = placed.metadata(lens, prefix, pages, rank, plan.local_cap, 1,
                                   torch.tensor(whole_on), on_host=True)
            pairs.append(int((meta.q_limits * meta.valid).sum()))
        splits = sum(1 for n, w in zip(extend_lens, whole_on) if n and not w)
        return (self.fixed + (self.per_token + self.per_gather_token) * plan.local_cap
                + self.per_pair * max(pairs) + self.per_split * splits)

    def describe(self) -> str:
        return (f"per token {self.per_token * 1e6:.3g} us, per attention pair "
                f"{self.per_pair * 1e9:.3g} ns, all-gather per token "
                f"{self.per_gather_token * 1e6:.3g} us, fixed {self.fixed * 1e3:.3g} ms, per split "
                f"request {self.per_split * 1e3:.3g} ms")


class AdaptiveZigzagStrategy(ZigzagStrategy):
    """Zigzag for long requests; each short one whole on the least-loaded rank (longest work
    first)."""

    name = "zigzag"

    def __init__(self, cp_size: int, threshold: int, cost: CostModel | None = None,
                 whole_on: list[int] | None = None, calibration: dict | None = None) -> None:
        super().__init__(cp_size)
        self.threshold = max(threshold, 2 * cp_size)   # zigzag needs 2C tokens to split a request
        self.cost = cost or CostModel(1.0, 1.0 / 512)   # placement weights until calibrated
        self.whole_on = whole_on
        self.calibration = calibration or {}           # how the start-up calibration went (stats)

    @property
    def min_request_len(self) -> int:
        return 1

    def describe_cost(self) -> dict:
        cost = self.cost
        return {"threshold": self.threshold, "per_token_s": cost.per_token,
                "per_pair_s": cost.per_pair, "per_gather_token_s": cost.per_gather_token,
                "fixed_s": cost.fixed, "per_split_s": cost.per_split, **self.calibration}

    def for_batch(self, extend_lens: list[int], prefix_lens: list[int]) -> AdaptiveZigzagStrategy:
        """This strategy with the batch's placement decided: requests of >= ``threshold`` new
        tokens split, the rest whole; or, where the model says so, also the smallest few of the
        split ones (up to ``UNSPLIT_CANDIDATES``) or all of them whole: in a batch of many requests
        whole ones balance by themselves, and the threshold is where a lone one gains. Only a
        calibrated model weighs that (``per_split`` > 0): a user's threshold is exact."""
        works = [self.cost.work(n, p) for n, p in zip(extend_lens, prefix_lens)]
        longest_first = sorted((i for i, n in enumerate(extend_lens) if n > 0),
                               key=lambda i: -works[i])
        split = sorted((i for i, n in enumerate(extend_lens) if n >= self.threshold),
                       key=lambda i: extend_lens[i])
        best = self._place(extend_lens, works, longest_first, split)
        if split and self.cost.per_split > 0:
            kept = list(range(1, min(len(split), UNSPLIT_CANDIDATES) + 1)) + [len(split)]
            for k in sorted(set(kept)):
                best = min(best, self._place(extend_lens, works, longest_first, split[k:]),
                           key=lambda placed: placed[1])
        return AdaptiveZigzagStrategy(self.cp_size, self.threshold, self.cost, best[0],
                                      self.calibration)

    def _place(self, extend_lens: list[int], works: list[float], longest_first: list[int],
               split: list[int]) -> tuple[list[int], float]:
        """``split`` requests zigzag, every other one whole on the least-loaded rank (longest work
        first, lowest rank on a tie); and the modelled seconds beyond the fixed cost: the busiest
        rank's work, the all-gather of the most rows, each split's own cost."""
        cp, chosen = self.cp_size, set(split)
        share = sum(works[i] for i in split) / cp        # every rank gets an equal share
        rows = [sum(extend_lens[i] for i in split) / cp] * cp
        ranks = [(share, r) for r in range(cp)]          # a heap: (load, rank)
        whole_on = [0] * len(extend_lens)
        for i in longest_first:
            if i not in chosen:
                load, rank = heapq.heappop(ranks)
                heapq.heappush(ranks, (load + works[i], rank))
                rows[rank] += extend_lens[i]
                whole_on[i] = rank + 1
        busiest = max(load for load, _ in ranks)
        cost = self.cost
        return whole_on, busiest + cost.per_gather_token * max(rows) + cost.per_split * len(split)

    def _placement(self, extend_lens: list[int]) -> list[int]:
        """The placement ``for_batch`` decided (with the batch's prefixes); asking before is a
        bug."""
        if self.whole_on is None or len(self.whole_on) != len(extend_lens):
            raise RuntimeError("adaptive CP: ask the strategy returned by for_batch (or layout) for "
                               "a batch")
        return self.whole_on

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        whole_on = self._placement(extend_lens)
        counts = super().per_rank_tokens([n for n, w in zip(extend_lens, whole_on) if w == 0])
        for n, w in zip(extend_lens, whole_on):
            if w:
                counts[w - 1] += n
        return counts

    def host_maxima(self, extend_lens: list[int], prefix_lens: list[int],
                    rank: int) -> HostMaxima:
        whole_on = self._placement(extend_lens)
        split = [(n, p) for n, p, w in zip(extend_lens, prefix_lens, whole_on) if w == 0]
        host = super().host_maxima([n for n, _ in split], [p for _, p in split], rank)
        mine = [n for n, w in zip(extend_lens, whole_on) if w == rank % self.cp_size + 1]
        host.max_q = max([host.max_q] + [n for n, w in zip(extend_lens, whole_on) if w])
        host.max_kv = max((p + n for p, n in zip(prefix_lens, extend_lens)), default=0)
        host.early_rows += sum(mine)
        return host

    def metadata(self, extend_lens: torch.Tensor, prefix_lens: torch.Tensor,
                 page_table: torch.Tensor, rank: int, local_cap: int, page_size: int,
                 whole_on: torch.Tensor | None = None, on_host: bool = False) -> CPMetadata:
        build = zigzag_metadata_host if on_host else zigzag_metadata
        return build(extend_lens, prefix_lens, page_table, self.cp_size, rank, local_cap,
                     page_size, whole_on)

    def reduce_last_rows(self, rows: torch.Tensor, meta: CPMetadata,
                         comm) -> torch.Tensor:
        """Last tokens live on the rank each request ran on: zero the rows this rank does not own
        and sum."""
        rows = rows * meta.logit_owner[:, None].to(rows.dtype)
        comm.all_reduce(rows)
        return rows

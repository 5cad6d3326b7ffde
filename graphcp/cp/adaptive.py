"""Adaptive CP (``--enable-adaptive-cp``): per batch, requests shorter than a threshold run whole on one
CP rank (placed to balance work), longer ones keep the zigzag split. A batch of only short requests then
no longer runs unsharded on every rank (the whole batch computed C times).

The placement is host data of the batch (``whole_on``: 0 split, r + 1 whole on rank r); it travels in the
descriptors and the metadata reads it with tensor ops, so every placement of a bucket replays one graph.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphcp.cp.host_metadata import zigzag_metadata_host
from graphcp.cp.metadata import CPMetadata, zigzag_metadata
from graphcp.cp.metadata import HostMaxima
from graphcp.cp.strategy import ZigzagStrategy

log = logging.getLogger("graphcp")


@dataclass(frozen=True)
class CostModel:
    """Seconds of a request's work on one rank: linear work per token plus attention work per (query,
    key) pair; and the all-gather of its K/V rows per token (every layer). Measured by ``calibrate``."""
    per_token: float
    per_pair: float
    per_gather_token: float = 0.0
    fixed: float = 0.0

    def work(self, new: int, prefix: int) -> float:
        return new * (self.per_token + self.per_pair * (prefix + (new + 1) / 2))

    def split_from(self, cp_size: int) -> int:
        """Fewest new tokens for which splitting pays: the work a split takes off the request's rank,
        (1 - 1/C) w(n), exceeds the all-gather of its rows, n g (SGLang's CP-vs-DP trade)."""
        per_token = self.per_gather_token * cp_size / (cp_size - 1) - self.per_token
        return max(2 * cp_size, int(2 * per_token / self.per_pair))

    def describe(self) -> str:
        return (f"per token {self.per_token * 1e6:.3g} us, per attention pair {self.per_pair * 1e9:.3g} ns, "
                f"K/V all-gather per token {self.per_gather_token * 1e6:.3g} us, fixed {self.fixed * 1e3:.3g} ms")


class AdaptiveZigzagStrategy(ZigzagStrategy):
    """Zigzag for long requests; each short one whole on the least-loaded rank (longest work first)."""

    name = "zigzag"

    def __init__(self, cp_size: int, threshold: int, cost: CostModel | None = None,
                 whole_on: list[int] | None = None) -> None:
        super().__init__(cp_size)
        self.threshold = max(threshold, 2 * cp_size)     # zigzag needs 2C tokens to split a request
        self.cost = cost or CostModel(1.0, 1.0 / 512)     # placement weights until calibrated
        self.whole_on = whole_on

    @property
    def min_request_len(self) -> int:
        return 1

    def describe_cost(self) -> dict:
        cost = self.cost
        return {"threshold": self.threshold, "per_token_s": cost.per_token, "per_pair_s": cost.per_pair,
                "per_gather_token_s": cost.per_gather_token, "fixed_s": cost.fixed}

    def for_batch(self, extend_lens: list[int], prefix_lens: list[int]) -> AdaptiveZigzagStrategy:
        """This strategy with the batch's placement decided."""
        loads = [0.0] * self.cp_size
        whole_on = [0] * len(extend_lens)
        for i, (n, p) in enumerate(zip(extend_lens, prefix_lens)):
            if n >= self.threshold:           # split: every rank gets an equal share
                loads = [x + self.cost.work(n, p) / self.cp_size for x in loads]
        shorts = sorted((i for i, n in enumerate(extend_lens) if 0 < n < self.threshold),
                        key=lambda i: -self.cost.work(extend_lens[i], prefix_lens[i]))
        for i in shorts:
            rank = min(range(self.cp_size), key=lambda r: (loads[r], r))
            loads[rank] += self.cost.work(extend_lens[i], prefix_lens[i])
            whole_on[i] = rank + 1
        return AdaptiveZigzagStrategy(self.cp_size, self.threshold, self.cost, whole_on)

    def _placement(self, extend_lens: list[int]) -> list[int]:
        """The placement ``for_batch`` decided (with the batch's prefixes); asking before is a bug."""
        if self.whole_on is None or len(self.whole_on) != len(extend_lens):
            raise RuntimeError("adaptive CP: ask the strategy returned by for_batch (or layout) for a batch")
        return self.whole_on

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        whole_on = self._placement(extend_lens)
        counts = super().per_rank_tokens([n for n, w in zip(extend_lens, whole_on) if w == 0])
        for n, w in zip(extend_lens, whole_on):
            if w:
                counts[w - 1] += n
        return counts

    def host_maxima(self, extend_lens: list[int], prefix_lens: list[int], rank: int) -> HostMaxima:
        whole_on = self._placement(extend_lens)
        split = [(n, p) for n, p, w in zip(extend_lens, prefix_lens, whole_on) if w == 0]
        host = super().host_maxima([n for n, _ in split], [p for _, p in split], rank)
        mine = [n for n, w in zip(extend_lens, whole_on) if w == rank % self.cp_size + 1]
        host.max_q = max([host.max_q] + [n for n, w in zip(extend_lens, whole_on) if w])
        host.max_kv = max((p + n for p, n in zip(prefix_lens, extend_lens)), default=0)
        host.early_rows += sum(mine)
        return host

    def metadata(self, extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                 rank: int, local_cap: int, page_size: int, whole_on: torch.Tensor | None = None,
                 on_host: bool = False) -> CPMetadata:
        build = zigzag_metadata_host if on_host else zigzag_metadata
        return build(extend_lens, prefix_lens, page_table, self.cp_size, rank, local_cap, page_size, whole_on)

    def reduce_last_rows(self, rows: torch.Tensor, meta: CPMetadata, comm) -> torch.Tensor:  # noqa: ANN001
        """Last tokens live on the rank each request ran on: zero the rows this rank does not own and sum."""
        rows = rows * meta.logit_owner[:, None].to(rows.dtype)
        comm.all_reduce(rows)
        return rows



def adaptive_strategy(cp_size: int, threshold: int | None, cost: CostModel, announce: bool) -> AdaptiveZigzagStrategy:
    strategy = AdaptiveZigzagStrategy(cp_size, threshold or cost.split_from(cp_size), cost)
    if announce:
        log.info("graphcp: adaptive CP: requests with >= %d new tokens are split (zigzag), shorter ones run "
                 "whole on one CP rank (%s); measured cost model: %s", strategy.threshold,
                 "--adaptive-cp-threshold" if threshold else "from the cost model", cost.describe())
    return strategy

"""Context-parallel strategies: the token-layout policy, kept apart from models and kernels."""
from __future__ import annotations

from typing import Callable

import torch

from graphcp.cp.metadata import CPMetadata, interleave_metadata, zigzag_metadata


class ContextParallelStrategy:
    """How a batch's new tokens are split over a CP group of ``cp_size`` ranks."""

    name = ""
    build: Callable[..., CPMetadata]

    def __init__(self, cp_size: int) -> None:
        self.cp_size = cp_size

    @property
    def align(self) -> int:
        """Communication buffers are padded to a multiple of this."""
        raise NotImplementedError

    def applies(self, extend_lens: list[int]) -> bool:
        return True

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        raise NotImplementedError

    def local_capacity(self, extend_lens: list[int]) -> int:
        """Rows of the padded per-rank buffers: the largest rank's count, aligned."""
        need = max(self.per_rank_tokens(extend_lens))
        return -(-need // self.align) * self.align

    def metadata(self, extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor, rank: int,
                 local_cap: int, page_size: int) -> CPMetadata:
        return type(self).build(extend_lens, prefix_lens, page_table, self.cp_size, rank, local_cap, page_size)


class ZigzagStrategy(ContextParallelStrategy):
    name = "zigzag"
    build = staticmethod(zigzag_metadata)

    @property
    def align(self) -> int:
        return 2 * self.cp_size

    def applies(self, extend_lens: list[int]) -> bool:
        return self.cp_size == 1 or all(n >= 2 * self.cp_size for n in extend_lens)

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        c2 = 2 * self.cp_size
        counts = [0] * self.cp_size
        for n in extend_lens:
            base, rem = divmod(n, c2)
            for r in range(self.cp_size):
                counts[r] += 2 * base + (r < rem) + (c2 - 1 - r < rem)
        return counts


class InterleaveStrategy(ContextParallelStrategy):
    name = "interleave"
    build = staticmethod(interleave_metadata)

    @property
    def align(self) -> int:
        return self.cp_size

    def per_rank_tokens(self, extend_lens: list[int]) -> list[int]:
        base, extra = divmod(sum(extend_lens), self.cp_size)
        return [base + (r < extra) for r in range(self.cp_size)]


def make_strategy(name: str, cp_size: int) -> ContextParallelStrategy:
    strategies = {"zigzag": ZigzagStrategy, "interleave": InterleaveStrategy}
    if name not in strategies:
        from graphcp.errors import ConfigError
        raise ConfigError(f"--cp-strategy {name!r} is not one of: {', '.join(strategies)}")
    return strategies[name](cp_size)


def unsharded() -> ContextParallelStrategy:
    """Every rank runs the whole batch: a one-rank zigzag (early half, then late half, of each request)."""
    return ZigzagStrategy(1)

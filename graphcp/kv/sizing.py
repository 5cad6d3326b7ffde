"""How many KV tokens a rank's pool holds, and the longest request it accepts."""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from graphcp.errors import ConfigError

log = logging.getLogger("graphcp")


def free_memory(device: torch.device, ranks_sharing: int) -> int:
    """This rank's share of the free memory of its device (the host's memory on CPU, one GPU on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // ranks_sharing
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks_sharing


def kv_tokens(max_total_tokens: int | None, bytes_per_token: int, device: torch.device, ranks_sharing: int,
              max_positions: int, max_batch_requests: int, page_size: int,
              agree_min: Callable[[int], int] = lambda n: n, reserved: int = 0) -> int:
    """--max-total-tokens (checked against free memory), else a share of free memory. ``agree_min`` takes
    the minimum over every rank: ranks read free memory at different moments (ranks sharing a GPU see
    each other's allocations), and every rank must hold the same number of pages, or the planner
    would refuse a batch on one rank only while its peers wait in a collective. ``reserved``: bytes
    the pool holds beside its pages (per-request state), taken from the free memory first."""
    free = agree_min(free_memory(device, ranks_sharing)) - reserved
    if free <= 0:
        raise ConfigError(f"the per-request state needs {reserved / 2**30:.2f} GiB per rank, "
                          "more than is free; lower --max-state-requests")
    if max_total_tokens is not None:
        need = max_total_tokens * bytes_per_token
        if need > 0.9 * free:
            raise ConfigError(f"--max-total-tokens {max_total_tokens}: the KV pool needs {need / 2**30:.2f} GiB "
                              f"per rank and {free / 2**30:.2f} GiB is free; lower it or leave it unset")
        return max_total_tokens
    budget = int(free * (0.6 if device.type == "cuda" else 0.2))
    tokens = min(budget // bytes_per_token, max_positions * max_batch_requests)
    if tokens < page_size:
        raise ConfigError("not enough memory for a KV pool; set --max-total-tokens or free memory")
    return tokens


def context_limit(max_positions: int, pool_tokens: int, sliding_window: int | None, warn: bool) -> int:
    """The longest request (cached + new tokens). Within a sliding window every key is visible, so full
    causal attention is exact; past it, it is not, and graphcp has no windowed kernels: longer requests
    are refused instead of answered wrongly."""
    limit = min(max_positions, pool_tokens)
    if sliding_window is not None and sliding_window < limit:
        limit = sliding_window
        if warn:
            log.warning("graphcp: the model attends through a %d-token sliding window, which graphcp does not "
                        "implement: requests are limited to %d tokens", sliding_window, sliding_window)
    return limit

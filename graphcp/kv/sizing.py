"""How many KV tokens a rank's pool holds, and the longest request it accepts: one rule, applied by
the engine at start (measured memory) and by ``graphcp memory`` (config.json alone).

SGLang's meaning of ``--mem-fraction-static``: the fraction of a device's memory for the weights
plus the KV pool; the rest is the reserve for activations and graphs. The pool gets what the
fraction leaves after what is already in use (the weights, on a device to itself):
``pool = available - capacity x (1 - fraction)``. On CPU without the flag, the host runs other
things: the pool takes a fifth of the available memory, as before.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.errors import ConfigError

GIB, MIB = 1 << 30, 1 << 20
CPU_POOL_SHARE = 0.2


def default_mem_fraction(capacity: int, tp_size: int, pp_size: int, graph_buckets: int,
                         latent: bool) -> float:
    """SGLang 0.5.23's default for a prefill worker (``memory_hook.handle_gpu_memory_settings``):
    a reserve of 512 MiB + 1.5 MiB per activation token (its chunked-prefill size for the device's
    memory, at least 2048) + 1 GiB per 8 ranks of TP x PP + the prefill graphs (8 MiB a bucket; 1.5
    GiB for ``latent`` (MLA) attention), at least 10 GiB on devices over 60 GiB."""
    mib = capacity / MIB
    chunk = 2048 if mib < 20 * 1024 else 4096 if mib < 60 * 1024 else 8192 if mib < 160 * 1024 \
        else 16384
    reserved = 512 + max(chunk, 2048) * 1.5 + tp_size * pp_size / 8 * 1024
    if graph_buckets:
        reserved += 1536 if latent else graph_buckets * 8
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


@dataclass(frozen=True)
class PoolBudget:
    """The memory a rank's pool is sized from (bytes)."""
    capacity: int              # this rank's share of its device
    available: int             # free on it with the weights loaded
    fraction: float | None     # for weights + KV pool (None: CPU's share of available memory)
    state: int = 0             # per-request state (recurrent layers), taken before the pages

    @property
    def reserve(self) -> int:
        """What the pool leaves for activations and graphs."""
        if self.fraction is None:
            return int(self.available * (1 - CPU_POOL_SHARE))
        return int(self.capacity * (1 - self.fraction))

    @property
    def pool_bytes(self) -> int:
        if self.fraction is None:
            return int((self.available - self.state) * CPU_POOL_SHARE)
        return self.available - self.reserve - self.state


def measured_budget(device: torch.device, ranks_sharing: int, weights: int, state: int,
                    mem_fraction: float | None, device_gib: float | None, tp_size: int,
                    pp_size: int, graph_buckets: int, latent: bool) -> PoolBudget:
    """This rank's budget from the memory it sees now (its weights loaded). ``device_gib``
    (``--gpu-memory-gib``) assumes a device of that size: on CUDA what is in use still counts, on
    CPU the weights alone do (the plan's assumption, so a CPU engine sizes as ``graphcp memory``)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free, total = free // ranks_sharing, total // ranks_sharing
        capacity = int(device_gib * GIB) if device_gib else total
        available = capacity - (total - free)
    elif device_gib:
        capacity = int(device_gib * GIB)
        available = capacity - weights
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        capacity = os.sysconf("SC_PHYS_PAGES") * page // ranks_sharing
        available = os.sysconf("SC_AVPHYS_PAGES") * page // ranks_sharing
    fraction = mem_fraction
    if fraction is None and (device.type == "cuda" or device_gib):
        fraction = default_mem_fraction(capacity, tp_size, pp_size, graph_buckets, latent)
    return PoolBudget(capacity, available, fraction, state)


def pool_tokens(budget: PoolBudget, bytes_per_token: int, max_total_tokens: int | None,
                max_positions: int, max_batch_requests: int, page_size: int) -> int:
    """The pool's tokens on this budget (``--max-total-tokens`` checked against it), or a
    ConfigError saying what does not fit and which flag to change."""
    usable = budget.pool_bytes
    if budget.state and budget.available - budget.state <= 0:
        raise ConfigError(f"the per-request state needs {budget.state / GIB:.2f} GiB per rank, "
                          "more than is free; lower --max-state-requests")
    if max_total_tokens is not None:
        need = max_total_tokens * bytes_per_token
        room = usable if budget.fraction is not None else int(0.9 * (budget.available - budget.state))
        if need > room:
            raise ConfigError(f"--max-total-tokens {max_total_tokens}: the KV pool needs "
                              f"{need / GIB:.2f} GiB per rank and {max(room, 0) / GIB:.2f} GiB is left "
                              f"for it; lower it, or leave it unset{_fraction_hint(budget)}")
        return max_total_tokens
    tokens = min(max(usable, 0) // bytes_per_token, max_positions * max_batch_requests)
    if tokens < page_size:
        raise ConfigError(f"not enough memory for a KV pool: {max(usable, 0) / GIB:.2f} GiB left per "
                          f"rank after the weights and the {budget.reserve / GIB:.2f} GiB reserve"
                          f"{_fraction_hint(budget)}, or set --max-total-tokens")
    return tokens


def _fraction_hint(budget: PoolBudget) -> str:
    if budget.fraction is None:
        return ""
    return f"; raise --mem-fraction-static (now {budget.fraction})"


def agreed_tokens(compute: Callable[[], int], agree_min: Callable[[int], int]) -> int:
    """The pool's tokens, the same on every rank: the minimum of each rank's computed count (ranks
    with fewer layers or less free memory must not get bigger pools: the planner would refuse a
    batch on one rank only while its peers wait in a collective). A rank whose budget fails still
    joins the agreement, so its peers fail with it instead of waiting."""
    try:
        tokens, error = compute(), None
    except ConfigError as e:
        tokens, error = -1, e
    agreed = agree_min(tokens)
    if error is not None:
        raise error
    if agreed < 0:
        raise ConfigError("another rank cannot fit its KV pool (see its error); lower "
                          "--max-total-tokens or raise --mem-fraction-static")
    return agreed


def context_limit(max_positions: int, pool_tokens: int) -> int:
    """The longest request (cached + new tokens): the RoPE tables' reach and the pool's size."""
    return min(max_positions, pool_tokens)


def describe(weights: int, bytes_per_token: int, budget: PoolBudget, tokens: int,
             max_context: int) -> str:
    """One line of a rank's plan, as the engine logs it at start and ``graphcp memory`` prints it."""
    fraction = f"{budget.fraction}" if budget.fraction is not None else f"cpu share {CPU_POOL_SHARE}"
    return (f"weights {weights / GIB:.2f} GiB, KV {bytes_per_token} B/token, state "
            f"{budget.state / GIB:.2f} GiB, reserve {budget.reserve / GIB:.2f} GiB of "
            f"{budget.capacity / GIB:.2f} GiB (mem fraction {fraction}), pool {tokens} tokens, "
            f"longest request {max_context}")

"""Paged KV cache: the pool tensors (generic over the layer kinds' parts), LayerSplit pools, the page
allocator and per-request page tables, and ``make_pool``: the one place a rank's pool is built."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from graphcp.config import EngineArgs
from graphcp.kv.cache import DUMMY_SLOT, CachePart, LayerParts, PagedPool, bytes_per_token
from graphcp.kv.layer_split import LayerSplitPool
from graphcp.kv.pages import PageTable, RequestKV
from graphcp.kv.sharding import ShardedPool, group_pages, scratch_bytes_per_token
from graphcp.kv.sizing import agreed_tokens, context_limit, describe, measured_budget, pool_tokens
from graphcp.kv.states import StatePool, state_bytes

if TYPE_CHECKING:
    from graphcp.distributed.parallel import RankParallel

log = logging.getLogger("graphcp")


@dataclass
class RankCache:
    pool: PagedPool
    num_pages: int          # pages of every page table (the reserved dummy page included; under
                            # KV sharding the CP group's pages, C x this rank's)
    max_context: int        # the longest request (cached + new tokens) this rank accepts
    state_slots: int = 0    # per-request state slots (0: no layer keeps per-request state)


def make_pool(parts: LayerParts, args: EngineArgs, par: "RankParallel", dtype: torch.dtype, max_positions: int,
              write_kernel: Callable | None = None,
              state_parts: LayerParts | None = None, weight_bytes: int = 0,
              graph_buckets: int = 0, latent: bool = False) -> RankCache:
    """The rank's pool for ``parts`` (its stage's layers), the same size on every rank (the least
    any rank can hold: ``sizing.agreed_tokens``). PD LayerSplit: each CP rank keeps only its own
    layers (and a scratch layer), so the pool is sized as if it held 1/C of them. ``state_parts``:
    what layers keep per request (``kv/states.py``): --max-state-requests slots, plus one spare
    per request of a full batch (a batch writes spare slots until it commits), taken from the
    memory before the pages are sized. ``weight_bytes``, ``graph_buckets``, ``latent``: what the
    budget rule reads (``kv/sizing.py``). KV sharding (``kv/sharding.py``): the pool holds this
    rank's pages of the group's page table (C x as many) plus one scratch layer of the group's."""
    per_token, split = bytes_per_token(parts, dtype), args.enable_dsa_cache_layer_split
    sharded = args.enable_kv_cache_sharding
    if split:
        per_token = -(-per_token // args.cp_size)
    if sharded:
        per_token += scratch_bytes_per_token(parts, dtype, args.cp_size)
    state_parts = {layer: p for layer, p in (state_parts or {}).items() if p}
    slots = args.resolved_max_state_requests + args.max_batch_requests if state_parts else 0
    states = StatePool(state_parts, slots, dtype, par.device)
    budget = measured_budget(par.device, par.ranks_per_device, weight_bytes,
                             slots * state_bytes(state_parts, dtype), args.mem_fraction_static,
                             args.gpu_memory_gib, args.tp_size, args.pp_size, graph_buckets, latent)
    tokens = agreed_tokens(lambda: pool_tokens(budget, per_token, args.max_total_tokens, max_positions,
                                               args.max_batch_requests, args.page_size),
                           agree_min=par.min_over_world)
    num_pages = -(-tokens // args.page_size) + 1                   # + the reserved dummy page
    table_pages = group_pages(num_pages, args.cp_size) if sharded else num_pages
    max_context = context_limit(max_positions, tokens * args.cp_size if sharded else tokens)
    group = f"; KV sharded: the CP group holds {tokens * args.cp_size} tokens" if sharded else ""
    log.info("graphcp memory: rank %d: %s%s", par.me.rank,
             describe(weight_bytes, per_token, budget, tokens, max_context), group)
    if split:
        pool = LayerSplitPool(parts, num_pages, args.page_size, dtype, par.device, par.groups.cp, par.cp_ranks,
                              par.me.cp_rank)
    elif sharded:
        pool = ShardedPool(parts, num_pages, args.page_size, dtype, par.device, par.groups.cp,
                           args.cp_size, par.me.cp_rank)
    else:
        pool = PagedPool(parts, num_pages, args.page_size, dtype, par.device, write_kernel, states)
    return RankCache(pool, table_pages, max_context, slots)


__all__ = ["DUMMY_SLOT", "CachePart", "LayerParts", "PagedPool", "LayerSplitPool", "PageTable", "RequestKV",
           "RankCache", "ShardedPool", "StatePool", "bytes_per_token", "make_pool"]

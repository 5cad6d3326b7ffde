"""Each rank's memory plan from config.json alone: weights by dtype (the rank's model built on the
meta device by the loader's own rules, ``models/meta.py``), KV bytes per token, per-request state,
the reserve, the KV pool (the least any rank can hold, as the engine agrees it) and the longest
request. ``graphcp memory`` prints it; the engine logs the same numbers at start (``kv.make_pool``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from graphcp.attention.kinds import cache_parts, layer_kinds, state_parts
from graphcp.checkpoint.config import check_model_flags
from graphcp.checkpoint.meta import checkpoint_tensors, rank_model, weight_bytes_by_dtype
from graphcp.config import EngineArgs, resolve_dtype
from graphcp.distributed.parallel import rank_shards
from graphcp.errors import ConfigError
from graphcp.graph.runner import DEFAULT_BUCKETS
from graphcp.kv.cache import bytes_per_token
from graphcp.kv.sharding import scratch_bytes_per_token
from graphcp.kv.sizing import GIB, PoolBudget, context_limit, default_mem_fraction, pool_tokens
from graphcp.kv.states import state_bytes
from graphcp.models.config import ModelConfig
from graphcp.models.registry import family_of
from graphcp.planner import config_ineligibility

MIN_REQUEST = 4096      # a pool below one request of this many tokens (or the context) does not fit


@dataclass
class RankMemory:
    rank: int
    weight_bytes: int
    weight_bytes_by_dtype: dict[str, int]
    kv_bytes_per_token: int
    state_bytes: int
    reserve_bytes: int
    capacity_bytes: int
    own_max_total_tokens: int       # what this rank alone could hold (0: its budget fails)
    max_total_tokens: int = 0       # the pool every rank gets: the least of them
    max_context: int = 0
    group_kv_tokens: int = 0        # the CP group's unique KV tokens (C x the pool, KV sharding)
    problem: str | None = None


@dataclass
class MemoryReport:
    fits: bool
    problem: str | None
    device: str
    dtype: str
    mem_fraction_static: float | None
    device_gib: float
    ranks: list[RankMemory]

    def as_json(self) -> dict:
        return asdict(self)


def graph_reserve(args: EngineArgs, cfg: ModelConfig, device: str) -> tuple[int, bool]:
    """What the graph part of SGLang's default reserve reads: how many prefill graphs a rank
    captures, and whether the model's attention is MLA (a larger fixed reserve)."""
    kinds = layer_kinds(cfg, range(cfg.num_hidden_layers))
    reason = next((k.graph_reason for k in kinds.values() if k.graph_reason), None)
    latent = family_of(cfg).latent_attention
    if config_ineligibility(args, args.resolved_backend(), reason) is not None:
        return 0, latent
    return len(args.cuda_graph_buckets or DEFAULT_BUCKETS[device]), latent


def device_capacity(device: str, device_gib: float | None) -> int:
    """One rank's device memory: --gpu-memory-gib, else a visible GPU's, else the host's (CPU)."""
    if device_gib:
        return int(device_gib * GIB)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda on a machine without a GPU: give the device's memory "
                              "with --gpu-memory-gib (141 for an H200)")
        return torch.cuda.get_device_properties(0).total_memory
    import os
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_report(args: EngineArgs, device: str = "cuda",
                  device_gib: float | None = None) -> MemoryReport:
    """Every rank's plan, each rank on a device of its own (a deployment's layout)."""
    cfg = check_model_flags(args, weights=False)
    dtype = resolve_dtype(args.dtype, torch.device(device))
    capacity = device_capacity(device, device_gib)
    fraction = args.mem_fraction_static
    if fraction is None and (device == "cuda" or device_gib):
        fraction = default_mem_fraction(capacity, args.tp_size, args.pp_size,
                                        *graph_reserve(args, cfg, device))
    _, quantized = checkpoint_tensors(cfg, None)
    ranks, built = [], {}
    for rank in range(args.world_size):
        shards = rank_shards(args, cfg, rank)
        key = (shards.attn_tp.rank, shards.ffn_tp.rank, shards.ep, shards.layers)
        if key not in built:        # ranks holding the same shards hold the same bytes
            model, _ = rank_model(cfg, dtype, quantized, shards.attn_tp, shards.layers,
                                  shards.ffn_tp, shards.ep)
            built[key] = weight_bytes_by_dtype(model)
        by_dtype = built[key]
        weights = sum(by_dtype.values())
        per_token = bytes_per_token(cache_parts(cfg, shards.layers, args.attn_tp_size), dtype)
        if args.enable_dsa_cache_layer_split:
            per_token = -(-per_token // args.cp_size)
        if args.enable_kv_cache_sharding:           # + the scratch layer (kv/sharding.py)
            per_token += scratch_bytes_per_token(
                cache_parts(cfg, shards.layers, args.attn_tp_size), dtype, args.cp_size)
        states = state_parts(cfg, shards.layers, args.attn_tp_size)
        slots = args.resolved_max_state_requests + args.max_batch_requests if any(
            states.values()) else 0
        state = slots * state_bytes({k: v for k, v in states.items() if v}, dtype)
        budget = PoolBudget(capacity, capacity - weights, fraction, state)
        rm = RankMemory(rank, weights, by_dtype, per_token, state, budget.reserve, capacity, 0)
        if fraction is not None and weights > capacity * fraction:
            rm.problem = (f"weights {weights / GIB:.2f} GiB per rank exceed --mem-fraction-static "
                          f"{fraction} of {capacity / GIB:.2f} GiB ({capacity * fraction / GIB:.2f} GiB)")
        else:
            try:
                rm.own_max_total_tokens = pool_tokens(budget, per_token, args.max_total_tokens,
                                                      cfg.max_positions, args.max_batch_requests,
                                                      args.page_size)
            except ConfigError as e:
                rm.problem = str(e)
        ranks.append(rm)
    agreed = min(r.own_max_total_tokens for r in ranks)
    group = agreed * (args.cp_size if args.enable_kv_cache_sharding else 1)
    for r in ranks:
        r.max_total_tokens, r.group_kv_tokens = agreed, group
        r.max_context = context_limit(cfg.max_positions, group)
    problem = next((f"rank {r.rank}: {r.problem}" for r in ranks if r.problem), None)
    need = min(cfg.max_positions, MIN_REQUEST)
    if problem is None and agreed < need:
        problem = (f"the KV pool holds {agreed} tokens per rank, less than one {need}-token "
                   "request; raise --mem-fraction-static or use more ranks")
    return MemoryReport(problem is None, problem, device, str(dtype).removeprefix("torch."),
                        fraction, capacity / GIB, ranks)

"""The attention op the model calls through the forward context.

Per layer: all-gather this rank's K/V across the CP group (one collective for both), write every gathered
row to its paged-cache slot (padding rows go to the dummy slot), then run the kernel on the local queries.
Backend paths: ``trtllm_mha`` makes one combined varlen call over the zigzag page table (2R rows);
``flashattention`` makes two calls (early blocks, then late blocks); ``torch`` is the plain reference call.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from graphcp.kernels.registry import KernelArgs, KernelSpec
from graphcp.cp.metadata import CPMetadata
from graphcp.dist.comm import CPComm
from graphcp.forward_batch import HostMaxima
from graphcp.graph.protocol import graph_break
from graphcp.kv.cache import KVPool
from graphcp.profiling import nvtx_range


def _attend(spec: KernelSpec, args: KernelArgs, host: HostMaxima, capturable: bool = False) -> torch.Tensor:
    """A capturable call reads every length from device memory: its host maxima are 0 ("unknown")."""
    with nvtx_range("attention"):
        if capturable:
            return spec.run(args, 0, 0, host.workspace)
        return spec.run(args, host.max_q, host.max_kv, host.workspace)


def _split(args: KernelArgs, host: HostMaxima) -> tuple[KernelArgs, KernelArgs]:
    """(early, late) halves, made once per forward so kernels' per-forward caches hit on every layer."""
    meta = (args.cu_seqlens_q, args.page_rows, args.q_limits)
    cached = host.workspace.get("split_views")
    if cached is None or any(a is not b for a, b in zip(cached[0], meta)):
        n, r = host.early_rows, args.page_rows.shape[0] // 2
        early = (args.cu_seqlens_q[:r + 1], args.page_rows[:r], args.q_limits[:n])
        late = (args.cu_seqlens_q[r:] - n, args.page_rows[r:], args.q_limits[n:])
        cached = host.workspace["split_views"] = (meta, early, late)
    (cu_e, rows_e, lim_e), (cu_l, rows_l, lim_l) = cached[1], cached[2]
    n = host.early_rows
    early = replace(args, q=args.q[:n], out=args.out[:n], cu_seqlens_q=cu_e, page_rows=rows_e, q_limits=lim_e)
    late = replace(args, q=args.q[n:], out=args.out[n:], cu_seqlens_q=cu_l, page_rows=rows_l, q_limits=lim_l)
    return early, late


@graph_break
def _attend_break(spec: KernelSpec, args: KernelArgs, host: HostMaxima, split: bool) -> torch.Tensor:
    """Runs eagerly; a graph replay passes the live batch's ``host``, so the maxima are the batch's."""
    if not split:
        return _attend(spec, args, host)
    early, late = _split(args, host)        # flashattention path: early blocks, then late blocks
    _attend(spec, early, host)
    _attend(spec, late, host)
    return args.out


class PagedAttention:
    """Callable set in the forward context; owns the CP collectives and cache writes of one forward."""

    def __init__(self, pool: KVPool, meta: CPMetadata, comm: CPComm | None, kernel: KernelSpec,
                 host: HostMaxima, split_early_late: bool, scale: float) -> None:
        self.pool, self.meta, self.comm, self.kernel = pool, meta, comm, kernel
        self.host, self.split, self.scale = host, split_early_late, scale
        self.capturable = kernel.capturable(pool.device) and not split_early_late

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, pool = self.meta, self.pool
        pool.prepare(layer_id)          # LayerSplit: a non-owned layer's cached prefix comes from its owner
        if meta.cp_size > 1:
            local = torch.stack((k, v), dim=1)                                     # [B, 2, Hkv, D]
            gathered = local.new_empty((meta.cp_size * local.shape[0],) + local.shape[1:])
            self.comm.all_gather(gathered, local)
            pool.write(layer_id, meta.gather_slots, gathered[:, 0], gathered[:, 1])
        else:
            pool.write(layer_id, meta.gather_slots, k, v)
        page_rows = pool.map_pages(layer_id, meta.page_rows)      # LayerSplit scratch pages
        args = KernelArgs(q, pool.keys(layer_id), pool.values(layer_id), meta.cu_seqlens_q, page_rows,
                          meta.q_limits, torch.empty_like(q), pool.page_size, self.scale)
        if self.capturable:
            return _attend(self.kernel, args, self.host, capturable=True)
        return _attend_break(self.kernel, args, self.host, self.split)

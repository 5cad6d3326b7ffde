"""The dense (GQA) attention op a layer calls through the forward context: ``op(layer, q, k, v)``, with
``rows=`` (only those rows attend) and ``sinks=`` (per-head sink logits [local heads], gpt-oss) as options.
A layer in ``ModelConfig.sliding_layers`` attends through the model's window (keys p - W < j <= p).

Per layer: all-gather this rank's K/V across the CP group (one collective for both), write every gathered
row to its paged-cache slot (padding rows go to the dummy slot), then run the kernel on the local queries.
Backend paths: ``trtllm_mha`` makes one combined varlen call over the zigzag page table (2R rows);
``flashattention`` makes two calls (early blocks, then late blocks, where the layout's metadata and host
maxima split them); ``torch`` is the plain reference call.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from graphcp.attention.context import AttentionContext
from graphcp.cp.metadata import HostMaxima
from graphcp.graph.protocol import graph_break
from graphcp.kernels.registry import KernelArgs, KernelSpec
from graphcp.profiling import nvtx_range


def _attend(spec: KernelSpec, args: KernelArgs, host: HostMaxima, capturable: bool = False) -> torch.Tensor:
    """A capturable call reads every length from device memory: its host maxima are 0 ("unknown")."""
    with nvtx_range("attention"):
        if capturable:
            return spec.run(args, 0, 0, host.workspace)
        return spec.run(args, host.max_q, host.max_kv, host.workspace)


def _split(args: KernelArgs, early_sequences: int, host: HostMaxima) -> tuple[KernelArgs, KernelArgs]:
    """(early, late) halves, made once per forward so kernels' per-forward caches hit on every layer.
    The layout gives both cuts: ``early_sequences`` (static) and ``host.early_rows`` (the batch's)."""
    meta = (args.cu_seqlens_q, args.page_rows, args.q_limits)
    cached = host.workspace.get("split_views")
    if cached is None or any(a is not b for a, b in zip(cached[0], meta)):
        n, r = host.early_rows, early_sequences
        early = (args.cu_seqlens_q[:r + 1], args.page_rows[:r], args.q_limits[:n])
        late = (args.cu_seqlens_q[r:] - n, args.page_rows[r:], args.q_limits[n:])
        cached = host.workspace["split_views"] = (meta, early, late)
    (cu_e, rows_e, lim_e), (cu_l, rows_l, lim_l) = cached[1], cached[2]
    n = host.early_rows
    early = replace(args, q=args.q[:n], out=args.out[:n], cu_seqlens_q=cu_e, page_rows=rows_e, q_limits=lim_e)
    late = replace(args, q=args.q[n:], out=args.out[n:], cu_seqlens_q=cu_l, page_rows=rows_l, q_limits=lim_l)
    return early, late


@graph_break(host_arg="host")
def _attend_break(spec: KernelSpec, args: KernelArgs, host: HostMaxima, early_sequences: int) -> torch.Tensor:
    """Runs eagerly; a graph replay passes the live batch's ``host``, so the maxima are the batch's.
    ``early_sequences`` > 0: the flashattention path, early blocks then late blocks."""
    if not early_sequences:
        return _attend(spec, args, host)
    early, late = _split(args, early_sequences, host)
    _attend(spec, early, host)
    _attend(spec, late, host)
    return args.out


class PagedAttention:
    """Set in the forward context (through ``LayerOps``); owns the CP collectives and cache writes of one
    forward's dense layers."""

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx, self.meta, self.pool = ctx, ctx.meta, ctx.pool
        kernels, meta = ctx.kernels, ctx.meta
        self.kernels = kernels
        self.split = kernels.split_early_late and meta.early_sequences > 0
        self.early_sequences = meta.early_sequences if self.split else 0
        self.scale = ctx.cfg.head_dim ** -0.5

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rows: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this rank's tokens -> attention output [T, Hq, D]; with
        ``rows`` (each request's last-token row, ``ctx.last``) the K/V of every token are cached but
        only those rows attend: [R, Hq, D]. ``sinks`` [Hq]: one logit per head joins each row's
        softmax denominator (once per row, whatever the kernel splits)."""
        meta, pool = self.meta, self.pool
        pool.prepare(layer_id)          # LayerSplit: a non-owned layer's cached prefix comes from its owner
        if meta.cp_size > 1:
            gathered = self.ctx.all_gather(torch.stack((k, v), dim=1))           # [C * B, 2, Hkv, D]
            k, v = gathered[:, 0], gathered[:, 1]
        pool.write_kv(layer_id, meta.gather_slots, k, v, meta.gather_runs)
        queries, split = (meta.cu_seqlens_q, meta.page_rows, meta.q_limits), self.early_sequences
        if rows is not None:
            last = self.ctx.last
            q, split = q.index_select(0, rows), 0
            queries = (last.cu_seqlens_q, last.page_rows, last.q_limits)
        cu, page_rows, limits = queries
        page_rows = pool.map_pages(layer_id, page_rows)           # LayerSplit scratch pages
        k_part, v_part = pool.part(layer_id, "k"), pool.part(layer_id, "v")
        window = self.ctx.cfg.window(layer_id)
        kernel = self.kernels.kernel(window, sinks is not None)
        args = KernelArgs(q, k_part, v_part, cu, page_rows, limits, q.new_empty(q.shape),
                          pool.page_size, self.scale, window,
                          None if sinks is None else sinks.contiguous())
        if kernel.capturable(pool.device) and not self.split:
            return _attend(kernel, args, self.ctx.host, capturable=True)
        return _attend_break(kernel, args, self.ctx.host, split)


__all__ = ["PagedAttention"]

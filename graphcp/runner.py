"""ModelRunner: one rank's model, attention, KV pool, planner and graphs, wired; it runs a batch.

Data flows one way: planner (validation, DP groups, pages, the batch layout, graph-or-eager) -> descriptors
(raw batch data) -> CP metadata (tensor ops, graph-capturable) -> model -> attention ops (collectives,
cache writes, kernel) -> last-token logits. Each part is built by its own package (``attention.build``,
``kv.make_pool``, ``Planner``, ``GraphRunner``, the PD sender); the runner only wires them.
"""
from __future__ import annotations

import gc
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from graphcp import attention
from graphcp.aux_hidden import AuxHidden, gather_rows
from graphcp.batch import PrefillOutput, RankReply, Request
from graphcp.checkpoint.config import check_model_flags
from graphcp.checkpoint.loader import load_model
from graphcp.config import EngineArgs, resolve_dtype
from graphcp.cp.metadata import last_tokens
from graphcp.cp.strategy import BatchLayout, ContextParallelStrategy, make_strategy
from graphcp.distributed.comm import recv, send
from graphcp.distributed.parallel import RankParallel
from graphcp.errors import ConfigError
from graphcp.forward_batch import BatchInputs, Descriptors, ForwardBatch
from graphcp.forward_context import forward_context
from graphcp.graph.buffers import GraphInputs
from graphcp.graph.protocol import GraphCaptureError, capture_active
from graphcp.graph.runner import DEFAULT_BUCKETS, GraphRunner, gather_errors
from graphcp.kernels.registry import KernelChoices
from graphcp.kernels.resolve import probe_layer_ops
from graphcp.kv import make_pool
from graphcp.kv.pages import pages_per_request
from graphcp.memory import graph_reserve
from graphcp.models.common.moe import probe_experts
from graphcp.models.common.quantized import probe_gemm
from graphcp.planner import BatchPlan, Planner, config_ineligibility
from graphcp.profiling import count_host_ops, nvtx_range, peak_rss_bytes


class ModelRunner:
    def __init__(self, args: EngineArgs, rank: int = 0, device: torch.device | None = None,
                 capture_progress: bool = False) -> None:
        self.args, self.rank = args, rank
        device = device or torch.device(args.resolved_device())
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
        self.device = _normalize(device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model_config = cfg = check_model_flags(args)
        self.par = par = RankParallel.build(args, rank, cfg, self.device)
        self.aux = AuxHidden(args.speculative_aux_hidden_layers or (), cfg.hidden_size, par.layers)
        self.model = load_model(args.model_path, self.dtype, self.device, par.attn_tp, par.layers, par.ffn_tp,
                                par.ep)
        self.kernels = KernelChoices()      # the Triton layer ops this rank's model may run
        if self.device.type == "cuda":      # each checked once, eagerly, before any capture
            probe_layer_ops(self.kernels, self.device, self.dtype)
            probe_gemm(self.kernels, self.model, self.dtype)
            probe_experts(self.kernels, self.model, self.dtype)
            attention.probe_kernels(self.kernels, cfg, par.layers, par.attn_tp, self.device,
                                    self.dtype)
        layout = make_strategy(args.resolved_cp_strategy, args.cp_size)       # the flags' layout
        self.attention = attention.build(cfg, args, self.device, self.dtype, par.layers,
                                         layout.bottom_right_causal, self.kernels)
        # Only the logit rows of the last layer's output are read: it runs for them alone. Every
        # rank of a layer communicator then brings the same number of rows (one per request of the
        # one batch); DP groups' batches differ, and expert parallelism routes rows of its own.
        self.prune_last_layer = (par.last_stage and args.dp_size == 1 and par.moe_comm is None
                                 and self.model.prunes_last_layer())
        write = self.kernels.get("kv_write")
        graph_buckets, latent = graph_reserve(args, cfg, self.device.type)
        cache = make_pool(self.attention.cache_parts(), args, par, self.dtype, cfg.max_positions,
                          write, state_parts=self.attention.state_parts(),
                          weight_bytes=self.weight_bytes,
                          graph_buckets=graph_buckets, latent=latent)
        self.pool, self.max_context = cache.pool, cache.max_context
        # Adaptive CP: its threshold and weights measured by eager forwards, before the planner and
        # the graphs are built on the strategy.
        with self.kernels.active():
            self.strategy: ContextParallelStrategy = (self._calibrated() if args.enable_adaptive_cp
                                                      else layout)
        self.graph_reason = config_ineligibility(args, args.resolved_backend(), self.attention.graph_reason)
        buckets, inputs = self._graph_inputs() if self.graph_reason is None else ([], None)
        self.planner = Planner(self.strategy, args.cp_size, args.dp_size, par.me.dp_rank, cfg.vocab_size,
                               cache.num_pages, args.page_size, self.max_context, args.max_batch_requests,
                               par.me.cp_rank, cache.state_slots,
                               ids_buffer=inputs.staging.input_ids if inputs is not None else None)
        from graphcp.pd.sender import start_sender  # PD prefill mode: a Mooncake engine, the pool registered
        self.sender = start_sender(args, cfg, self.pool, par)
        self.graphs: GraphRunner | None = None
        if inputs is not None:
            collective_breaks = args.world_size > 1 and torch.distributed.get_backend() != "nccl"
            self.graphs = GraphRunner(self.forward, inputs, self.device, par.all_ranks_agree,
                                      collective_breaks, gather_errors(par.groups.tp))
            with torch.inference_mode(), self.kernels.active():
                self.graphs.capture_all(buckets, self._capture_batch,
                                        progress=capture_progress and rank == 0)

    @torch.inference_mode()
    def _calibrated(self) -> ContextParallelStrategy:
        """Adaptive CP's strategy, its cost model and threshold measured on this rank's forward."""
        from graphcp.calibrate import calibrate
        args = self.args
        calibration = calibrate(self._time_forward, self._time_gather, self.par.average, args.cp_size,
                                self.max_context, args.adaptive_cp_threshold)
        if self.rank == 0:
            calibration.announce()
        return calibration.strategy(args.cp_size)

    # -- graphs ----------------------------------------------------------------------------------
    def _graph_inputs(self) -> tuple[list[int], GraphInputs]:
        """The buckets to capture and the graphs' static inputs, sized for the largest."""
        args = self.args
        if args.capture_plan:
            from graphcp.capture_plan import load_plan_buckets
            buckets = load_plan_buckets(args.capture_plan, args)
        else:
            buckets = list(args.cuda_graph_buckets or DEFAULT_BUCKETS[self.device.type])
        buckets = sorted({self.strategy.aligned(b) for b in buckets})    # buffers are multiples of align
        inputs = GraphInputs.allocate(args.max_batch_requests,
                                      pages_per_request(self.max_context, args.page_size),
                                      self.strategy.cp_size * max(buckets), self.model_config.vocab_size,
                                      self.aux.width, self.dtype, self.device)
        return buckets, inputs

    def _capture_batch(self, bucket: int, seed: int) -> tuple[BatchInputs, BatchLayout]:
        """A random batch that fills ``bucket``; its pages are all the dummy page, so no real KV is touched."""
        req_cap, vocab = self.args.max_batch_requests, self.model_config.vocab_size
        dummy = self.strategy.dummy_batch(bucket, req_cap, self.max_context, seed)
        if dummy is None:
            raise GraphCaptureError(f"bucket {bucket}: no batch of <= {req_cap} requests within the "
                                    f"context limit {self.max_context} fills it")
        ext, prefix = dummy
        ids = [torch.randint(0, vocab, (e,), generator=torch.Generator().manual_seed(seed)) for e in ext]
        layout = replace(self.strategy.layout(ext, prefix, self.par.me.cp_rank), local_cap=bucket)
        return BatchInputs(ext, prefix, [[] for _ in ext], ids, layout.whole_on), layout

    # -- the forward (eager, and the body every graph captures) ----------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [req_cap, vocab] at each request's last new token (valid on rank 0, and on every rank
        for interleave). Tensor ops only, so the same body runs eagerly and inside a captured graph."""
        desc, layout, par, aux = batch.inputs, batch.layout, self.par, self.aux
        strategy = layout.strategy
        with nvtx_range("cp_metadata"):
            # Eager with host descriptors: numpy builds it (a capture records the tensor form).
            on_host = desc.extend_lens.device.type == "cpu" and not capture_active()
            meta = strategy.metadata(desc.extend_lens, desc.prefix_lens, desc.page_table,
                                     par.me.cp_rank % strategy.cp_size, layout.local_cap, self.args.page_size,
                                     desc.whole_on, on_host=on_host)
            meta = replace(meta, state_in=desc.state_in, state_out=desc.state_out)
            local_ids = desc.input_ids.index_select(0, meta.token_index)
            lens = (desc.extend_lens, desc.prefix_lens)
            if meta.token_index.device != self.device:      # eager on a GPU: built on the host, one copy
                meta, (local_ids, *lens) = meta.to(self.device, local_ids, *lens)
        # The last layer attends and runs its FFN for the logit rows only (its K/V are all cached).
        rows = meta.logit_rows if self.prune_last_layer else None
        last = last_tokens(*lens, meta) if rows is not None else None
        ops = self.attention.ops(self.pool, meta, par.comm, layout.host, last)
        with forward_context(ops, par.communicator, par.moe_comm, meta.valid):
            if par.first_stage:
                hidden, columns = self.model(local_ids, meta.positions, capture_layers=aux.here,
                                             output_rows=rows)
                received = {}
            else:   # pipeline: CP-local hidden states (and aux columns) from the previous stage
                message = torch.empty(layout.local_cap, aux.recv_width, dtype=self.dtype, device=self.device)
                recv(message, src=self.rank - self.args.tp_size)
                hidden, received = aux.unpack(message)
                hidden, columns = self.model(None, meta.positions, hidden=hidden,
                                             capture_layers=aux.here, output_rows=rows)
        columns = {**received, **dict(zip(aux.here, columns))}
        if not par.last_stage:
            send(aux.pack(hidden, columns), dst=self.rank + self.args.tp_size)
            return None
        if aux.layers:
            gather_rows(batch.aux_out, aux.local(columns), meta, par.comm)
        if rows is None:
            hidden = hidden.index_select(0, meta.logit_rows)
        rows = strategy.reduce_last_rows(hidden, meta, par.comm)
        return self.model.compute_logits(rows)

    def _time_forward(self, extend_lens: list[int], placement: str) -> float:
        """Seconds of one eager forward of fresh requests on the dummy page (calibration):
        "unsharded" (every rank runs all of it), "whole" (each request whole on one CP rank) or
        "split" (zigzag)."""
        import time

        from graphcp.cp.adaptive import AdaptiveZigzagStrategy
        ids = [torch.randint(0, self.model_config.vocab_size, (n,),
                             generator=torch.Generator().manual_seed(n)) for n in extend_lens]
        prefix, ps, cp = [0] * len(extend_lens), self.args.page_size, self.args.cp_size
        pages = [np.zeros(-(-n // ps), dtype=np.int64) for n in extend_lens]   # all the dummy page
        strategy = {"unsharded": make_strategy("zigzag", 1),
                    "whole": AdaptiveZigzagStrategy(cp, max(extend_lens) + 1),
                    "split": AdaptiveZigzagStrategy(cp, 2 * cp)}[placement]
        layout = strategy.layout(extend_lens, prefix, self.par.me.cp_rank)
        batch = BatchInputs(extend_lens, prefix, pages, ids, layout.whole_on)
        desc, aux = Descriptors.for_batch(batch), self._aux_buffer(sum(extend_lens))
        _sync(self.device)
        start = time.perf_counter()
        self.forward(ForwardBatch(desc, layout, aux))
        _sync(self.device)
        return time.perf_counter() - start

    def _time_gather(self, tokens: int) -> float:
        """Seconds of every layer's all-gather of ``tokens`` cache rows over the CP group
        (calibration): each layer gathers the row its attention kind caches (``cache_parts``);
        layers alike are timed once."""
        import time

        from graphcp.calibrate import gather_widths
        from graphcp.distributed.comm import all_gather_into
        comm, seconds = self.par.comm, 0.0
        for width, layers in gather_widths(self.attention.cache_parts(), self.dtype).items():
            rows = torch.zeros(tokens, width, dtype=self.dtype, device=self.device)
            out = rows.new_empty((comm.size * tokens, width))
            _sync(self.device)
            start = time.perf_counter()
            all_gather_into(out, rows, comm.group)
            _sync(self.device)
            seconds += (time.perf_counter() - start) * layers
        return seconds

    # -- serving ---------------------------------------------------------------------------------
    @property
    def answers(self) -> bool:
        """This rank's replies are what the engine returns (its DP group's output rank, last stage)."""
        return self.par.me.is_output and self.par.last_stage

    @torch.inference_mode()
    def prefill(self, requests: Sequence[Request], count_ops: bool = False,
                force_eager: bool = False) -> RankReply:
        graphs = self.graphs
        plan = self.planner.plan(requests, force_eager, self.graph_reason, graphs.buckets if graphs else (),
                                 graphs.failures if graphs else None)
        txn = self.planner.allocate(plan)
        try:
            with nvtx_range("prefill"):
                # A DP group without requests still joins the FFN and MoE collectives when there are any.
                run = plan.rids or self.par.communicator is not None or self.par.moe_comm is not None
                with self.kernels.active():
                    logits, aux, host_ops = self._run(plan, count_ops) if run else (None, None, 0)
            if logits is not None:
                logits = logits.to("cpu", torch.float32, copy=True)  # never alias the static output buffer
            if aux is not None:
                aux = aux.to("cpu", torch.float32, copy=True) if self.par.me.is_output else None
        except BaseException:
            self.planner.rollback(txn)
            raise
        self.planner.commit(txn)
        if logits is None:              # not an output rank (or this DP group got no request)
            logits = torch.zeros(0, self.model_config.vocab_size)
        out = PrefillOutput(
            logits=logits, next_token_ids=logits.argmax(-1).tolist(),
            mode="graph" if plan.bucket is not None else "eager", graph_bucket=plan.bucket,
            eager_reason=plan.eager_reason if plan.bucket is None else None, cp_applied=plan.cp_applied,
            per_rank_tokens=plan.per_rank_tokens, host_ops=host_ops if count_ops else None,
            aux_hidden_states=aux)
        return RankReply(out, plan.indices, self.par.me.dp_rank, plan.extend_lens)

    def _run(self, plan: BatchPlan, count_ops: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        rows = self.planner.pages.rows(plan.rids)
        self.pool.begin_batch(rows, plan.prefix_lens)
        batch, n = plan.inputs(rows, self.planner.pages.state_rows(plan.rids)), len(plan.rids)
        if plan.bucket is not None:
            aux = self.graphs.inputs.aux
            with count_host_ops(count_ops) as counter:
                logits = self.graphs.replay(plan.bucket, batch, plan.layout.host)
        else:
            with count_host_ops(count_ops) as counter:     # metadata on the host, then one copy
                aux = self._aux_buffer(sum(batch.extend_lens))
                logits = self.forward(ForwardBatch(Descriptors.for_batch(batch), plan.layout, aux))
        count = counter.count if counter is not None else 0
        if logits is None or n == 0:
            return None, None, count
        return logits[:n], (aux[:sum(plan.extend_lens)] if aux is not None else None), count

    def _aux_buffer(self, tokens: int) -> torch.Tensor | None:
        """An eager batch's aux output: one row per new token, plus the row that takes padding."""
        if not self.aux.layers:
            return None
        return torch.empty(tokens + 1, self.aux.width, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def kv_cache(self, rid: str) -> dict | None:
        """This rank's part of a request's KV: its pipeline stage's layers and its attention-TP heads
        (None when another DP group holds the request, or where attention-TP rank 0 holds the same
        rows: MLA caches are not split by head). The engine assembles the parts."""
        slots = self.planner.slots(rid)
        if slots is None or (self.par.me.attn_tp_rank and not self.attention.heads_split):
            return None
        slots, state = slots.to(self.device), self.planner.state_slot(rid)
        held = self.pool.held_layers(self.par.layers)       # LayerSplit: only this CP rank's layers
        rows = [self.pool.read(layer, self._kept(layer, slots))
                + self.pool.states.read(layer, state)
                for layer in held]
        layers = [self.attention.export(layer, parts) for layer, parts in zip(held, rows)]
        me = self.par.me
        return {"first_layer": held.start, "attn_tp_rank": me.attn_tp_rank, "cp_rank": me.cp_rank,
                "layers": layers, "some_layers": held != self.par.layers,
                "kinds": [self.attention.kinds[layer].name for layer in held],
                "kv_replicas": self.model_config.kv_replicas(self.args.attn_tp_size)}

    def _kept(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The slots a layer's cache keeps for later tokens: a sliding layer's last W - 1 (as
        transformers' sliding-window cache; older keys are never read again), else all."""
        window = self.model_config.window(layer)
        return slots[max(len(slots) - window + 1, 0):] if window else slots

    def transfer_kv(self, rid: str, destination: dict) -> dict | None:
        from graphcp.pd.sender import transfer_kv
        return transfer_kv(self.planner, self.sender, rid, destination)

    def sglang_write(self, rid: str, targets: list) -> dict:
        from graphcp.pd.sglang.rank import sglang_write
        return sglang_write(self, rid, targets)

    def cached_lens(self, rids: list[str]) -> list[int | None]:
        from graphcp.pd.sglang.rank import cached_lens
        return cached_lens(self, rids)

    def release(self, rid: str) -> None:
        self.planner.release(rid)

    def close(self) -> None:
        """Free what this rank holds on its device: graphs, static buffers, the pool, the weights."""
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = self.pool = self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def stats(self) -> dict:
        graphs = self.graphs
        return {"kv_tokens_total": self.planner.tokens_total, "kv_tokens_free": self.planner.tokens_free,
                "kv_bytes": self.pool.nbytes, "state_bytes": self.pool.states.nbytes,
                "state_bytes_per_request": self.pool.states.bytes_per_request,
                "state_slots_total": self.planner.state_slots_total,
                "state_slots_free": self.planner.state_slots_free,
                "weight_bytes": self.weight_bytes,
                "peak_rss_bytes": peak_rss_bytes(),
                "graph_buckets": graphs.buckets if graphs else [],
                "graph_captures": graphs.captures if graphs else 0,
                "graph_pool_bytes": graphs.pool_bytes if graphs else 0,
                "world_size": self.args.world_size, "attention_backend": self.args.resolved_backend(),
                "moe_traffic": self.par.moe_comm.traffic.as_dict() if self.par.moe_comm else None,
                "attention_kernel": self.attention.kernel_name, "eager_reason": self.graph_reason,
                "attention_kernel_windowed": self.attention.windowed_kernel,
                "kernel_choices": self.kernels.report(),
                "capture_failures": graphs.failures if graphs else {},
                "capture_records": [vars(r) for r in graphs.records.values()] if graphs else [],
                "adaptive_cp": self.strategy.describe_cost(), **self.pool.usage(self.planner.pages)}

    @property
    def weight_bytes(self) -> int:
        """What the weights hold resident on this rank (FP8 weights and their scales as stored)."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def collective_counts(self) -> dict:
        comm = self.par.comm
        return {"all_gathers": comm.num_all_gathers if comm else 0,
                "all_reduces": comm.num_all_reduces if comm else 0,
                "gathered_bytes": dict(comm.gathered_bytes) if comm else {},
                "gathered_layers": dict(comm.gathered_layers) if comm else {}}


def _normalize(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` compare unequal: give every CUDA device its index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""ModelRunner: one rank's model, KV pool and graphs; turns a planned batch into logits.

Data flows one way: planner (validation, DP groups, pages, layout, graph-or-eager) -> ForwardBatch (raw
descriptors) -> CP metadata (tensor ops, graph-capturable) -> model -> attention op (collectives, cache
writes, kernel) -> last-token logits. The runner is also the graph runner's target: it loads capture
batches and live batches into the static inputs the graphs read.
"""
from __future__ import annotations

from typing import Sequence

import torch

from graphcp.attention.dsa import DSAAttention
from graphcp.attention.op import PagedAttention
from graphcp.kernels.registry import KERNELS, kv_write_kernel, resolve_kernel
from graphcp.aux_hidden import AuxHidden, gather_rows
from graphcp.batch import PrefillOutput, RankReply, Request
from graphcp.config import EngineArgs, check_model_fits
from graphcp.errors import ConfigError
from graphcp.cp.adaptive import adaptive_strategy
from graphcp.cp.strategy import make_strategy
from graphcp.dist.comm import recv, send
from graphcp.dist.procs import peak_rss_bytes
from graphcp.dist.parallel import RankParallel
from graphcp.forward_batch import ForwardBatch
from graphcp.forward_context import forward_context
from graphcp.graph.buffers import Descriptors
from graphcp.graph.protocol import GraphCaptureError
from graphcp.graph.runner import DEFAULT_BUCKETS, GraphRunner
from graphcp.kv.cache import KVPool
from graphcp.kv.dsa_cache import DSAPool
from graphcp.kv.sizing import context_limit, kv_tokens
from graphcp.models import fp8, load_model, read_model_config
from graphcp.models.config import check_expert_parallel
from graphcp.models.dsa_config import check_dsa_flags
from graphcp.models.moe import probe_experts
from graphcp.models.layers import probe_layer_kernels
from graphcp.pd.layer_split import LayerSplitDSAPool, LayerSplitPool
from graphcp.pd.sender import start_sender
from graphcp.planner import BatchPlan, Planner, config_ineligibility
from graphcp.profiling import count_host_ops, nvtx_range

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_model_flags(args: EngineArgs):  # noqa: ANN201 - a ModelConfig
    """The flags that depend on the model, judged from its config alone: the engine calls this before any
    rank process starts, so a bad flag costs no start-up."""
    cfg = read_model_config(args.model_path)
    check_model_fits(args, cfg)
    check_expert_parallel(cfg, args.ep_size)
    if cfg.dsa is not None:
        check_dsa_flags(args)
    return cfg


class ModelRunner:
    def __init__(self, args: EngineArgs, rank: int = 0, device: torch.device | None = None,
                 capture_progress: bool = False) -> None:
        self.args, self.rank = args, rank
        device = device or torch.device(args.resolved_device())
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
        self.device = _normalize(device)
        self.dtype = _resolve_dtype(args.dtype, self.device)
        self.model_config = cfg = check_model_flags(args)
        self.par = par = RankParallel.build(args, rank, cfg, self.device)
        self.me, self.comm = par.me, par.comm
        self.backend = args.resolved_backend()
        atp = args.attn_tp_size
        heads = (cfg.num_attention_heads // atp, cfg.num_key_value_heads // atp)
        interleave = args.cp_size > 1 and args.cp_strategy == "interleave"
        self.kernel_name = resolve_kernel(args.attention_kernel, self.device, self.dtype, cfg.head_dim,
                                          bottom_right=not interleave, page_size=args.page_size, heads=heads)
        self.kernel = KERNELS[self.kernel_name]
        self.strategy = make_strategy(args.cp_strategy or "zigzag", args.cp_size)
        self.layers = par.layers
        self.aux = AuxHidden(args.speculative_aux_hidden_layers or (), cfg.hidden_size, par.layers)
        self.model = load_model(args.model_path, self.dtype, self.device, par.attn_tp, par.layers, par.ffn_tp,
                                par.ep)
        if self.device.type == "cuda":      # each Triton layer op checked once, eagerly, before any capture
            probe_layer_kernels(self.device, self.dtype)
            fp8.probe_gemm(self.model, self.dtype)
            probe_experts(self.model)

        per_token = KVPool.bytes_per_token(len(self.layers), heads[1], cfg.head_dim, self.dtype)
        if cfg.dsa is not None:
            per_token = DSAPool.bytes_per_token(cfg, self.dtype)
        split = args.enable_dsa_cache_layer_split       # PD LayerSplit: this CP rank's layers + a scratch layer
        if split:
            per_token = -(-per_token // args.cp_size)   # about 1/C of the layers per rank
        tokens = kv_tokens(args.max_total_tokens, per_token, self.device, par.ranks_per_device,
                           cfg.max_position_embeddings, args.max_batch_requests, args.page_size)
        num_pages = -(-tokens // args.page_size) + 1                   # + the reserved dummy page
        self.max_context = context_limit(cfg.max_position_embeddings, tokens, cfg.sliding_window, rank == 0)
        cp_group = (par.groups.cp, par.cp_ranks, self.me.cp_rank)
        if cfg.dsa is not None:                   # MLA rows + indexer keys
            d = cfg.dsa
            shape = (cfg.num_hidden_layers, num_pages, args.page_size, d.kv_lora_rank, d.qk_rope_head_dim,
                     d.index_head_dim, d.shared_indexer, self.dtype, self.device)
            self.pool = LayerSplitDSAPool(*shape, *cp_group) if split else DSAPool(*shape)
        elif split:
            shape = (len(self.layers), num_pages, args.page_size, heads[1], cfg.head_dim, self.dtype, self.device)
            self.pool = LayerSplitPool(*shape, *cp_group)
        else:
            self.pool = KVPool(len(self.layers), num_pages, args.page_size, heads[1], cfg.head_dim, self.dtype,
                               self.device, layer_offset=self.layers.start, write_kernel=kv_write_kernel(self.device))
        self.planner = Planner(self.strategy, args.cp_size, args.dp_size, self.me.dp_rank, cfg.vocab_size,
                               num_pages, args.page_size, self.max_context, args.max_batch_requests)
        self.scale = cfg.head_dim ** -0.5
        self.kv_sender = start_sender(self)      # PD prefill mode: a Mooncake engine with the pool registered
        if args.enable_adaptive_cp:              # placement weights measured here, before any capture
            from graphcp.calibrate import calibrate
            with torch.inference_mode():
                cost = calibrate(self)
            self.strategy = self.planner.strategy = adaptive_strategy(args.cp_size, args.adaptive_cp_threshold,
                                                                      cost, rank == 0)

        self.graph_reason = config_ineligibility(args, self.backend, dsa=cfg.dsa is not None)
        self.graphs: GraphRunner | None = None
        if self.graph_reason is None:
            self._capture(capture_progress and rank == 0)

    # -- graphs: the GraphTarget hooks -----------------------------------------------------------
    @torch.inference_mode()
    def _capture(self, progress: bool) -> None:
        args = self.args
        if args.capture_plan:
            from graphcp.capture_plan import load_plan_buckets
            buckets = load_plan_buckets(args.capture_plan, args)
        else:
            buckets = list(args.cuda_graph_buckets or DEFAULT_BUCKETS[self.device.type])
        buckets = sorted({self.strategy.aligned(b) for b in buckets})    # buffers are multiples of align
        req_cap, pages_cap = args.max_batch_requests, self.planner.pages.max_pages_per_request
        ids_cap = self.strategy.cp_size * max(buckets)
        self.static = Descriptors.allocate(req_cap, pages_cap, ids_cap, self.device)
        self.staging = Descriptors.allocate(req_cap, pages_cap, ids_cap, "cpu", pin=self.device.type == "cuda")
        logits = torch.zeros(req_cap, self.model_config.vocab_size, dtype=torch.float32, device=self.device)
        # Speculative aux rows of the largest bucket's batch, plus the row that takes padding.
        self.aux_static = torch.zeros(ids_cap + 1, self.aux.width, dtype=self.dtype,
                                      device=self.device) if self.aux.layers else None
        self.graphs = GraphRunner(self, self.device, logits, self.par.all_ranks_agree)
        self.graphs.capture_all(buckets, progress=progress)

    def prepare_for_capture(self, bucket: int, seed: int) -> ForwardBatch:
        """A random batch that fills ``bucket``; its pages are all the dummy page, so no real KV is touched."""
        req_cap, vocab = self.args.max_batch_requests, self.model_config.vocab_size
        dummy = self.strategy.dummy_batch(bucket, req_cap, self.max_context, seed)
        if dummy is None:
            raise GraphCaptureError(f"bucket {bucket}: no batch of <= {req_cap} requests within the "
                                    f"context limit {self.max_context} fills it")
        ext, prefix = dummy
        ids = [torch.randint(0, vocab, (e,), generator=torch.Generator().manual_seed(seed)) for e in ext]
        strategy = self.strategy.for_batch(ext, prefix)
        self.staging.fill(ext, prefix, [[] for _ in ext], ids, strategy.whole_on)
        self.static.packed.copy_(self.staging.packed)
        host = strategy.host_maxima(ext, prefix, self.me.cp_rank)
        return ForwardBatch(self.static, strategy, bucket, host, bucket, self.aux_static)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        self.static.packed.copy_(batch.inputs.packed, non_blocking=True)

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.static.packed] + ([self.aux_static] if self.aux_static is not None else [])

    def has_collective_breaks(self) -> bool:
        return self.args.world_size > 1 and torch.distributed.get_backend() != "nccl"

    # -- the forward (eager, and the body every graph captures) ----------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [req_cap, vocab] at each request's last new token (valid on rank 0, and on every rank
        for interleave). Tensor ops only, so the same body runs eagerly and inside a captured graph."""
        desc, strategy = batch.inputs, batch.strategy
        with nvtx_range("cp_metadata"):
            meta = strategy.metadata(desc.extend_lens, desc.prefix_lens, desc.page_table,
                                     self.me.cp_rank % strategy.cp_size, batch.local_cap, self.args.page_size,
                                     desc.whole_on)
            local_ids = desc.input_ids.index_select(0, meta.token_index)
            if meta.token_index.device != self.device:      # eager on a GPU: built on the host, one copy
                meta, (local_ids,) = meta.to(self.device, local_ids)
        split = self.backend == "flashattention" and strategy.splits_early_late
        attention = PagedAttention(self.pool, meta, self.comm, self.kernel, batch.host, split, self.scale)
        if self.model_config.dsa is not None:
            attention = DSAAttention(self.pool, meta, self.comm, self.model_config,
                                     self.args.attention_kernel)
        par, aux = self.par, self.aux
        with forward_context(attention, par.communicator, par.moe_comm, meta.valid):
            if par.first_stage:
                hidden, columns = self.model(local_ids, meta.positions, capture_layers=aux.here)
                received = {}
            else:   # pipeline: CP-local hidden states (and aux columns) from the previous stage
                message = torch.empty(batch.local_cap, aux.recv_width, dtype=self.dtype, device=self.device)
                recv(message, src=self.rank - self.args.tp_size)
                hidden, received = aux.unpack(message)
                hidden, columns = self.model(None, meta.positions, hidden=hidden, capture_layers=aux.here)
        columns = {**received, **dict(zip(aux.here, columns))}
        if not par.last_stage:
            send(aux.pack(hidden, columns), dst=self.rank + self.args.tp_size)
            return None
        if aux.layers:
            gather_rows(batch.aux_out, aux.local(columns), meta, self.comm)
        rows = strategy.reduce_last_rows(hidden.index_select(0, meta.logit_rows), meta, self.comm)
        return self.model.compute_logits(rows)

    # -- serving ---------------------------------------------------------------------------------
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
                logits, aux, host_ops = self._run(plan, count_ops) if run else (None, None, 0)
            if logits is not None:
                logits = logits.to("cpu", torch.float32, copy=True)  # never alias the static output buffer
            if aux is not None:
                aux = aux.to("cpu", torch.float32, copy=True) if self.me.is_output else None
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
        return RankReply(out, plan.indices, self.me.dp_rank, plan.extend_lens)

    def _run(self, plan: BatchPlan, count_ops: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        rows = self.planner.pages.rows(plan.rids)
        self.pool.begin_batch(rows, plan.prefix_lens)
        ext, prefix, ids = plan.extend_lens, plan.prefix_lens, plan.ids
        n = len(plan.rids)
        if n == 0:   # an empty DP group: one zero-length padding request
            ext, prefix, rows, ids = [0], [0], [[]], [torch.zeros(0, dtype=torch.long)]
        host = plan.strategy.host_maxima(ext, prefix, self.me.cp_rank)
        if plan.bucket is not None:
            self.staging.fill(ext, prefix, rows, ids, plan.strategy.whole_on)
            aux = self.aux_static
            batch = ForwardBatch(self.staging, plan.strategy, plan.bucket, host, plan.bucket, aux)
            with count_host_ops(count_ops) as counter:
                logits = self.graphs.replay(plan.bucket, batch)
        else:
            with count_host_ops(count_ops) as counter:     # metadata on the host, then one copy
                desc = Descriptors.allocate(len(ext), max(1, max(len(r) for r in rows)), max(1, sum(ext)))
                desc.fill(ext, prefix, rows, ids, plan.strategy.whole_on)
                aux = self._aux_buffer(sum(ext))
                logits = self.forward(ForwardBatch(desc, plan.strategy, plan.local_cap, host, None, aux))
        count = counter.count if counter is not None else 0
        if logits is None or n == 0:
            return None, None, count
        return logits[:n], (aux[:sum(ext)] if aux is not None else None), count

    def _aux_buffer(self, tokens: int) -> torch.Tensor | None:
        """An eager batch's aux output: one row per new token, plus the row that takes padding."""
        if not self.aux.layers:
            return None
        return torch.empty(tokens + 1, self.aux.width, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def kv_cache(self, rid: str) -> dict | None:
        """This rank's part of a request's KV: its pipeline stage's layers and its attention-TP heads
        (None when another DP group holds the request). The engine assembles the parts."""
        slots = self.planner.slots(rid)
        if slots is None:
            return None
        slots = slots.to(self.device)
        layers = []
        held = self.pool.held_layers(self.layers)       # LayerSplit: only this CP rank's layers
        for layer in held:
            layers.append(self.pool.export(layer, slots))
        return {"first_layer": held.start, "attn_tp_rank": self.me.attn_tp_rank,
                "cp_rank": self.me.cp_rank, "layers": layers, "layer_split": held != self.layers}

    def release(self, rid: str) -> None:
        self.planner.release(rid)

    def stats(self) -> dict:
        graphs = self.graphs
        return {"kv_tokens_total": self.planner.tokens_total, "kv_tokens_free": self.planner.tokens_free,
                "kv_bytes": self.pool.nbytes,
                "weight_bytes": sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
                "peak_rss_bytes": peak_rss_bytes(),
                "graph_buckets": graphs.buckets if graphs else [],
                "graph_captures": graphs.captures if graphs else 0,
                "world_size": self.args.world_size, "attention_backend": self.backend,
                "moe_traffic": self.par.moe_comm.traffic.as_dict() if self.par.moe_comm else None,
                "attention_kernel": self.kernel_name, "eager_reason": self.graph_reason,
                "capture_failures": graphs.failures if graphs else {},
                "capture_records": [vars(r) for r in graphs.records.values()] if graphs else [],
                "adaptive_cp": _adaptive_stats(self.strategy)}

    def collective_counts(self) -> dict:
        comm = self.comm
        return {"all_gathers": comm.num_all_gathers if comm else 0,
                "all_reduces": comm.num_all_reduces if comm else 0}


def _adaptive_stats(strategy) -> dict | None:  # noqa: ANN001
    cost = getattr(strategy, "cost", None)
    if cost is None:
        return None
    return {"threshold": strategy.threshold, "per_token_s": cost.per_token, "per_pair_s": cost.per_pair,
            "per_gather_token_s": cost.per_gather_token, "fixed_s": cost.fixed}


def _normalize(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` compare unequal: give every CUDA device its index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]

"""ModelRunner: one rank's model, KV cache and graphs; turns a validated batch into logits.

Data flows one way: batch -> descriptors -> CP metadata (tensor ops, graph-capturable) -> model -> attention
op (collectives, cache writes, kernel) -> last-token logits.
"""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

import torch

from graphcp.attention.op import PagedAttention, kernel_fn, resolve_kernel
from graphcp.attention.torch_ref import HostLengths
from graphcp.batch import PrefillOutput, Request, validate_requests
from graphcp.config import EngineArgs
from graphcp.cp.strategy import ContextParallelStrategy, InterleaveStrategy, make_strategy, unsharded
from graphcp.dist.comm import CPComm, FFNCommunicator, all_reduce, recv, send
from graphcp.dist.topology import Groups, build_groups, rank_info, rank_of
from graphcp.errors import ConfigError, RequestError
from graphcp.models.parallel import TPInfo, shard_range
from graphcp.forward_context import forward_context
from graphcp.graph.buffers import Descriptors
from graphcp.graph.capture import OpCounter
from graphcp.graph.runner import DEFAULT_BUCKETS, GraphRunner, config_ineligibility, select_bucket
from graphcp.kv.cache import KVPool
from graphcp.kv.pages import PageTable
from graphcp.models import load_model, read_model_config
from graphcp.profiling import nvtx_range

log = logging.getLogger("graphcp")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Plan:
    """Host-side decisions for one batch, made identically on every rank."""
    rids: list[str]
    ids: list[torch.Tensor]
    extend_lens: list[int]
    prefix_lens: list[int]
    strategy: ContextParallelStrategy
    cp_applied: bool
    per_rank_tokens: list[int]
    bucket: int | None
    eager_reason: str | None
    indices: list[int]           # positions of these requests in the caller's batch (DP splits batches)
    local_cap: int               # rows of this rank's padded buffers (eager)
    dp_groups: list[int]         # DP group of every request of the batch
    all_rids: list[str]
    all_extend_lens: list[int]


class ModelRunner:
    def __init__(self, args: EngineArgs, rank: int = 0, device: torch.device | None = None,
                 capture_progress: bool = False) -> None:
        self.args, self.rank = args, rank
        self.me = rank_info(args, rank)
        groups = build_groups(args, self.me) if args.world_size > 1 else Groups(None, None)
        self.device = device or torch.device(args.resolved_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
        self.dtype = _resolve_dtype(args.dtype, self.device)
        self.model_config = cfg = read_model_config(args.model_path)
        self.backend = args.resolved_backend()
        atp = args.attn_tp_size
        if cfg.num_key_value_heads % atp:
            raise ConfigError(f"--tp: attention TP size {atp} (tp / (dp x attn-cp-size)) must divide "
                              f"num_key_value_heads={cfg.num_key_value_heads}")
        if args.pp_size > cfg.num_hidden_layers:
            raise ConfigError(f"--pp {args.pp_size} exceeds the model's {cfg.num_hidden_layers} layers")
        interleave = args.cp_size > 1 and args.cp_strategy == "interleave"
        self.kernel_name = resolve_kernel(args.attention_kernel, self.device, self.dtype, cfg.head_dim,
                                          bottom_right=not interleave, page_size=args.page_size,
                                          heads=(cfg.num_attention_heads // atp, cfg.num_key_value_heads // atp))
        self.kernel, self.kernel_capturable = kernel_fn(self.kernel_name, self.device)
        self.strategy = make_strategy(args.cp_strategy or "zigzag", args.cp_size)
        self.comm = CPComm(groups.cp, args.cp_size, self.me.cp_rank) if args.cp_size > 1 else None
        self.tp = TPInfo(atp, self.me.attn_tp_rank, groups.attn_tp)
        tp_rank = rank % args.tp_size
        # The dense FFN is split over the whole TP world by default; when that is wider than attention TP,
        # a layer communicator gathers every CP/DP rank's tokens before it and hands each rank its rows after.
        wide = args.resolved_ffn_tp_size > atp
        ffn_tp = TPInfo(args.tp_size, tp_rank, groups.tp) if wide else self.tp
        self.communicator = FFNCommunicator(groups.tp, args.tp_size, atp, tp_rank // atp) if wide else None
        self.layers = range(*shard_range(cfg.num_hidden_layers, args.pp_size, self.me.pp_rank))
        self.first_stage, self.last_stage = self.me.pp_rank == 0, self.me.pp_rank == args.pp_size - 1

        self.model = load_model(args.model_path, self.dtype, self.device, self.tp, self.layers, ffn_tp)
        tokens = _kv_tokens(args, cfg, self.dtype, self.device, len(self.layers))
        num_pages = -(-tokens // args.page_size) + 1                   # + the reserved dummy page
        self.max_context = min(cfg.max_position_embeddings, tokens)
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_context:
            # Within the window every key is visible, so full causal attention is exact; past it, it is not,
            # and graphcp has no windowed kernels: longer requests are refused instead of answered wrongly.
            self.max_context = cfg.sliding_window
            if rank == 0:
                log.warning("graphcp: the model attends through a %d-token sliding window, which graphcp does not "
                            "implement: requests are limited to %d tokens", cfg.sliding_window, cfg.sliding_window)
        pool_shape = (len(self.layers), num_pages, args.page_size, cfg.num_key_value_heads // atp, cfg.head_dim,
                      self.dtype, self.device)
        if args.enable_dsa_cache_layer_split:     # PD LayerSplit: this CP rank's layers + one scratch layer
            from graphcp.pd.layer_split import LayerSplitPool
            cp_ranks = [rank_of(args, self.me.pp_rank, self.me.dp_rank, c, self.me.attn_tp_rank)
                        for c in range(args.cp_size)]
            self.pool = LayerSplitPool(*pool_shape, groups.cp, cp_ranks, self.me.cp_rank)
        else:
            self.pool = KVPool(*pool_shape, layer_offset=self.layers.start)
        # Every rank mirrors every DP group's page table, so all ranks accept or refuse a batch alike.
        self.dp_pages = [PageTable(num_pages, args.page_size, self.max_context) for _ in range(args.dp_size)]
        self.pages = self.dp_pages[self.me.dp_rank]
        from graphcp.pd.sender import start_sender
        self.kv_sender = start_sender(self)      # PD prefill mode: Mooncake engine with the pool registered
        self.host = HostLengths()
        self.scale = cfg.head_dim ** -0.5

        self.graph_reason = config_ineligibility(args, self.backend)
        self.graphs: GraphRunner | None = None
        if self.graph_reason is None:
            self._capture(capture_progress)

    # -- graphs ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture(self, progress: bool) -> None:
        args = self.args
        if args.capture_plan:
            from graphcp.capture_plan import load_plan_buckets
            buckets = load_plan_buckets(args.capture_plan, args)
        else:
            buckets = list(args.cuda_graph_buckets or DEFAULT_BUCKETS[self.device.type])
        cap = self.strategy.align
        buckets = sorted({-(-b // cap) * cap for b in buckets})       # zigzag buffers are multiples of 2C
        self.graphs = GraphRunner(
            forward=lambda desc, local_cap: self.forward(desc, self.strategy, local_cap),
            set_host=lambda ext, pre: self._set_host(self.strategy, ext, pre),
            strategy=self.strategy, device=self.device, req_cap=args.max_batch_requests,
            pages_cap=self.pages.max_pages_per_request, vocab_size=self.model_config.vocab_size,
            max_bucket=max(buckets), max_context=self.max_context, agree=self._all_ranks_agree)
        self.graphs.capture_all(buckets, progress=progress and self.rank == 0)

    def _all_ranks_agree(self, ok: bool) -> bool:
        if self.comm is None:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.long, device=self.device)
        all_reduce(flag, self.comm.group)
        return int(flag.item()) == 0

    # -- the forward (eager, and the body every graph captures) ----------------------------------
    def forward(self, desc: Descriptors, strategy: ContextParallelStrategy, local_cap: int) -> torch.Tensor:
        """Logits [req_cap, vocab] at each request's last new token (valid on rank 0, and every rank
        for interleave). Tensor ops only, so the same body runs eagerly and inside a captured graph."""
        with nvtx_range("cp_metadata"):
            meta = strategy.metadata(desc.extend_lens, desc.prefix_lens, desc.page_table,
                                     self.me.cp_rank % strategy.cp_size, local_cap, self.args.page_size)
            local_ids = desc.input_ids.index_select(0, meta.token_index)
            if meta.token_index.device != self.device:      # eager on a GPU: built on the host, one copy
                meta, (local_ids,) = meta.to(self.device, local_ids)
        attention = PagedAttention(self.pool, meta, self.comm, self.kernel, self.kernel_capturable, self.host,
                                   split_early_late=self.backend == "flashattention" and strategy.name == "zigzag",
                                   scale=self.scale)
        with forward_context(attention, self.communicator):
            if self.first_stage:
                hidden = self.model(local_ids, meta.positions)
            else:   # pipeline: CP-local hidden states from the previous stage, no gather in between
                hidden = torch.empty(local_cap, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
                recv(hidden, src=self.rank - self.args.tp_size)
                hidden = self.model(None, meta.positions, hidden=hidden)
        if not self.last_stage:
            send(hidden, dst=self.rank + self.args.tp_size)
            return None
        rows = hidden.index_select(0, meta.logit_rows)
        if isinstance(strategy, InterleaveStrategy) and strategy.cp_size > 1:
            # The last tokens are spread over ranks: zero the rows this rank does not own and sum.
            rows = rows * meta.logit_owner[:, None].to(rows.dtype)
            self.comm.all_reduce(rows)
        return self.model.compute_logits(rows)

    def _set_host(self, strategy: ContextParallelStrategy, extend_lens: list[int], prefix_lens: list[int]) -> None:
        """Host maxima the break kernels need (the live batch's, refreshed before each replay)."""
        c = strategy.cp_size
        rank = self.rank % c
        self.host.workspace.clear()
        if strategy.name == "zigzag":
            self.host.max_q = max((-(-n // (2 * c)) for n in extend_lens), default=0)
            self.host.early_rows = sum(n // (2 * c) + (rank < n % (2 * c)) for n in extend_lens)
        else:
            self.host.max_q = max((-(-n // c) for n in extend_lens), default=0)
            self.host.early_rows = 0
        self.host.max_kv = max((p + n for p, n in zip(prefix_lens, extend_lens)), default=0)

    # -- serving ---------------------------------------------------------------------------------
    def assign_dp(self, rids: list[str], extend_lens: list[int]) -> list[int]:
        """DP group of each request: where its KV already lives, else the group with the fewest new tokens."""
        load = [0] * self.args.dp_size
        groups = []
        for rid, n in zip(rids, extend_lens):
            owner = next((g for g, pages in enumerate(self.dp_pages) if rid in pages.requests), None)
            g = owner if owner is not None else min(range(self.args.dp_size), key=lambda d: (load[d], d))
            load[g] += n
            groups.append(g)
        return groups

    def plan(self, requests: list[Request], force_eager: bool = False) -> _Plan:
        all_rids, all_ids = validate_requests(requests, self.model_config.vocab_size)
        groups = self.assign_dp(all_rids, [t.numel() for t in all_ids])
        for g, pages in enumerate(self.dp_pages):          # every group's check, on every rank
            mine = [i for i, d in enumerate(groups) if d == g]
            pages.check([all_rids[i] for i in mine], [all_ids[i].numel() for i in mine])
        indices = [i for i, d in enumerate(groups) if d == self.me.dp_rank]
        rids, ids = [all_rids[i] for i in indices], [all_ids[i] for i in indices]
        ext = [t.numel() for t in ids]
        prefix = [self.pages.prefix_len(r) for r in rids]
        strategy, cp_applied = self.strategy, self.args.cp_size > 1
        if cp_applied and not strategy.applies(ext):
            strategy, cp_applied = unsharded(), False
        all_ext = [t.numel() for t in all_ids]
        # Every DP group pads to the widest group's rows: the FFN layout gathers equal blocks from all.
        local_cap = max(self._local_cap([n for n, d in zip(all_ext, groups) if d == g])
                        for g in range(self.args.dp_size))
        # Unsharded, every rank holds the whole batch.
        counts = strategy.per_rank_tokens(ext) if cp_applied else [sum(ext)] * self.args.cp_size
        bucket, reason = None, self.graph_reason
        if reason is None and force_eager:
            reason = "eager forced by the caller (force_eager=True)"
        if reason is None:
            if self.args.cp_size > 1 and not cp_applied:
                reason = f"zigzag needs every request to have >= {2 * self.args.cp_size} new tokens"
            elif len(rids) > self.args.max_batch_requests:
                reason = f"{len(rids)} requests exceed the graphs' capacity of {self.args.max_batch_requests} " \
                         f"(--max-batch-requests)"
            else:
                real = max(counts)
                bucket, reason = select_bucket(self.graphs.buckets, real, -(-real // strategy.align) * strategy.align,
                                               self.graphs.failures)
        return _Plan(rids, ids, ext, prefix, strategy, cp_applied, counts, bucket, reason, indices, local_cap,
                     groups, all_rids, all_ext)

    def _local_cap(self, extend_lens: list[int]) -> int:
        """Rows of one rank's padded buffers for a DP group's requests (>= 1 so empty groups can join)."""
        if not extend_lens:
            return 1
        if self.args.cp_size > 1 and self.strategy.applies(extend_lens):
            return self.strategy.local_capacity(extend_lens)
        return sum(extend_lens)

    @torch.inference_mode()
    def prefill(self, requests: list[Request], count_host_ops: bool = False, force_eager: bool = False) -> PrefillOutput:
        plan = self.plan(requests, force_eager)
        others = self._mirror_other_groups(plan)
        added = self.pages.allocate(plan.rids, plan.extend_lens)
        try:
            with nvtx_range("prefill"):
                # A DP group without requests still joins the FFN collectives when there are any.
                run = plan.rids or self.communicator is not None
                logits, host_ops = self._run(plan, count_host_ops) if run else (None, 0)
            if logits is not None:
                logits = logits.to("cpu", torch.float32, copy=True)  # never alias the static output buffer
        except BaseException:
            self.pages.rollback(plan.rids, added)
            for pages, rids, _, new in others:
                pages.rollback(rids, new)
            raise
        self.pages.commit(plan.rids, plan.extend_lens)
        for pages, rids, new_lens, _ in others:
            pages.commit(rids, new_lens)
        if logits is None:              # not an output rank (or this DP group got no request)
            logits = torch.zeros(0, self.model_config.vocab_size)
        return PrefillOutput(
            logits=logits, next_token_ids=logits.argmax(-1).tolist(),
            mode="graph" if plan.bucket is not None else "eager", graph_bucket=plan.bucket,
            eager_reason=plan.eager_reason if plan.bucket is None else None, cp_applied=plan.cp_applied,
            per_rank_tokens=plan.per_rank_tokens, host_ops=host_ops if count_host_ops else None,
            request_indices=plan.indices, dp_group=self.me.dp_rank)

    def _mirror_other_groups(self, plan: _Plan) -> list[tuple[PageTable, list[str], list[int], list[list[int]]]]:
        """Allocate the other DP groups' requests in this rank's mirrors of their page tables:
        (table, rids, new lengths, pages added)."""
        out = []
        for g, pages in enumerate(self.dp_pages):
            if g != self.me.dp_rank:
                picked = [(r, n) for r, n, d in zip(plan.all_rids, plan.all_extend_lens, plan.dp_groups) if d == g]
                rids, lens = [r for r, _ in picked], [n for _, n in picked]
                out.append((pages, rids, lens, pages.allocate(rids, lens)))
        return out

    def _run(self, plan: _Plan, count_host_ops: bool) -> tuple[torch.Tensor, int]:
        rows = self.pages.rows(plan.rids)
        self.pool.begin_batch(rows, plan.prefix_lens)
        self._set_host(plan.strategy, plan.extend_lens, plan.prefix_lens)
        if plan.bucket is not None:
            return self.graphs.replay(plan.bucket, plan.extend_lens, plan.prefix_lens, rows, plan.ids,
                                      count_host_ops=count_host_ops)
        n = len(plan.rids)
        ext, prefix, ids = plan.extend_lens, plan.prefix_lens, plan.ids
        if n == 0:   # an empty DP group: one zero-length padding request
            ext, prefix, rows, ids = [0], [0], [[]], [torch.zeros(0, dtype=torch.long)]
        pages_cap = max(1, max(len(r) for r in rows))
        counter = OpCounter() if count_host_ops else _NullCounter()
        with counter:
            host = Descriptors.allocate(len(ext), pages_cap, max(1, sum(ext)))
            host.fill(ext, prefix, rows, ids)
            logits = self.forward(host, plan.strategy, plan.local_cap)    # metadata on the host, then one copy
        return (None if logits is None or n == 0 else logits[:n]), counter.count

    @torch.inference_mode()
    def kv_cache(self, rid: str) -> dict | None:
        """This rank's part of a request's KV: its pipeline stage's layers and its attention-TP heads
        (None when another DP group holds the request). The engine assembles the parts."""
        if not any(rid in pages.requests for pages in self.dp_pages):
            raise RequestError(f"request {rid!r} is unknown: it holds no cached KV")
        state = self.pages.requests.get(rid)
        if state is None:
            return None
        ps = self.args.page_size
        pos = torch.arange(state.cached_len)
        slots = (torch.tensor(state.pages, dtype=torch.long)[pos // ps] * ps + pos % ps).to(self.device)
        layers = []
        held = self.pool.held_layers(self.layers)       # LayerSplit: only this CP rank's layers
        for layer in held:
            k, v = self.pool.read(layer, slots)
            layers.append((k.transpose(0, 1).float().cpu(), v.transpose(0, 1).float().cpu()))
        return {"first_layer": held.start, "attn_tp_rank": self.me.attn_tp_rank, "cp_rank": self.me.cp_rank,
                "layers": layers, "layer_split": held != self.layers}

    def release(self, rid: str) -> None:
        owner = next((pages for pages in self.dp_pages if rid in pages.requests), None)
        if owner is None:
            raise RequestError(f"request {rid!r} is unknown: nothing to release")
        owner.release(rid)

    def stats(self) -> dict:
        return {"kv_tokens_total": sum(p.tokens_total for p in self.dp_pages),
                "kv_tokens_free": sum(p.tokens_free for p in self.dp_pages),
                "kv_bytes": self.pool.nbytes,
                "weight_bytes": sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "graph_buckets": self.graphs.buckets if self.graphs else [],
                "graph_captures": self.graphs.captures if self.graphs else 0,
                "world_size": self.args.world_size, "attention_backend": self.backend,
                "attention_kernel": self.kernel_name, "eager_reason": self.graph_reason,
                "capture_failures": self.graphs.failures if self.graphs else {},
                "capture_records": [vars(r) for r in self.graphs.records.values()] if self.graphs else []}


class _NullCounter:
    count = 0

    def __enter__(self) -> "_NullCounter":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _kv_tokens(args: EngineArgs, cfg, dtype: torch.dtype, device: torch.device, num_layers: int) -> int:
    """KV pool capacity per rank: --max-total-tokens (checked against free memory), else a share of it."""
    kv_heads = cfg.num_key_value_heads // args.attn_tp_size
    per_token = KVPool.bytes_per_token(num_layers, kv_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:   # ranks on one host share its memory
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // args.world_size
    if args.max_total_tokens is not None:
        need = args.max_total_tokens * per_token
        if need > 0.9 * free:
            raise ConfigError(f"--max-total-tokens {args.max_total_tokens}: the KV pool needs {need / 2**30:.2f} GiB "
                              f"per rank and {free / 2**30:.2f} GiB is free; lower it or leave it unset")
        return args.max_total_tokens
    budget = int(free * (0.6 if device.type == "cuda" else 0.2))
    tokens = min(budget // per_token, cfg.max_position_embeddings * args.max_batch_requests)
    if tokens < args.page_size:
        raise ConfigError("not enough memory for a KV pool; set --max-total-tokens or free memory")
    return tokens

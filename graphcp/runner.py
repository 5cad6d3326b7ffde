"""ModelRunner: one rank's model, KV cache and graphs; turns a validated batch into logits.

Data flows one way: batch -> descriptors -> CP metadata (tensor ops, graph-capturable) -> model -> attention
op (collectives, cache writes, kernel) -> last-token logits.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphcp.attention.op import PagedAttention, kernel_fn, resolve_kernel
from graphcp.attention.torch_ref import HostLengths
from graphcp.batch import PrefillOutput, Request, validate_requests
from graphcp.config import EngineArgs
from graphcp.cp.strategy import ContextParallelStrategy, InterleaveStrategy, make_strategy, unsharded
from graphcp.dist.comm import CPComm
from graphcp.errors import ConfigError
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


class ModelRunner:
    def __init__(self, args: EngineArgs, rank: int = 0, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, capture_progress: bool = False) -> None:
        self.args, self.rank = args, rank
        self.device = device or torch.device(args.resolved_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
        self.dtype = _resolve_dtype(args.dtype, self.device)
        self.model_config = cfg = read_model_config(args.model_path)
        self.backend = args.resolved_backend()
        self.kernel_name = resolve_kernel(args.attention_kernel, self.device)
        if self.kernel_name == "triton" and cfg.head_dim not in (64, 128):
            self.kernel_name = "torch"          # the Triton kernel covers head_dim 64 and 128 only
        self.kernel, self.kernel_capturable = kernel_fn(self.kernel_name, self.device)
        self.strategy = make_strategy(args.cp_strategy or "zigzag", args.cp_size)
        self.comm = CPComm(group, args.cp_size, rank) if args.cp_size > 1 else None

        self.model = load_model(args.model_path, self.dtype, self.device)
        tokens = _kv_tokens(args, cfg, self.dtype, self.device)
        num_pages = -(-tokens // args.page_size) + 1                   # + the reserved dummy page
        self.max_context = min(cfg.max_position_embeddings, tokens)
        self.pool = KVPool(cfg.num_hidden_layers, num_pages, args.page_size, cfg.num_key_value_heads, cfg.head_dim,
                           self.dtype, self.device)
        self.pages = PageTable(num_pages, args.page_size, self.max_context)
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
        self.capture_records = self.graphs.capture_all(buckets, progress=progress and self.rank == 0)

    def _all_ranks_agree(self, ok: bool) -> bool:
        if self.comm is None:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.long, device=self.device)
        dist.all_reduce(flag, group=self.comm.group)
        return int(flag.item()) == 0

    # -- the forward (eager, and the body every graph captures) ----------------------------------
    def forward(self, desc: Descriptors, strategy: ContextParallelStrategy, local_cap: int) -> torch.Tensor:
        """Logits [req_cap, vocab] at each request's last new token (valid on rank 0, and every rank
        for interleave). Tensor ops only, so the same body runs eagerly and inside a captured graph."""
        with nvtx_range("cp_metadata"):
            meta = strategy.metadata(desc.extend_lens, desc.prefix_lens, desc.page_table, self.rank % strategy.cp_size,
                                     local_cap, self.args.page_size)
        input_ids = desc.input_ids.index_select(0, meta.token_index)
        attention = PagedAttention(self.pool, meta, self.comm, self.kernel, self.kernel_capturable, self.host,
                                   split_early_late=self.backend == "flashattention" and strategy.name == "zigzag",
                                   scale=self.scale)
        with forward_context(attention):
            hidden = self.model(input_ids, meta.positions)
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
            self.host.max_q = max(-(-n // (2 * c)) for n in extend_lens)
            self.host.early_rows = sum(n // (2 * c) + (rank < n % (2 * c)) for n in extend_lens)
        else:
            self.host.max_q = max(-(-n // c) for n in extend_lens)
            self.host.early_rows = 0
        self.host.max_kv = max(p + n for p, n in zip(prefix_lens, extend_lens))

    # -- serving ---------------------------------------------------------------------------------
    def plan(self, requests: list[Request], force_eager: bool = False) -> _Plan:
        rids, ids = validate_requests(requests, self.model_config.vocab_size)
        ext = [t.numel() for t in ids]
        self.pages.check(rids, ext)
        prefix = [self.pages.prefix_len(r) for r in rids]
        strategy, cp_applied = self.strategy, self.args.cp_size > 1
        if cp_applied and not strategy.applies(ext):
            strategy, cp_applied = unsharded(), False
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
        return _Plan(rids, ids, ext, prefix, strategy, cp_applied, counts, bucket, reason)

    @torch.inference_mode()
    def prefill(self, requests: list[Request], count_host_ops: bool = False, force_eager: bool = False) -> PrefillOutput:
        plan = self.plan(requests, force_eager)
        added = self.pages.allocate(plan.rids, plan.extend_lens)
        try:
            with nvtx_range("prefill"):
                logits, host_ops = self._run(plan, count_host_ops)
            logits = logits.to("cpu", torch.float32, copy=True)  # never alias the static output buffer
        except BaseException:
            self.pages.rollback(plan.rids, added)
            raise
        self.pages.commit(plan.rids, plan.extend_lens)
        return PrefillOutput(
            logits=logits, next_token_ids=logits.argmax(-1).tolist(),
            mode="graph" if plan.bucket is not None else "eager", graph_bucket=plan.bucket,
            eager_reason=plan.eager_reason if plan.bucket is None else None, cp_applied=plan.cp_applied,
            per_rank_tokens=plan.per_rank_tokens, host_ops=host_ops if count_host_ops else None)

    def _run(self, plan: _Plan, count_host_ops: bool) -> tuple[torch.Tensor, int]:
        rows = self.pages.rows(plan.rids)
        self._set_host(plan.strategy, plan.extend_lens, plan.prefix_lens)
        if plan.bucket is not None:
            return self.graphs.replay(plan.bucket, plan.extend_lens, plan.prefix_lens, rows, plan.ids,
                                      count_host_ops=count_host_ops)
        n = len(plan.rids)
        pages_cap = max(1, max(len(r) for r in rows))
        strategy = plan.strategy
        local_cap = strategy.local_capacity(plan.extend_lens) if plan.cp_applied else sum(plan.extend_lens)
        counter = OpCounter() if count_host_ops else _NullCounter()
        with counter:
            host = Descriptors.allocate(n, pages_cap, sum(plan.extend_lens))
            host.fill(plan.extend_lens, plan.prefix_lens, rows, plan.ids)
            desc = host.to(self.device) if self.device.type != "cpu" else host
            logits = self.forward(desc, strategy, local_cap)
        return logits[:n], counter.count

    @torch.inference_mode()
    def kv_cache(self, rid: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from graphcp.errors import RequestError
        state = self.pages.requests.get(rid)
        if state is None:
            raise RequestError(f"request {rid!r} is unknown: it holds no cached KV")
        ps = self.args.page_size
        pos = torch.arange(state.cached_len)
        slots = (torch.tensor(state.pages, dtype=torch.long)[pos // ps] * ps + pos % ps).to(self.device)
        out = []
        for layer in range(self.model_config.num_hidden_layers):
            k, v = self.pool.read(layer, slots)
            out.append((k.transpose(0, 1).float().cpu(), v.transpose(0, 1).float().cpu()))
        return out

    def release(self, rid: str) -> None:
        self.pages.release(rid)

    def stats(self) -> dict:
        return {"kv_tokens_total": self.pages.tokens_total, "kv_tokens_free": self.pages.tokens_free,
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


def _kv_tokens(args: EngineArgs, cfg, dtype: torch.dtype, device: torch.device) -> int:
    """KV pool capacity per rank: --max-total-tokens, else a share of free memory."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.6)
    else:
        budget = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.2 / args.world_size)
    tokens = min(budget // per_token, cfg.max_position_embeddings * args.max_batch_requests)
    if tokens < args.page_size:
        raise ConfigError("not enough memory for a KV pool; set --max-total-tokens or free memory")
    return tokens

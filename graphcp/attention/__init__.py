"""Attention: the layer kinds (``kinds.py``: op, cache parts, export), their per-forward ops (``op.py``
dense GQA, ``dsa.py`` MLA with the DSA indexer, ``mla.py`` dense MLA), and ``build``: the kernels
every op uses, chosen once at start. Layers call
``current_attention()(layer_id, queries, *new cache rows, **extras)``; ``LayerOps`` hands each call
to the op of that layer's kind."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from graphcp.attention.context import AttentionContext, AttentionKernels
from graphcp.attention.kinds import LayerKind, cache_parts, layer_kinds, state_parts
from graphcp.config import EngineArgs
from graphcp.cp.metadata import CPMetadata, HostMaxima, LastTokens
from graphcp.distributed.comm import CPComm
from graphcp.kernels.registry import KERNELS, KernelChoices, KernelContext
from graphcp.kernels.resolve import resolve_dsa, resolve_kernel
from graphcp.kv.cache import LayerParts, PagedPool
from graphcp.models.config import ModelConfig

log = logging.getLogger("graphcp")


class LayerOps:
    """One forward's attention: each layer's call goes to the op of its kind, built on first use."""

    def __init__(self, kinds: dict[int, LayerKind], ctx: AttentionContext) -> None:
        self.kinds, self.ctx = kinds, ctx
        self._ops: dict[str, object] = {}

    def __call__(self, layer_id: int, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        kind = self.kinds[layer_id]
        op = self._ops.get(kind.name)
        if op is None:
            op = self._ops[kind.name] = kind.op(self.ctx)
        return op(layer_id, *args, **kwargs)


@dataclass(frozen=True)
class AttentionBackend:
    """A rank's attention, resolved once: its layers' kinds and the kernels their ops use."""
    cfg: ModelConfig
    kinds: dict[int, LayerKind]
    kernels: AttentionKernels
    attn_tp: int
    halo: bool = False      # sliding layers gather only their window's halo (none reads more)

    @property
    def kernel_name(self) -> str:
        return self.kernels.attention.name

    @property
    def windowed_kernel(self) -> dict:
        """The kernel of sliding-window and sink layers, and why it is not ``kernel_name``'s."""
        k = self.kernels
        return {"name": (k.windowed or k.attention).name, "reason": k.windowed_reason}

    @property
    def heads_split(self) -> bool:
        """Attention-TP ranks cache different heads (else every one holds the same rows)."""
        return all(k.heads_split for k in self.kinds.values())

    @property
    def graph_reason(self) -> str | None:
        """Why these layers cannot run in a graph (None: they can)."""
        return next((k.graph_reason for k in self.kinds.values() if k.graph_reason), None)

    def cache_parts(self) -> LayerParts:
        return cache_parts(self.cfg, range(min(self.kinds), max(self.kinds) + 1), self.attn_tp)

    def state_parts(self) -> LayerParts:
        """Per-request parts of the layers whose kind keeps state (none for attention only)."""
        return state_parts(self.cfg, range(min(self.kinds), max(self.kinds) + 1), self.attn_tp)

    def ops(self, pool: PagedPool, meta: CPMetadata, comm: CPComm | None, host: HostMaxima,
            last: LastTokens | None = None) -> LayerOps:
        ctx = AttentionContext(self.cfg, pool, meta, comm, host, self.kernels, last, self.halo)
        return LayerOps(self.kinds, ctx)

    def export(self, layer: int, rows: tuple[torch.Tensor, ...]) -> tuple:
        """One layer's cached rows (per part, [n, *row]; then its per-request parts) as
        ``engine.kv_cache`` returns them."""
        return self.kinds[layer].export(self.cfg, rows)


def build(cfg: ModelConfig, args: EngineArgs, device: torch.device, dtype: torch.dtype, layers: range,
          bottom_right: bool, choices: KernelChoices | None = None) -> AttentionBackend:
    """The attention of a rank holding ``layers``: ``bottom_right`` False where the layout gives per-token
    causal limits (interleave), which some kernels do not take. ``choices`` records a CUDA ``auto``
    choice that fell back to torch (the kernel-choice report)."""
    record = choices.record if choices is not None else None
    atp, kinds = args.attn_tp_size, layer_kinds(cfg, layers)
    needed = {op for kind in kinds.values() for op in kind.kernels}     # resolve (and probe) only those
    kernel = windowed = KERNELS["torch"]
    reason = None
    if "attention" in needed:
        heads = (cfg.num_attention_heads // atp, cfg.kv_heads_per_rank(atp))
        choose = functools.partial(resolve_kernel, device=device, dtype=dtype,
                                   head_dim=cfg.head_dim, bottom_right=bottom_right, heads=heads,
                                   page_size=args.page_size, record=record)
        kernel = KERNELS[choose(args.attention_kernel)]
        # Sliding-window and sink layers (which a model shows only when it calls): a kernel that
        # cannot serve them is refused for those layers, an explicit flashinfer included.
        wanted = "auto" if args.attention_kernel == "flashinfer" else args.attention_kernel
        windowed = KERNELS[choose(wanted, window_or_sinks=True)]
        if windowed is not kernel:
            reason = kernel.unsupported_reason(KernelContext(device, dtype, cfg.head_dim, heads,
                                                             args.page_size, bottom_right, True))
            log.info("graphcp: sliding-window and sink layers attend with the %s kernel (%s %s)",
                     windowed.name, kernel.name, reason or "failed its check with them")
    dsa = resolve_dsa(args.attention_kernel, device, record) if "dsa" in needed else None
    split = args.resolved_backend() == "flashattention"
    # A PD transfer, a layer split or KV sharding (the pages' owners) reads every cached row: their
    # sliding layers gather everything.
    halo = (args.disaggregation_mode == "null" and not args.enable_dsa_cache_layer_split
            and not args.enable_kv_cache_sharding)
    return AttentionBackend(cfg, kinds, AttentionKernels(kernel, split, dsa, windowed, reason), atp,
                            halo)


def probe_kernels(choices: KernelChoices, cfg: ModelConfig, layers: range, attn_tp: int,
                  device: torch.device, dtype: torch.dtype) -> None:
    """Check, once at start on CUDA, the Triton kernels of the layer kinds in ``layers`` that have
    a probe (each kind once): a kernel that fails or disagrees leaves its op on the torch form."""
    kinds = {kind.name: kind for kind in layer_kinds(cfg, layers).values()}
    for kind in kinds.values():
        if kind.probe is not None:
            kind.probe(choices, cfg, attn_tp, device, dtype)


__all__ = ["AttentionBackend", "LayerOps", "build", "probe_kernels"]

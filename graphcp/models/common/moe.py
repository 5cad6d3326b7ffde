"""The sparse MoE block: a router picks top-k experts per token, gated SiLU experts run on them.

The block knows nothing about ranks: the forward context's MoE communicator moves tokens to the
experts (an all-gather / reduce-scatter, or an all-to-all dispatch and combine) and calls back into
the router and the experts. Each rank holds ``num_experts / ep`` experts, each split over the
expert-TP ranks along the intermediate dimension. The router is a separate small module so a
DeepSeek-style router (grouped top-k, score-correction bias, routed scaling) can sit beside it.
"""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, shard_range
from graphcp.errors import ConfigError
from graphcp.forward_context import current_moe_communicator
from graphcp.kernels.fp8_torch import dequantize_expert, gemm_available
from graphcp.kernels.fp8_types import FP8, Fp8Experts
from graphcp.kernels.moe_torch import (
    NO_BIASES,
    SILU,
    Biases,
    GatedActivation,
    dense_experts_torch,
    experts_fp8_torch,
    experts_torch,
)
from graphcp.kernels.registry import KernelChoices, chosen
from graphcp.models.common.quantized import block_rows, scale_name, scale_shard
from graphcp.models.config import ModelConfig


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE's router: softmax over all experts in fp32, top-k, optionally renormalised."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size),
                                   requires_grad=False)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k] int64)."""
        probs = torch.softmax(nn.functional.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class Experts(nn.Module):
    """This rank's experts, stored fused as transformers 5 keeps them: gate_up_proj
    [E_local, 2 I_local, H] (gate rows first), down_proj [E_local, H, I_local]. Checkpoints name
    them per expert (``experts.{e}.gate_proj.weight``) or fused; each rank reads only its experts
    and its expert-TP slice of them. FP8 checkpoints' experts stay FP8 (``hold_fp8``), with their
    block scales beside them (``*_scale_inv`` buffers [E_local, row blocks, column blocks]).
    ``activation`` is the experts' gating (a family sets its clamp); the grouped GEMMs take it."""

    activation: GatedActivation = SILU
    triton_form = True          # the grouped GEMMs read these weights (not MXFP4's packed bytes)

    def __init__(self, cfg: ModelConfig, ep: EPInfo) -> None:
        super().__init__()
        per = cfg.num_experts // ep.ep_size
        self.first, self.num_local, self.num_experts = ep.ep_rank * per, per, cfg.num_experts
        self.inter = cfg.moe_intermediate_size
        self.slice = shard_range(cfg.moe_intermediate_size, ep.expert_tp_size, ep.expert_tp_rank)
        inter = self.slice[1] - self.slice[0]
        hidden = cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(per, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(per, hidden, inter), requires_grad=False)
        self.fp8: tuple[Fp8Experts, Fp8Experts] | None = None      # (gate_up, down) once attached
        self.block: tuple[int, int] | None = None

    def biases(self) -> Biases:
        """Per-expert (gate_up, down) biases the grouped GEMMs add; none here."""
        return NO_BIASES

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's experts of weight x expert(x) for each (row, expert) pair of
        ``ids``; pairs routed to other ranks' experts add nothing. x [N, H], ids/weights [N, k]."""
        if x.is_cuda and self.triton_form:     # one grouped-GEMM launch per projection
            op = "moe_experts" if self.fp8 is None else "moe_experts_fp8"
            fn = chosen(op)
            if fn is not None:
                weights_ = (self.gate_up_proj, self.down_proj) if self.fp8 is None else self.fp8
                return fn(x, ids, weights, *weights_, self.first, activation=self.activation,
                          biases=self.biases())
        return experts_torch(x, ids, weights, self.num_local, self.first,
                             lambda e: self.expert_weights(e, x.dtype), self.activation)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``e``'s (gate_up, down) in ``dtype``: FP8 ones dequantized for this call."""
        if self.fp8 is None:
            return self.gate_up_proj[e], self.down_proj[e]
        return tuple(dequantize_expert(w, e, dtype) for w in self.fp8)

    def probe(self, choices: KernelChoices, dtype: torch.dtype) -> None:
        """At engine start, eagerly: the Triton grouped GEMM once against the torch form on random
        routing (activations in ``dtype``); one that fails or disagrees is replaced by the torch
        form with a warning."""
        if not self.gate_up_proj.is_cuda or not self.triton_form:
            return
        gen = torch.Generator().manual_seed(0)
        n, k = 9, min(2, self.num_experts)
        x = torch.randn(n, self.gate_up_proj.shape[-1], generator=gen).to(self.gate_up_proj.device,
                                                                            dtype)
        ids = torch.randint(0, self.num_experts, (n, k), generator=gen).to(x.device)
        weights = torch.rand(n, k, generator=gen).to(x)
        if self.fp8 is None:
            op, parts, reference = "moe_experts", (self.gate_up_proj, self.down_proj), \
                dense_experts_torch
        elif gemm_available(x.device, self.block):
            # its oracle quantizes the activations as the kernel does
            op, parts, reference = "moe_experts_fp8", self.fp8, experts_fp8_torch
        else:       # no FP8 tensor cores: the dequantizing torch form serves, unchecked
            return
        # the family's gating and biases, so a clamp or bias the kernels got wrong is caught
        extra = dict(activation=self.activation, biases=self.biases())
        choices.probe(op, lambda fn: fn(x, ids, weights, *parts, self.first, **extra),
                      lambda: reference(x, ids, weights, *parts, self.first, **extra), dtype)

    # -- loading ------------------------------------------------------------------------------
    def checkpoint_tensors(self, prefix: str, names: set[str], hidden: int) -> dict[str, tuple]:
        """Checkpoint tensors (name -> full shape) the experts load from: per expert or fused."""
        if f"{prefix}.gate_up_proj" in names:
            return {f"{prefix}.gate_up_proj": (self.num_experts, 2 * self.inter, hidden),
                    f"{prefix}.down_proj": (self.num_experts, hidden, self.inter)}
        out = {}
        for e in range(self.num_experts):
            out[f"{prefix}.{e}.gate_proj.weight"] = (self.inter, hidden)
            out[f"{prefix}.{e}.up_proj.weight"] = (self.inter, hidden)
            out[f"{prefix}.{e}.down_proj.weight"] = (hidden, self.inter)
        return out

    def hold_fp8(self, prefix: str, quantized: set[str], block: tuple[int, int]) -> None:
        """On the meta model: FP8 projections and the scale blocks covering this rank's slice, where
        the checkpoint's experts are FP8 (every expert alike, gate and up alike)."""
        kinds = {p: {f"{prefix}.{e}.{p}.weight" in quantized for e in range(self.num_experts)}
                 for p in ("gate_proj", "up_proj", "down_proj")}
        if not any(True in v for v in kinds.values()):
            return
        if any(len(v) != 1 for v in kinds.values()) or kinds["gate_proj"] != kinds["up_proj"] \
                or kinds["gate_proj"] != kinds["down_proj"]:
            raise ConfigError(f"--model-path: fp8 modules_to_not_convert leaves only some of "
                              f"{prefix}'s expert projections unquantized; graphcp needs all or none")
        self.block, (lo, hi) = block, self.slice
        per, (two_inter, hidden) = self.num_local, self.gate_up_proj.shape[1:]
        gate_rows = grid(0, (lo, hi), block)
        down_cols = grid(1, (lo, hi), block)
        hidden_rows, hidden_cols = -(-hidden // block[0]), -(-hidden // block[1])
        for name, shape, scales in (
                ("gate_up_proj", (per, two_inter, hidden), (per, 2 * gate_rows, hidden_cols)),
                ("down_proj", (per, hidden, hi - lo), (per, hidden_rows, down_cols))):
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=FP8, device="meta"),
                                             requires_grad=False))
            self.register_buffer(f"{name}_scale_inv", torch.empty(scales, device="meta"))

    def attach_fp8(self) -> None:
        """After loading: the ``Fp8Experts`` views the kernels read."""
        if self.block is None:
            return
        (lo, hi), block, dev = self.slice, self.block, self.gate_up_proj.device
        rows = block_rows(lo, hi - lo, block[0])
        gate_up_rows = torch.cat([rows, rows + grid(0, (lo, hi), block)]).to(dev)
        down_rows = block_rows(0, self.down_proj.shape[1], block[0]).to(dev)
        self.fp8 = (Fp8Experts(self.gate_up_proj.data, self.gate_up_proj_scale_inv, gate_up_rows,
                               0, block),
                    Fp8Experts(self.down_proj.data, self.down_proj_scale_inv, down_rows,
                               lo % block[1], block))

    @torch.no_grad()
    def load(self, prefix: str, names: set[str], read, take) -> None:
        """Only this rank's slices leave the checkpoint: ``read(name, (dim, start, end))`` returns
        a shard of a per-expert tensor as stored, ``take(name, index)`` returns ``tensor[index]``
        of a fused one."""
        lo, hi = self.slice
        experts = slice(self.first, self.first + self.num_local)
        inter = hi - lo
        if f"{prefix}.gate_up_proj" in names:
            self.gate_up_proj[:, :inter] = take(f"{prefix}.gate_up_proj", (experts, slice(lo, hi)))
            up = slice(self.inter + lo, self.inter + hi)
            self.gate_up_proj[:, inter:] = take(f"{prefix}.gate_up_proj", (experts, up))
            self.down_proj.copy_(take(f"{prefix}.down_proj", (experts, slice(None), slice(lo, hi))))
            return
        for i in range(self.num_local):
            e = f"{prefix}.{self.first + i}"
            self.gate_up_proj[i, :inter] = read(f"{e}.gate_proj.weight", (0, lo, hi))
            self.gate_up_proj[i, inter:] = read(f"{e}.up_proj.weight", (0, lo, hi))
            self.down_proj[i] = read(f"{e}.down_proj.weight", (1, lo, hi))
            if self.block is None:
                continue
            rows, cols = scale_shard((0, lo, hi), self.block), scale_shard((1, lo, hi), self.block)
            gate_rows = rows[2] - rows[1]
            scales = self.gate_up_proj_scale_inv[i]
            scales[:gate_rows] = read(scale_name(f"{e}.gate_proj.weight"), rows)
            scales[gate_rows:] = read(scale_name(f"{e}.up_proj.weight"), rows)
            self.down_proj_scale_inv[i] = read(scale_name(f"{e}.down_proj.weight"), cols)


def grid(dim: int, span: tuple[int, int], block: tuple[int, int]) -> int:
    """Scale blocks along ``dim`` covering elements [start, end)."""
    return -(-span[1] // block[dim]) - span[0] // block[dim]


class MoEBlock(nn.Module):
    """Router + experts; the forward context's MoE communicator decides where tokens meet them."""

    def __init__(self, cfg: ModelConfig, ep: EPInfo) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(cfg)
        self.experts = Experts(cfg, ep)

    def fuse(self) -> None:
        """Experts are stored fused already (one tensor per projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_moe_communicator().run(x, self.gate, self.experts)


def probe_experts(choices: KernelChoices, model: nn.Module, dtype: torch.dtype) -> None:
    """Check the Triton grouped GEMM once on the model's first expert module (CUDA, engine start)."""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if experts is not None:
        experts.probe(choices, dtype)

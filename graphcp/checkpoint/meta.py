"""A rank's model on the meta device, exactly as the loader will allocate it: every tensor in its
final dtype (the model dtype; fp32 where a module keeps fp32; FP8 weights with fp32 block scales
where the checkpoint is FP8), projections that fuse laid out back to back. The loader materializes
this model; ``graphcp memory`` counts its bytes without a checkpoint. One build, so the plan and a
real load cannot disagree.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from graphcp.checkpoint.fp8 import quantized_expert_names, quantized_names
from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.kernels.fp8_types import FP8
from graphcp.models.common.decoder import DecoderLM
from graphcp.models.common.moe import Experts
from graphcp.models.common.quantized import hold_fp8
from graphcp.models.config import ModelConfig
from graphcp.models.registry import model_class


def checkpoint_tensors(cfg: ModelConfig, names: set[str] | None) -> tuple[dict[str, tuple], set[str]]:
    """(checkpoint tensor -> full shape, the FP8 ones among them) for the whole model. ``names``:
    the checkpoint's tensor names (experts load from per-expert or fused tensors, whichever it
    has); None: as the releases write them (per expert)."""
    with torch.device("meta"):
        full = model_class(cfg)(cfg)
    quantized = set(quantized_names(full, cfg))
    expected = {n: tuple(p.shape) for n, p in full.state_dict().items()}
    for prefix, experts in experts_modules(full):
        del expected[f"{prefix}.gate_up_proj"], expected[f"{prefix}.down_proj"]
        tensors = experts.checkpoint_tensors(prefix, names or set(), cfg.hidden_size)
        expected.update(tensors)
        quantized.update(quantized_expert_names(prefix, tensors, cfg))
    return expected, quantized


def rank_model(cfg: ModelConfig, dtype: torch.dtype, quantized: set[str], tp: TPInfo | None = None,
               layers: range | None = None, ffn_tp: TPInfo | None = None,
               ep: EPInfo | None = None) -> tuple[DecoderLM, dict[str, tuple]]:
    """This rank's model on the meta device in its final dtypes, and the TP shard of each tensor
    that loads a slice (FP8 scale buffers included)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg, tp, layers, ffn_tp, ep)
    _final_dtypes(model, dtype)
    scale_shards = hold_fp8(model, quantized, cfg.fp8_block) if quantized else {}
    _lay_out_fusions(model)
    # A row-split layer's bias is whole on every rank (added once after the sum); other biases
    # split with rows.
    shards = {f"{name}.{p}": mod.shard for name, mod in model.named_modules() if hasattr(mod, "shard")
              for p in ("weight", "bias")
              if getattr(mod, p, None) is not None and not (p == "bias" and mod.shard[0] == 1)}
    # Other tensors a module splits (per-head parameters, a conv over split channels), by name.
    others = {f"{name}.{t}": shard for name, mod in model.named_modules()
              for t, shard in getattr(mod, "tensor_shards", {}).items()}
    return model, {**shards, **others, **scale_shards}


def experts_modules(model: nn.Module) -> list[tuple[str, Experts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of the state dict by dtype name (what ``stats()["weight_bytes_per_rank"]`` sums)."""
    counts: Counter[str] = Counter()
    for t in model.state_dict().values():
        counts[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    return dict(counts)


def _final_dtypes(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point tensors take the model dtype, but those a module keeps in fp32 (``keep_fp32``
    on it or a module above it, or named in its ``fp32_tensors``), as HF keeps routers, indexer
    weights and the like. Integer tables stay as they are."""
    fp32_prefixes = [name for name, m in model.named_modules() if getattr(m, "keep_fp32", False)]
    done: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        whole = any(name == p or name.startswith(p + ".") for p in fp32_prefixes)
        singles = getattr(module, "fp32_tensors", ())
        for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if not t.is_floating_point() or t.dtype == FP8:
                continue
            want = torch.float32 if whole or attr in singles else dtype
            if t.dtype == want:
                continue
            if id(t) not in done:
                new = t.to(want)
                done[id(t)] = nn.Parameter(new, requires_grad=False) if isinstance(
                    t, nn.Parameter) else new
            setattr(module, attr, done[id(t)])


def _lay_out_fusions(model: nn.Module) -> None:
    """Projections a module fuses into one GEMM (``fused_projections``: groups of Linear names)
    are laid out back to back in one tensor per kind (weights, biases, FP8 scales), so fusing
    them after loading copies nothing."""
    for module in model.modules():
        for group in getattr(module, "fused_projections", ()):
            linears = [getattr(module, n) for n in group]
            for attr in ("weight", "bias", "weight_scale_inv"):
                parts = [getattr(m, attr, None) for m in linears]
                if any(p is None for p in parts):
                    continue
                if len({(p.dtype, p.shape[1:]) for p in parts}) != 1:
                    continue        # e.g. one part left unquantized: fused by a copy instead
                base = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                                   dtype=parts[0].dtype, device="meta")
                row = 0
                for m, p in zip(linears, parts):
                    view = base[row:row + p.shape[0]]
                    row += p.shape[0]
                    if isinstance(p, nn.Parameter):
                        setattr(m, attr, nn.Parameter(view, requires_grad=False))
                    else:
                        m.register_buffer(attr, view)

"""The kernel choices, each with the inputs of its start-up check: one small call shaped like the
model's, run through ``registry.check`` against the torch form. Kernels that compile on first use
(Triton, flashinfer's JIT or downloaded cubins) can fail on a machine they were never tried on;
checking at start turns that into a fallback (``auto``) or a ConfigError (an explicit choice) instead
of a failed first batch or capture."""
from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Callable

import torch

from graphcp.errors import ConfigError
from graphcp.kernels import delta_rule_torch, dsa_torch
from graphcp.kernels.registry import KERNELS, KernelChoices, KernelContext, KernelSpec, check, triton_unusable
from graphcp.kernels.torch_layers import rms_norm_torch, rope_torch
from graphcp.kernels.torch_ref import torch_paged_attention

log = logging.getLogger("graphcp")


def _rand(gen: torch.Generator, device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device, dtype)


def check_attention(kernel, ctx: KernelContext) -> str | None:
    """Two sequences, one extending a cached prefix, padding rows after them; with
    ``ctx.window_or_sinks``, a window of 9 keys and per-head sinks as well."""
    gen, (num_heads, num_kv_heads), d, ps = torch.Generator().manual_seed(0), ctx.heads, ctx.head_dim, ctx.page_size
    q_lens, kv_lens = [19, 7], [19, 7 + 2 * ps + 3]
    pages = max(-(-kv // ps) for kv in kv_lens)
    page_rows = torch.arange(1, 1 + 2 * pages).view(2, pages)
    shape = ((1 + 2 * pages) * ps, num_kv_heads, d)
    k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(sum(q_lens) + 5, num_heads, d, generator=gen)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)])
    limits = torch.tensor([kv - n + i + 1 for n, kv in zip(q_lens, kv_lens) for i in range(n)] + [0] * 5)
    scale, dev, dtype = d ** -0.5, ctx.device, ctx.dtype
    window, sinks = (9, torch.randn(num_heads, generator=gen)) if ctx.window_or_sinks else (0, None)

    def run() -> torch.Tensor:
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=dev)
        kernel(q.to(dev, dtype), k_pool.to(dev, dtype), v_pool.to(dev, dtype), cu.to(dev), page_rows.to(dev),
               limits.to(dev), ps, scale, max(q_lens), max(kv_lens), out, window=window,
               sinks=None if sinks is None else sinks.to(dev))
        return out

    return check(run, lambda: torch_paged_attention(q, k_pool, v_pool, cu, page_rows, limits, ps, scale,
                                                   max(q_lens), max(kv_lens), torch.empty_like(q),
                                                   window=window, sinks=sinks), dtype,
                 "the torch kernel")


def probe_layer_ops(choices: KernelChoices, device: torch.device, dtype: torch.dtype) -> None:
    """The Triton RMSNorm (residual form), RoPE (strided q/k heads, as the fused qkv output gives) and KV
    write (scattered slots), each once against its torch form; eagerly, at start, on CUDA."""
    gen = torch.Generator().manual_seed(0)
    x, res, w = (_rand(gen, device, dtype, *s) for s in ((7, 96), (7, 96), (96,)))
    choices.probe("rms_norm", lambda fn: fn(x, w, 1e-6, res),
                  lambda: (rms_norm_torch(res + x, w, 1e-6), res + x), dtype)
    qkv, cos, sin = (_rand(gen, device, dtype, *s) for s in ((7, 6, 64), (7, 64), (7, 64)))
    q = qkv[:, :4]
    choices.probe("rope", lambda fn: fn(q, cos, sin), lambda: rope_torch(q, cos[:, None], sin[:, None]), dtype)
    rows = [_rand(gen, device, dtype, 5, 2, 64) for _ in range(2)]
    slots = torch.tensor([9, 0, 31, 4, 17], device=device)

    def write(fn) -> tuple[torch.Tensor, torch.Tensor]:
        pools = [torch.zeros(32, 2, 64, dtype=dtype, device=device) for _ in range(2)]
        if fn is None:
            for pool, r in zip(pools, rows):
                pool.index_copy_(0, slots, r)
        else:
            fn(*pools, slots, *rows)
        return tuple(pools)

    choices.probe("kv_write", write, lambda: write(None), dtype)


def probe_delta_rule(choices: KernelChoices, device: torch.device, dtype: torch.dtype,
                     head_k_dim: int, head_v_dim: int) -> None:
    """The Triton delta rule (the one-rank call and the CP hand-off's identity-augmented one) and
    its state correction, each once against the torch form at the model's head dims: three
    sequences of 70, 0 and 9 steps from random states, padding rows after; eagerly, at start, on
    CUDA, for models with Gated DeltaNet layers. Their dots run in TF32, so they serve 16-bit
    models; an fp32 model (a reference run) keeps the exact torch forms."""
    if dtype == torch.float32 and device.type == "cuda":
        return
    gen, heads, sizes = torch.Generator().manual_seed(0), 2, [70, 0, 9]
    rows = sum(sizes) + 5
    q, k = (delta_rule_torch.l2norm(_rand(gen, device, torch.float32, rows, heads, head_k_dim))
            for _ in range(2))
    v = _rand(gen, device, dtype, rows, heads, head_v_dim)
    g = -0.3 * torch.rand(rows, heads, generator=gen).to(device)
    beta = torch.rand(rows, heads, generator=gen).to(device, dtype)
    state = _rand(gen, device, torch.float32, 3, heads, head_k_dim, head_v_dim)
    layout = delta_rule_torch.ChunkLayout(torch.tensor(sizes, device=device), rows, 4)

    def rule(fn) -> tuple[torch.Tensor, ...]:
        return (*fn(q, k, v, g, beta, state, layout),
                *delta_rule_torch.block_transition(q, k, v, g, beta, layout, fn))

    choices.probe("delta_rule", rule, lambda: rule(delta_rule_torch.gated_delta_rule), dtype,
                  head_k_dim)
    q_eff = _rand(gen, device, torch.float32, rows, heads, head_k_dim)
    choices.probe("delta_state_outputs", lambda fn: fn(q_eff, state, layout),
                  lambda: delta_rule_torch.state_outputs(q_eff, state, layout), dtype, head_k_dim)


def _dsa_errors(kernels: ModuleType, device: torch.device, dtype: torch.dtype) -> str | None:
    """Both DSA kernels once on small random inputs against the torch forms (the -inf pattern past the
    causal limits included)."""
    gen = torch.Generator().manual_seed(0)
    q, weights, keys, kv = (_rand(gen, device, dtype, *s) for s in ((3, 16, 64), (3, 16), (40, 64), (40, 96)))
    weights = weights.float()
    slots = torch.randperm(40, generator=gen)[:32].view(2, 16).to(device)       # two sequences
    row_seq, limits = torch.tensor([0, 1, 1], device=device), torch.tensor([16, 5, 0], device=device)
    scores = dsa_torch.indexer_scores(q, weights, keys, slots, row_seq, limits)
    why = check(lambda: kernels.indexer_scores(q, weights, keys, slots, row_seq, limits), lambda: scores, dtype)
    if why is not None:
        return f"indexer scoring {why}"
    selected, visible = dsa_torch.select_topk(scores, slots, row_seq, limits, 8)
    q_mla = _rand(gen, device, dtype, 3, 8, 96)
    why = check(lambda: kernels.sparse_mla(q_mla, kv, selected, visible, 0.1, 64),
                lambda: dsa_torch.sparse_mla(q_mla, kv, selected, visible, 0.1, 64), dtype)
    return None if why is None else f"sparse attention {why}"


def resolve_dsa(requested: str, device: torch.device,
                record: Callable[[str, str], None] | None = None) -> ModuleType:
    """``indexer_scores`` and ``sparse_mla``: Triton on CUDA (auto) or when asked (the interpreter on
    CPU); the torch forms otherwise. On CUDA the Triton pair is checked once in fp32 and bf16; one that
    fails or disagrees is replaced by the torch pair with a warning, and ``record("dsa", why)``."""
    kernels, why = _dsa_choice(requested, device)
    if why is not None and record is not None:
        record("dsa", why)
    return kernels


@functools.cache
def _dsa_choice(requested: str, device: torch.device) -> tuple[ModuleType, str | None]:
    wants = requested == "triton" or (requested == "auto" and device.type == "cuda")
    unusable = triton_unusable(device) if wants else None
    if not wants or unusable is not None:
        return dsa_torch, unusable if device.type == "cuda" else None
    from graphcp.kernels import triton_dsa
    if device.type != "cuda":
        return triton_dsa, None
    for dtype in (torch.float32, torch.bfloat16):
        try:
            why = _dsa_errors(triton_dsa, device, dtype)
        except Exception as e:      # the check's own inputs could not be made on the device
            why = f"could not be checked ({type(e).__name__}: {str(e)[:200]})"
        if why is not None:
            log.warning("graphcp: the Triton DSA kernels (%s): %s; using the torch kernels", dtype, why)
            return dsa_torch, f"{dtype}: {why}"
    return triton_dsa, None


def resolve_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   bottom_right: bool = True, heads: tuple[int, int] | None = None,
                   page_size: int = 16, window_or_sinks: bool = False,
                   record: Callable[[str, str], None] | None = None) -> str:
    """The kernel behind the attention backend. An explicit choice that cannot serve is a ConfigError
    naming the flag; ``auto`` takes flashinfer where it is installed, fits and passes its check, then
    Triton on CUDA, then torch. ``bottom_right`` is False for interleave, whose per-token causal limits
    flashinfer does not take. With ``heads`` (query, KV heads on this rank), a flashinfer or CUDA Triton
    choice is first checked with one small call against the torch kernel. ``window_or_sinks``: the
    kernel of layers with a sliding window or attention sinks (checked with both). ``record(op, why)``
    hears an ``auto`` choice on CUDA that fell back to torch (a row in the kernel-choice report)."""
    import importlib
    ctx = KernelContext(device, dtype, head_dim, heads, page_size, bottom_right, window_or_sinks)
    fi = importlib.import_module(KERNELS["flashinfer-paged"].module)

    def reason(spec: KernelSpec) -> str | None:
        why = spec.unsupported_reason(ctx)
        if why is None and ctx.heads is not None and spec.name != "torch" and ctx.device.type == "cuda":
            why = check_attention(spec.fn, ctx)
        return why

    def flashinfer_spec() -> KernelSpec:
        if not fi.flashinfer_installed() or ctx.device.type != "cuda":
            return KERNELS["flashinfer-paged"]
        return KERNELS["flashinfer-" + fi.variant_for_capability(torch.cuda.get_device_capability(ctx.device))]

    if requested == "flashinfer":
        spec = flashinfer_spec()
        why = reason(spec)
        if why is not None:
            raise ConfigError(f"--attention-kernel flashinfer {why}; or choose --attention-kernel triton or torch")
        return spec.name
    if requested == "triton":
        why = reason(KERNELS["triton"])
        if why is not None:
            raise ConfigError(f"--attention-kernel triton {why}; choose --attention-kernel torch")
        return "triton"
    if requested == "torch" or ctx.device.type != "cuda":
        return "torch"
    if fi.flashinfer_installed():
        spec = flashinfer_spec()
        why = reason(spec)
        if why is None:
            return spec.name
        log.info("graphcp: attention kernel auto: not flashinfer, which %s", why)
    why = reason(KERNELS["triton"])
    if why is None:
        return "triton"
    log.warning("graphcp: attention kernel auto: the Triton kernel %s; using the torch kernel", why)
    if record is not None:
        record("attention_windowed" if window_or_sinks else "attention", why)
    return "torch"


__all__ = ["check_attention", "probe_delta_rule", "probe_layer_ops", "resolve_kernel", "resolve_dsa"]

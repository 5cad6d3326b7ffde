"""graphcp's one-launch Triton forms of the model's layer ops (RMSNorm with the residual add, RoPE), and
their start-up check: ``probe_layer_kernels`` (in ``layers``) runs each once against its torch form, eagerly, before any
graph is captured; an op that fails or disagrees is replaced by the torch form. Models only ask
``checked_kernel(name)``, so they hold no capture logic."""
from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any, Callable

import torch

log = logging.getLogger("graphcp")
_TRITON_FORMS = {"rms_norm": ("graphcp.kernels.triton_rmsnorm", "triton_rms_norm"),
                 "rope": ("graphcp.kernels.triton_rope", "triton_rope"),
                 "fp8_gemm": ("graphcp.kernels.triton_fp8_gemm", "triton_fp8_linear"),
                 "moe_experts": ("graphcp.kernels.triton_moe", "triton_experts")}
_CUDA_KERNELS: dict[str, Callable | None] = {}


def cuda_kernel(name: str) -> Callable | None:
    """graphcp's one-launch Triton form of a layer op (``rms_norm``, ``rope``) for CUDA tensors, or None
    where triton is not importable (the torch form then runs). Looked up once per process."""
    if name not in _CUDA_KERNELS:
        fn = None
        if importlib.util.find_spec("triton") is not None:
            module, attr = _TRITON_FORMS[name]
            try:
                fn = getattr(importlib.import_module(module), attr)
            except ImportError:
                fn = None
        _CUDA_KERNELS[name] = fn
    return _CUDA_KERNELS[name]


_CHECKED: set[str] = set()


def fused_or_torch(name: str, fused_call: Callable[[Callable], Any], torch_call: Callable[[], Any]) -> Any:
    """Run the Triton form of ``name``. Its first call in a process (an eager warmup, before any capture) is
    checked against the torch form; if it raises or disagrees, the op uses the torch form from then on and
    one warning says why, so a kernel that cannot compile or run here never stops the engine."""
    fn = cuda_kernel(name)
    if fn is None:
        return torch_call()
    if name in _CHECKED:
        return fused_call(fn)
    try:
        got, ref = fused_call(fn), torch_call()
        pairs = list(zip(got, ref)) if isinstance(got, tuple) else [(got, ref)]
        if any(b.numel() == 0 for _, b in pairs):
            return got                          # nothing to compare yet: check on a later call
        err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                  for a, b in pairs)
        dtype = (ref[0] if isinstance(ref, tuple) else ref).dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        reason = None if err <= tol else f"disagrees with the torch form (max rel err {err:.2e})"
    except Exception as e:  # noqa: BLE001 - any failure means the torch form serves instead
        reason, ref = f"failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})", None
    if reason is None:
        _CHECKED.add(name)
        return got
    _CUDA_KERNELS[name] = None
    log.warning("graphcp: the Triton %s %s; using the torch form", name, reason)
    return torch_call() if ref is None else ref


def checked_kernel(name: str) -> Callable | None:
    """The Triton form of ``name`` once the start-up probe accepted it; None: use the torch form."""
    return _CUDA_KERNELS.get(name) if name in _CHECKED else None


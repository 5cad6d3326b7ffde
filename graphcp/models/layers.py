"""Small layers shared by the llama family: RMSNorm and the rotary embedding."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from typing import Any, Callable

import torch
from torch import nn

from graphcp.models.config import ModelConfig

log = logging.getLogger("graphcp")
_TRITON_FORMS = {"rms_norm": ("graphcp.models.triton_rmsnorm", "triton_rms_norm"),
                 "rope": ("graphcp.models.triton_rope", "triton_rope"),
                 "moe_experts": ("graphcp.models.triton_moe", "triton_experts")}
_CUDA_KERNELS: dict[str, Callable | None] = {}


def cuda_kernel(name: str) -> Callable | None:
    """graphcp's Triton form of a layer op (``rms_norm``, ``rope``, ``moe_experts``) for CUDA
    tensors, or None where triton is not importable (the torch form then runs). Looked up once per
    process."""
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
    if name in _CHECKED or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # noqa: ANN201
        """norm(x); with ``residual``: (norm(x + residual), x + residual), the add fused on CUDA."""
        if x.is_cuda and x.stride(-1) == 1 and x.dim() in (2, 3) and x.dtype == self.weight.dtype and (
                residual is None or (x.dim() == 2 and residual.stride(-1) == 1 and residual.dtype == x.dtype)):
            return fused_or_torch("rms_norm", lambda fn: fn(x, self.weight, self.eps, residual),
                                  lambda: self._torch_form(x, residual))
        return self._torch_form(x, residual)

    def _torch_form(self, x: torch.Tensor, residual: torch.Tensor | None):  # noqa: ANN202
        if residual is None:
            return rms_norm_torch(x, self.weight, self.eps)
        total = residual + x
        return rms_norm_torch(total, self.weight, self.eps), total


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, then back to the input dtype before the weight, as the HF reference does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling.get("factor", 1.0))
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by factor, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position: a gather, so positions can live in a static graph buffer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self._last: tuple | None = None      # (positions, cos, sin) of the current forward

    def build(self, device: torch.device) -> None:
        # Built on the CPU after loading (the module itself may be constructed on the meta device).
        with torch.device("cpu"):
            pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
            freqs = pos[:, None] * rope_inv_freq(self.config)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a forward passes the same positions tensor: gather cos/sin once, reuse it.
        cached = self._last
        if cached is None or cached[0] is not positions or cached[1].dtype != q.dtype:
            cos = self.cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
            sin = self.sin.index_select(0, positions).unsqueeze(1).to(q.dtype)
            cached = self._last = (positions, cos, sin)
        _, cos, sin = cached
        if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
            cos2, sin2 = cos.squeeze(1), sin.squeeze(1)
            return fused_or_torch("rope", lambda fn: (fn(q, cos2, sin2), fn(k, cos2, sin2)),
                                  lambda: (rope_torch(q, cos, sin), rope_torch(k, cos, sin)))
        return rope_torch(q, cos, sin), rope_torch(k, cos, sin)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D]: the HF form, rounding in x's dtype after each op."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

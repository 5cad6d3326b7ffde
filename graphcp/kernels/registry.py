"""The attention kernels in one place: what each can serve, whether it is capturable, how it is probed,
and the one call that spells the shared kernel signature.

Kernels are imported lazily, so the engine runs where Triton or flashinfer is absent. ``resolve_kernel``
is the one choice: an explicit request that cannot be served is a ConfigError naming the flag; ``auto``
takes flashinfer where it is installed, fits and passes its probe, then Triton on CUDA, then torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import register_dataclass

from graphcp.errors import ConfigError

log = logging.getLogger("graphcp")
Kernel = Callable[..., torch.Tensor]
TRITON_HEAD_DIMS = (64, 128)


@dataclass
class KernelArgs:
    """The device-side arguments of one attention call (host maxima come from the live batch)."""
    q: torch.Tensor              # [T, Hq, D] this rank's queries
    k_pool: torch.Tensor         # [slots, Hkv, D] one layer of the paged cache
    v_pool: torch.Tensor
    cu_seqlens_q: torch.Tensor   # [S + 1] sequences over the query rows
    page_rows: torch.Tensor      # [S, P] page-table row of each sequence
    q_limits: torch.Tensor       # [T] keys each query may see
    out: torch.Tensor            # [T, Hq, D] written in place
    page_size: int
    scale: float


# A pytree node: a graph break taking KernelArgs gets its tensors resolved at replay like any argument.
register_dataclass(KernelArgs)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    module: str                  # where the function lives (imported on first use)
    function: str
    capturable_on_cuda: bool     # every length read from device memory: a CUDA graph can hold it

    @property
    def fn(self) -> Kernel:
        return getattr(importlib.import_module(self.module), self.function)

    def capturable(self, device: torch.device | str | None) -> bool:
        """On CPU every kernel is a break: Triton's interpreter runs numpy, not aten ops."""
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return self.capturable_on_cuda and on_cuda

    def run(self, args: KernelArgs, max_q: int, max_kv: int, workspace: dict | None) -> torch.Tensor:
        return self.fn(args.q, args.k_pool, args.v_pool, args.cu_seqlens_q, args.page_rows, args.q_limits,
                       args.page_size, args.scale, max_q, max_kv, args.out, workspace=workspace)

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, head_dim: int,
                           bottom_right: bool) -> str | None:
        """Why this kernel cannot serve the configuration (naming what to change), or None."""
        if self.name == "triton":
            if not triton_available(device):
                return ("needs the triton package (and on CPU, TRITON_INTERPRET=1 is set by graphcp); "
                        "install graphcp[test]")
            if head_dim not in TRITON_HEAD_DIMS:
                return f"supports head_dim {TRITON_HEAD_DIMS}, the model has {head_dim}"
        if self.name.startswith("flashinfer"):
            return importlib.import_module(_FI).unsupported_reason(device, dtype, head_dim, bottom_right)
        return None

    def probe(self, device: torch.device, dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
              page_size: int) -> str | None:
        """One small call checked against the torch kernel, where the kernel compiles or downloads code on
        first use (CUDA); None when it agrees."""
        if self.name == "torch" or device.type != "cuda":
            return None
        if self.name.startswith("flashinfer"):
            return importlib.import_module(_FI).probe(self.name.split("-", 1)[1], device, dtype, *heads,
                                                      head_dim, page_size)
        from graphcp.kernels.probe import probe_kernel
        return probe_kernel(self.fn, device, dtype, *heads, head_dim, page_size)


_FI = "graphcp.kernels.flashinfer_attention"
KERNELS = {
    "torch": KernelSpec("torch", "graphcp.kernels.torch_sdpa", "torch_sdpa_attention", False),
    "triton": KernelSpec("triton", "graphcp.kernels.triton_attention", "triton_paged_attention",
                         True),
    "flashinfer-trtllm": KernelSpec("flashinfer-trtllm", _FI, "flashinfer_trtllm_attention", True),
    # The paged wrapper plans on the host: always a break.
    "flashinfer-paged": KernelSpec("flashinfer-paged", _FI, "flashinfer_paged_attention", False),
}


def kernel_fn(name: str, device: torch.device | str | None = None) -> tuple[Kernel, bool]:
    """(kernel function, capturable on ``device``)."""
    spec = KERNELS[name]
    return spec.fn, spec.capturable(device)


def kv_write_kernel(device: torch.device) -> Kernel | None:
    """The Triton scatter of K/V rows into the pool on CUDA where triton is importable; None: index_copy_."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    try:
        from graphcp.kernels.triton_kv_write import triton_kv_write
    except ImportError:
        return None
    return triton_kv_write


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA GPUs, and on CPU in its interpreter, which must be chosen before triton is
    imported: graphcp asks for it (TRITON_INTERPRET=1) when it first resolves a kernel on CPU."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return os.environ["TRITON_INTERPRET"] == "1"
    return device.type == "cuda"


def resolve_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   bottom_right: bool = True, heads: tuple[int, int] | None = None,
                   page_size: int = 16) -> str:
    """The kernel behind the backend. The Triton kernel covers head_dim 64 and 128; other sizes go
    through the torch kernel. ``bottom_right`` is False for interleave, whose per-token causal limits
    flashinfer does not take. With ``heads`` (query, kv heads on this rank), a flashinfer or CUDA Triton
    choice is first probed with one small call checked against the torch kernel."""
    fi = importlib.import_module(_FI)

    def reason(spec: KernelSpec) -> str | None:
        why = spec.unsupported_reason(device, dtype, head_dim, bottom_right)
        if why is None and heads is not None:
            why = spec.probe(device, dtype, heads, head_dim, page_size)
        return why

    if requested == "flashinfer":
        if not fi.flashinfer_installed() or device.type != "cuda":
            spec = KERNELS["flashinfer-paged"]
        else:
            spec = KERNELS["flashinfer-" + _flashinfer_variant(device)]
        why = reason(spec)
        if why is not None:
            raise ConfigError(f"--attention-kernel flashinfer {why}; "
                              f"or choose --attention-kernel triton or torch")
        return spec.name
    if requested == "triton":
        if not triton_available(device):
            raise ConfigError("--attention-kernel triton needs the triton package (and on CPU, "
                              "TRITON_INTERPRET=1 is set by graphcp); install graphcp[test] or choose "
                              "--attention-kernel torch")
        if head_dim not in TRITON_HEAD_DIMS:
            return "torch"
        why = reason(KERNELS["triton"])
        if why is not None:
            raise ConfigError(f"--attention-kernel triton {why}; choose --attention-kernel torch")
        return "triton"
    if requested == "torch" or device.type != "cuda":
        return "torch"
    if fi.flashinfer_installed():
        spec = KERNELS["flashinfer-" + _flashinfer_variant(device)]
        why = reason(spec)
        if why is None:
            return spec.name
        log.info("graphcp: attention kernel auto: not flashinfer, which %s", why)
    triton = KERNELS["triton"]
    if triton.unsupported_reason(device, dtype, head_dim, bottom_right) is None:
        why = reason(triton)
        if why is None:
            return "triton"
        log.warning("graphcp: attention kernel auto: the Triton kernel %s; using the torch kernel", why)
    return "torch"


def _flashinfer_variant(device: torch.device) -> str:
    fi = importlib.import_module(_FI)
    return fi.variant_for_capability(torch.cuda.get_device_capability(device))

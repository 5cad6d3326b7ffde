"""The attention op the model calls through the forward context.

Per layer: all-gather this rank's K/V across the CP group (one collective for both), write every gathered
row to its paged-cache slot (padding rows go to the dummy slot), then run the kernel on the local queries.
Backend paths: ``trtllm_mha`` makes one combined varlen call over the zigzag page table (2R rows);
``flashattention`` makes two calls (early blocks, then late blocks); ``torch`` is the plain reference call.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from graphcp.attention.torch_ref import HostLengths, torch_paged_attention
from graphcp.cp.metadata import CPMetadata
from graphcp.dist.comm import CPComm
from graphcp.errors import ConfigError
from graphcp.graph.capture import graph_break
from graphcp.kv.cache import KVPool
from graphcp.profiling import nvtx_range

log = logging.getLogger("graphcp")
Kernel = Callable[..., torch.Tensor]
TRITON_HEAD_DIMS = (64, 128)


def resolve_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   bottom_right: bool = True, heads: tuple[int, int] | None = None, page_size: int = 16) -> str:
    """The kernel behind the backend. ``auto``: flashinfer where it is installed and can serve the
    configuration (trtllm-gen on compute capability 10.x, the paged prefill wrapper on other GPUs), else
    Triton on CUDA, else torch. An explicit request that cannot be served is a ConfigError naming the flag.
    The Triton kernel covers head_dim 64 and 128; other sizes go through the torch kernel.
    ``bottom_right`` is False for interleave, whose per-token causal limits flashinfer does not take.
    With ``heads`` (query, kv heads on this rank), a flashinfer or CUDA Triton choice is first probed with one
    small call checked against the torch kernel: ``auto`` moves on when the probe fails, an explicit choice
    is a ConfigError carrying the reason."""
    from graphcp.attention.kernels import flashinfer_attention as fi
    from graphcp.attention.kernels import triton_available

    def flashinfer_reason() -> str | None:
        reason = fi.unsupported_reason(device, dtype, head_dim, bottom_right)
        if reason is None and heads is not None:
            reason = fi.probe(_flashinfer_variant(device), device, dtype, *heads, head_dim, page_size)
        return reason

    if requested == "flashinfer":
        reason = flashinfer_reason()
        if reason is not None:
            raise ConfigError(f"--attention-kernel flashinfer {reason}; or choose --attention-kernel triton or torch")
        return "flashinfer-" + _flashinfer_variant(device)
    if requested == "triton":
        if not triton_available(device):
            raise ConfigError("--attention-kernel triton needs the triton package (and on CPU, TRITON_INTERPRET=1 "
                              "is set by graphcp); install graphcp[test] or choose --attention-kernel torch")
        if head_dim not in TRITON_HEAD_DIMS:
            return "torch"
        reason = _triton_reason(device, dtype, head_dim, heads, page_size)
        if reason is not None:
            raise ConfigError(f"--attention-kernel triton {reason}; choose --attention-kernel torch")
        return "triton"
    if requested == "torch" or device.type != "cuda":
        return "torch"
    if fi.flashinfer_installed():
        reason = flashinfer_reason()
        if reason is None:
            return "flashinfer-" + _flashinfer_variant(device)
        log.info("graphcp: attention kernel auto: not flashinfer, which %s", reason)
    if triton_available(device) and head_dim in TRITON_HEAD_DIMS:
        reason = _triton_reason(device, dtype, head_dim, heads, page_size)
        if reason is None:
            return "triton"
        log.warning("graphcp: attention kernel auto: the Triton kernel %s; using the torch kernel", reason)
    return "torch"


def _triton_reason(device: torch.device, dtype: torch.dtype, head_dim: int, heads: tuple[int, int] | None,
                   page_size: int) -> str | None:
    """The Triton kernel is probed on CUDA (where it compiles on first use); the interpreter needs no probe."""
    if device.type != "cuda" or heads is None:
        return None
    from graphcp.attention.kernels.triton_attention import triton_paged_attention
    from graphcp.attention.probe import probe_kernel
    return probe_kernel(triton_paged_attention, device, dtype, *heads, head_dim, page_size)


def _flashinfer_variant(device: torch.device) -> str:
    from graphcp.attention.kernels.flashinfer_attention import variant_for_capability
    return variant_for_capability(torch.cuda.get_device_capability(device))


def kernel_fn(name: str, device: torch.device | None = None) -> tuple[Kernel, bool]:
    """(kernel, capturable): capturable kernels read every length from device buffers. Triton and trtllm-gen
    are capturable on CUDA; on CPU Triton runs in its interpreter (numpy, not aten ops), so it stays a break.
    flashinfer's paged wrapper plans on the host and is always a break."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "triton":
        from graphcp.attention.kernels.triton_attention import triton_paged_attention
        return triton_paged_attention, on_cuda
    if name == "flashinfer-trtllm":
        from graphcp.attention.kernels.flashinfer_attention import flashinfer_trtllm_attention
        return flashinfer_trtllm_attention, on_cuda
    if name == "flashinfer-paged":
        from graphcp.attention.kernels.flashinfer_attention import flashinfer_paged_attention
        return flashinfer_paged_attention, False
    return torch_paged_attention, False


def _attend(kernel: Kernel, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_seqlens_q: torch.Tensor,
            page_rows: torch.Tensor, q_limits: torch.Tensor, page_size: int, scale: float, max_q: int, max_kv: int,
            out: torch.Tensor, workspace: dict | None = None) -> torch.Tensor:
    with nvtx_range("attention"):
        return kernel(q, k_pool, v_pool, cu_seqlens_q, page_rows, q_limits, page_size, scale, max_q, max_kv, out,
                      workspace=workspace)


def _split_views(host: HostLengths, cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor,
                 q_limits: torch.Tensor) -> tuple[tuple, tuple]:
    """(early, late) metadata views, made once per forward so kernels' per-forward caches hit on every layer."""
    cached = host.workspace.get("split_views")
    if cached is None or cached[0] is not cu_seqlens_q:
        n, r = host.early_rows, page_rows.shape[0] // 2
        early = (cu_seqlens_q[:r + 1], page_rows[:r], q_limits[:n])
        late = (cu_seqlens_q[r:] - n, page_rows[r:], q_limits[n:])
        cached = host.workspace["split_views"] = (cu_seqlens_q, early, late)
    return cached[1], cached[2]


@graph_break
def _attend_break(kernel: Kernel, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor, page_size: int,
                  scale: float, host: HostLengths, out: torch.Tensor, split: bool = False) -> torch.Tensor:
    """Host lengths are read when the break runs, so a replay sees the live batch's maxima."""
    if not split:
        return _attend(kernel, q, k_pool, v_pool, cu_seqlens_q, page_rows, q_limits, page_size, scale,
                       host.max_q, host.max_kv, out, host.workspace)
    # flashattention path: early blocks, then late blocks, each its own varlen call.
    n = host.early_rows
    early, late = _split_views(host, cu_seqlens_q, page_rows, q_limits)
    _attend(kernel, q[:n], k_pool, v_pool, *early, page_size, scale, host.max_q, host.max_kv, out[:n],
            host.workspace)
    _attend(kernel, q[n:], k_pool, v_pool, *late, page_size, scale, host.max_q, host.max_kv, out[n:],
            host.workspace)
    return out


class PagedAttention:
    """Callable set in the forward context; owns the CP collectives and cache writes of one forward."""

    def __init__(self, pool: KVPool, meta: CPMetadata, comm: CPComm | None, kernel: Kernel, capturable: bool,
                 host: HostLengths, split_early_late: bool, scale: float) -> None:
        self.pool, self.meta, self.comm, self.kernel = pool, meta, comm, kernel
        self.capturable, self.host, self.split, self.scale = capturable, host, split_early_late, scale

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, pool = self.meta, self.pool
        pool.prepare(layer_id)          # LayerSplit: a non-owned layer's cached prefix comes from its owner
        if meta.cp_size > 1:
            local = torch.stack((k, v), dim=1)                                     # [B, 2, Hkv, D]
            gathered = local.new_empty((meta.cp_size * local.shape[0],) + local.shape[1:])
            self.comm.all_gather(gathered, local)
            pool.write(layer_id, meta.gather_slots, gathered[:, 0], gathered[:, 1])
        else:
            pool.write(layer_id, meta.gather_slots, k, v)
        out = torch.empty_like(q)
        if self.capturable and not self.split:
            return _attend(self.kernel, q, pool.keys(layer_id), pool.values(layer_id), meta.cu_seqlens_q, meta.page_rows,
                           meta.q_limits, pool.page_size, self.scale, 0, 0, out, self.host.workspace)
        return _attend_break(self.kernel, q, pool.keys(layer_id), pool.values(layer_id), meta.cu_seqlens_q, meta.page_rows,
                             meta.q_limits, pool.page_size, self.scale, self.host, out, split=self.split)

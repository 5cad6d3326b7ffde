"""flashinfer behind graphcp's kernel contract (see ``torch_paged_attention``), imported lazily.

Two entry points, chosen by the GPU:
- ``trtllm`` (Blackwell, compute capability 10.x): ``flashinfer.prefill.trtllm_batch_context_with_kv_cache``,
  one call over every page-table row. Every argument it needs is a device tensor computed with tensor ops,
  plus two host maxima that may be upper bounds, so the call is graph-capturable: under capture the bounds
  come from the bucket's shapes (local token count, page-table width).
- ``paged`` (other CUDA GPUs): ``BatchPrefillWithPagedKVCacheWrapper``. Its ``plan`` reads the page layout
  on the host, so it runs inside a graph break; the plan is made once per forward and shared by every layer.

Both assume bottom-right-causal sequences (query i of a row sees kv_len - q_len + i + 1 keys). That holds for
zigzag rows and for a single rank, not for interleave, whose per-token limits only the Triton and torch kernels
honour; ``resolve_kernel`` never pairs flashinfer with interleave. Neither entry point is given a sliding
window or attention sinks here (this glue was never run with them on a GPU): layers that need either get
another kernel (``attention.build``), and a call with them is refused rather than run without them.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from graphcp.kernels.torch_ref import per_forward

WORKSPACE_BYTES = 256 << 20      # flashinfer recommends >= 128 MiB; trtllm-gen keeps softmax stats for split KV
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)

_workspaces: dict[torch.device, torch.Tensor] = {}
_wrappers: dict[torch.device, list] = {}


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def variant_for_capability(capability: tuple[int, int]) -> str:
    """trtllm-gen cubins exist for SM100/SM103 (compute capability 10.x); elsewhere the paged prefill wrapper."""
    return "trtllm" if capability[0] == 10 else "paged"


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int, bottom_right: bool,
                       window_or_sinks: bool = False) -> str | None:
    """Why flashinfer cannot serve this configuration (a message naming the flag to change), or None."""
    if not flashinfer_installed():
        return "needs the flashinfer-python package (pip install 'graphcp[gpu]')"
    if device.type != "cuda":
        return "runs on CUDA GPUs only (--device cuda)"
    if dtype not in DTYPES:
        return f"runs in bfloat16 or float16, not {dtype} (--dtype bfloat16)"
    if head_dim not in HEAD_DIMS:
        return f"supports head_dim {HEAD_DIMS}, the model has {head_dim}"
    if not bottom_right:
        return "needs bottom-right-causal rows, which interleave does not give (--cp-strategy zigzag)"
    if window_or_sinks:
        return "is not given sliding windows or attention sinks by graphcp (untested on a GPU)"
    return None


def _refuse_features(window: int, sinks: torch.Tensor | None) -> None:
    if window or sinks is not None:
        raise ValueError("graphcp's flashinfer glue takes no sliding window or attention sinks; "
                         "attention.build gives such layers another kernel")


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _row_lengths(cu_seqlens_q: torch.Tensor, q_limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_lens, kv_lens) per row, int32, by tensor ops only: a row's last query sees its whole KV length."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32)
    last = q_limits[(cu_seqlens_q[1:] - 1).clamp(min=0)].to(torch.int32)
    return q_lens, torch.where(q_lens > 0, last, torch.zeros_like(last))


def _paged_views(k_pool: torch.Tensor, v_pool: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools are [slots, Hkv, D] with slot = page * page_size + offset: the NHD paged layout, as views."""
    shape = (k_pool.shape[0] // page_size, page_size) + tuple(k_pool.shape[1:])
    return k_pool.view(shape), v_pool.view(shape)


def flashinfer_trtllm_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                                page_size: int, scale: float, max_q: int, max_kv: int, out: torch.Tensor, *,
                                workspace: dict | None = None, window: int = 0,
                                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``max_q``/``max_kv`` of 0 mean "unknown on the host" (graph capture): the shape bounds stand in."""
    _refuse_features(window, sinks)
    prefill = importlib.import_module("flashinfer.prefill")
    rows, pages = page_rows.shape
    block_tables, kv_lens, cu_q, cu_kv = per_forward(workspace, "trtllm", (cu_seqlens_q, page_rows, q_limits),
                                                 lambda: _trtllm_lengths(cu_seqlens_q, page_rows, q_limits))
    out.zero_()                                       # rows past the last sequence stay zero (the contract)
    prefill.trtllm_batch_context_with_kv_cache(
        q.contiguous(), _paged_views(k_pool, v_pool, page_size), _workspace(q.device),
        block_tables, kv_lens, max_q or q.shape[0], max_kv or pages * page_size,
        float(scale), 1.0, rows, cu_q, cu_kv, out=out, kv_layout="NHD")
    return out


def _trtllm_lengths(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor,
                    q_limits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """int32 block tables, kv lengths and cumulative q/kv lengths, by tensor ops (capturable)."""
    _, kv_lens = _row_lengths(cu_seqlens_q, q_limits)
    zero = torch.zeros(1, dtype=torch.int32, device=kv_lens.device)
    cu_kv = torch.cat((zero, torch.cumsum(kv_lens, 0, dtype=torch.int32)))
    return page_rows.to(torch.int32), kv_lens, cu_seqlens_q.to(torch.int32), cu_kv


def _paged_plan(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                page_size: int) -> tuple[torch.Tensor, ...]:
    """Plan inputs for the non-empty rows: qo_indptr, kv page indptr, page indices, last-page lengths."""
    q_lens, kv_lens = _row_lengths(cu_seqlens_q, q_limits)
    keep = q_lens > 0                                 # an empty row would need a page count of -1
    q_lens, kv_lens, rows = q_lens[keep], kv_lens[keep], page_rows[keep]
    n_pages = torch.div(kv_lens + page_size - 1, page_size, rounding_mode="floor")
    zero = torch.zeros(1, dtype=torch.int32, device=q_lens.device)
    qo_indptr = torch.cat((zero, torch.cumsum(q_lens, 0, dtype=torch.int32)))
    kv_indptr = torch.cat((zero, torch.cumsum(n_pages, 0, dtype=torch.int32)))
    used = torch.arange(rows.shape[1], device=rows.device)[None, :] < n_pages[:, None]
    indices = rows[used].to(torch.int32)              # row-major: each row's pages in order
    last_len = (kv_lens - (n_pages - 1) * page_size).to(torch.int32)
    return qo_indptr, kv_indptr, indices, last_len


def _wrapper(device: torch.device, index: int):
    """The index-th paged-prefill wrapper of this device (a forward with two plans, early and late, uses two)."""
    pool = _wrappers.setdefault(device, [])
    while len(pool) <= index:
        prefill = importlib.import_module("flashinfer.prefill")
        pool.append(prefill.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), kv_layout="NHD"))
    return pool[index]


def flashinfer_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                               page_size: int, scale: float, max_q: int, max_kv: int, out: torch.Tensor, *,
                               workspace: dict | None = None, window: int = 0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Runs in a graph break: ``plan`` syncs with the host. One plan per distinct row layout per forward."""
    _refuse_features(window, sinks)
    out.zero_()
    if max_q == 0 or max_kv == 0:
        return out
    workspace = {} if workspace is None else workspace

    def plan() -> tuple:
        # A forward with two row layouts (the flashattention split) holds two plans, on two wrappers.
        index = workspace["flashinfer_plans"] = workspace.get("flashinfer_plans", -1) + 1
        wrapper = _wrapper(q.device, index)
        qo_indptr, kv_indptr, indices, last_len = _paged_plan(cu_seqlens_q, page_rows, q_limits, page_size)
        wrapper.plan(qo_indptr, kv_indptr, indices, last_len, q.shape[1], k_pool.shape[1], q.shape[2], page_size,
                     causal=True, sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=k_pool.dtype)
        return wrapper, int(qo_indptr[-1])

    wrapper, total = per_forward(workspace, f"paged{page_size}", (cu_seqlens_q, page_rows, q_limits), plan)
    if total:
        wrapper.run(q[:total].contiguous(), _paged_views(k_pool, v_pool, page_size), out=out[:total])
    return out


__all__ = ["flashinfer_installed", "variant_for_capability", "unsupported_reason", "flashinfer_trtllm_attention",
           "flashinfer_paged_attention"]

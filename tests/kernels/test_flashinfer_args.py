"""graphcp's flashinfer glue on CPU: page tables and lengths translated into flashinfer's documented arguments
(modelled in ``flashinfer_semantics``) must reproduce the torch reference, and kernel selection must refuse
what flashinfer cannot serve with a ConfigError naming the flag."""
from __future__ import annotations

import sys

import pytest
import torch
from testkit import flashinfer_semantics

from graphcp.cp.metadata import zigzag_metadata
from graphcp.errors import ConfigError
from graphcp.kernels import flashinfer_attention as fi
from graphcp.kernels import registry
from graphcp.kernels.registry import KernelContext, kernel_fn
from graphcp.kernels.resolve import check_attention, resolve_kernel
from graphcp.kernels.torch_ref import torch_paged_attention

HQ = 4
KERNELS = {"trtllm": fi.flashinfer_trtllm_attention, "paged": fi.flashinfer_paged_attention}


@pytest.fixture
def semantics(monkeypatch):
    flashinfer_semantics.install(monkeypatch)
    monkeypatch.setattr(fi, "_workspaces", {})
    monkeypatch.setattr(fi, "_wrappers", {})
    monkeypatch.setattr(fi, "WORKSPACE_BYTES", 1 << 12)
    return flashinfer_semantics.CallLog


def _zigzag_case(seed: int, page_size: int, group: int, rank: int = 1, cp: int = 2):
    gen = torch.Generator().manual_seed(seed)
    extend = torch.tensor([13, 22, 8, 2], dtype=torch.int64)          # 2 tokens < 2C blocks: empty late rows
    prefix = torch.tensor([5, 0, 11, 2], dtype=torch.int64)
    rows = extend.shape[0]
    pages = int(((extend + prefix).max() + page_size - 1) // page_size)
    num_pages = 1 + rows * pages + 2
    table = (torch.randperm(num_pages - 1, generator=gen)[: rows * pages] + 1).view(rows, pages)
    local_cap = int(extend.sum()) // cp + 6                            # padding rows at the end
    meta = zigzag_metadata(extend, prefix, table, cp, rank, local_cap, page_size)
    shape = (num_pages * page_size, HQ // group, 64)
    k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(local_cap, HQ, 64, generator=gen)
    return q, k_pool, v_pool, meta


def _run(kernel, q, k_pool, v_pool, meta, page_size, max_q, max_kv, workspace=None):
    out = torch.full_like(q, float("nan"))
    res = kernel(q, k_pool, v_pool, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size, 0.125, max_q, max_kv,
                 out, workspace=workspace)
    assert res is out
    return out


@pytest.mark.parametrize("variant", ["trtllm", "paged"])
@pytest.mark.parametrize("page_size,group,rank", [(16, 1, 0), (1, 2, 1), (4, 4, 1)])
def test_zigzag_rows_match_reference(semantics, variant, page_size, group, rank):
    q, k_pool, v_pool, meta = _zigzag_case(page_size + group, page_size, group, rank)
    assert (meta.q_lens == 0).any(), "the case must include an empty row"
    max_q, max_kv = int(meta.q_lens.max()), int(meta.kv_lens.max())
    ref = torch_paged_attention(q, k_pool, v_pool, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size,
                                0.125, max_q, max_kv, torch.empty_like(q))
    out = _run(KERNELS[variant], q, k_pool, v_pool, meta, page_size, max_q, max_kv)
    assert not torch.isnan(out).any(), "padding rows must be written (zeros)"
    assert (out - ref).abs().max().item() <= 1e-5
    n = int(meta.cu_seqlens_q[-1])
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_trtllm_capture_uses_shape_bounds(semantics):
    """Under capture the host maxima are unknown (0): the bucket's shapes bound them, and the result is the same."""
    q, k_pool, v_pool, meta = _zigzag_case(3, 16, 2)
    eager = _run(fi.flashinfer_trtllm_attention, q, k_pool, v_pool, meta, 16, int(meta.q_lens.max()),
                 int(meta.kv_lens.max()))
    captured = _run(fi.flashinfer_trtllm_attention, q, k_pool, v_pool, meta, 16, 0, 0)
    assert torch.equal(eager, captured)
    bounds = semantics.trtllm_calls[-1]
    assert bounds["max_q_len"] == q.shape[0] and bounds["max_kv_len"] == meta.page_rows.shape[1] * 16
    assert bounds["batch_size"] == meta.page_rows.shape[0]


def test_paged_plans_once_per_layout_per_forward(semantics):
    """Layers share one plan; the flashattention split (early rows, late rows) makes two, on two wrappers."""
    q, k_pool, v_pool, meta = _zigzag_case(4, 16, 2)
    r, n = meta.page_rows.shape[0] // 2, int(meta.cu_seqlens_q[meta.page_rows.shape[0] // 2])
    workspace: dict = {}
    early = (meta.cu_seqlens_q[: r + 1], meta.page_rows[:r], meta.q_limits[:n])   # views made once per forward,
    late = (meta.cu_seqlens_q[r:] - n, meta.page_rows[r:], meta.q_limits[n:])     # as the op's split path does
    for _layer in range(3):
        fi.flashinfer_paged_attention(q[:n], k_pool, v_pool, *early, 16, 0.125, 8, 64, torch.empty_like(q[:n]),
                                      workspace=workspace)
        fi.flashinfer_paged_attention(q[n:], k_pool, v_pool, *late, 16, 0.125, 8, 64, torch.empty_like(q[n:]),
                                      workspace=workspace)
    assert len(semantics.plans) == 2 and len(fi._wrappers[q.device]) == 2
    workspace.clear()                                              # the next forward plans again
    fi.flashinfer_paged_attention(q, k_pool, v_pool, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, 16, 0.125,
                                  8, 64, torch.empty_like(q), workspace=workspace)
    assert len(semantics.plans) == 3 and len(fi._wrappers[q.device]) == 2


def test_trtllm_arguments_built_once_per_forward(semantics):
    """Layers share the int32 tables and cumulative lengths (under capture: recorded once, read by every layer)."""
    q, k_pool, v_pool, meta = _zigzag_case(6, 16, 2)
    workspace: dict = {}
    outs = [_run(fi.flashinfer_trtllm_attention, q, k_pool, v_pool, meta, 16, 0, 0, workspace) for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert [k[0] for k in workspace] == ["trtllm"]


def test_paged_plan_arguments(semantics):
    """Hand-checked plan: rows (q 3, kv 5) and (q 0) and (q 2, kv 17) with page size 4."""
    cu = torch.tensor([0, 3, 3, 5])
    limits = torch.tensor([3, 4, 5, 16, 17, 0])
    table = torch.tensor([[7, 8, 0, 0, 0], [1, 2, 3, 4, 5], [9, 10, 11, 12, 13]])
    qo, kv_indptr, indices, last = fi._paged_plan(cu, table, limits, 4)
    assert qo.tolist() == [0, 3, 5] and kv_indptr.tolist() == [0, 2, 7]
    assert indices.tolist() == [7, 8, 9, 10, 11, 12, 13] and last.tolist() == [1, 1]
    assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, indices, last))


def test_selection_and_errors(semantics):
    cuda = torch.device("cuda")
    assert fi.variant_for_capability((10, 0)) == "trtllm" and fi.variant_for_capability((10, 3)) == "trtllm"
    assert fi.variant_for_capability((9, 0)) == "paged" and fi.variant_for_capability((8, 0)) == "paged"
    assert fi.unsupported_reason(cuda, torch.bfloat16, 128, True) is None
    assert "--dtype" in fi.unsupported_reason(cuda, torch.float32, 128, True)
    assert "head_dim" in fi.unsupported_reason(cuda, torch.float16, 96, True)
    assert "--cp-strategy zigzag" in fi.unsupported_reason(cuda, torch.bfloat16, 64, False)
    with pytest.raises(ConfigError, match="--attention-kernel flashinfer runs on CUDA GPUs only"):
        resolve_kernel("flashinfer", torch.device("cpu"), torch.float32, 64)
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32, 64) == "torch"
    assert kernel_fn("flashinfer-trtllm", cuda) == (fi.flashinfer_trtllm_attention, True)
    assert kernel_fn("flashinfer-paged", cuda) == (fi.flashinfer_paged_attention, False)


def test_missing_package_is_a_config_error(monkeypatch):
    monkeypatch.setattr(fi, "flashinfer_installed", lambda: False)
    with pytest.raises(ConfigError, match="flashinfer-python"):
        resolve_kernel("flashinfer", torch.device("cpu"), torch.bfloat16, 64)


def test_calls_bind_to_the_installed_flashinfer(monkeypatch):
    """Where flashinfer itself is installed (not in CI: it is the optional [gpu] extra), graphcp's calls must
    bind to its real signatures; the arithmetic is still the documented model's, so this runs on CPU."""
    import inspect

    real = pytest.importorskip("flashinfer.prefill")
    real_trtllm = inspect.signature(real.trtllm_batch_context_with_kv_cache)
    real_wrapper = real.BatchPrefillWithPagedKVCacheWrapper
    flashinfer_semantics.install(monkeypatch)
    monkeypatch.setattr(fi, "_wrappers", {})
    model = flashinfer_semantics

    def trtllm(*args, **kwargs):
        real_trtllm.bind(*args, **kwargs)
        return model.trtllm_batch_context_with_kv_cache(*args, **kwargs)

    class Wrapper(model.BatchPrefillWithPagedKVCacheWrapper):
        def __init__(self, *args, **kwargs):
            inspect.signature(real_wrapper.__init__).bind(self, *args, **kwargs)
            super().__init__(*args, **kwargs)

        def plan(self, *args, **kwargs):
            inspect.signature(real_wrapper.plan).bind(self, *args, **kwargs)
            return super().plan(*args, **kwargs)

        def run(self, *args, **kwargs):
            inspect.signature(real_wrapper.run).bind(self, *args, **kwargs)
            return super().run(*args, **kwargs)

    prefill = sys.modules["flashinfer.prefill"]
    monkeypatch.setattr(prefill, "trtllm_batch_context_with_kv_cache", trtllm)
    monkeypatch.setattr(prefill, "BatchPrefillWithPagedKVCacheWrapper", Wrapper)
    q, k_pool, v_pool, meta = _zigzag_case(9, 16, 2)
    ref = torch_paged_attention(q, k_pool, v_pool, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, 16, 0.125,
                                8, 64, torch.empty_like(q))
    for kernel in KERNELS.values():
        out = _run(kernel, q, k_pool, v_pool, meta, 16, int(meta.q_lens.max()), int(meta.kv_lens.max()))
        assert (out - ref).abs().max().item() <= 1e-5


def _probe(variant: str, page_size: int) -> str | None:
    """The start-up check of a flashinfer variant (``kernels/resolve.py``), on CPU through the model."""
    ctx = KernelContext(torch.device("cpu"), torch.float32, 64, (4, 2), page_size)
    return check_attention(registry.KERNELS["flashinfer-" + variant].fn, ctx)


@pytest.mark.parametrize("variant", ["trtllm", "paged"])
def test_probe(semantics, monkeypatch, variant):
    """A working kernel passes the probe; one that raises or computes wrongly is refused, with the reason."""
    assert _probe(variant, 16) is None
    name = "flashinfer_trtllm_attention" if variant == "trtllm" else "flashinfer_paged_attention"

    def broken(*args, **kwargs):
        raise RuntimeError("no cubin for this GPU\nsecond line")

    monkeypatch.setattr(fi, name, broken)
    assert _probe(variant, 16) == "failed its first call (RuntimeError: no cubin for this GPU)"

    def wrong(q, *args, **kwargs):
        return args[-1].zero_()

    monkeypatch.setattr(fi, name, wrong)
    assert "disagrees with the torch kernel" in _probe(variant, 1)


def test_auto_falls_back_when_the_probe_fails(semantics, monkeypatch):
    """auto never picks a flashinfer that cannot serve; an explicit request says why it cannot."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("graphcp.kernels.resolve.check_attention", lambda *a: None)
    assert resolve_kernel("auto", cuda, torch.bfloat16, 128, heads=(4, 2)) == "flashinfer-paged"
    assert resolve_kernel("auto", cuda, torch.bfloat16, 128, bottom_right=False, heads=(4, 2)) != "flashinfer-paged"
    monkeypatch.setattr("graphcp.kernels.resolve.check_attention",
                        lambda *a: "failed its first call (RuntimeError: offline)")
    assert resolve_kernel("auto", cuda, torch.bfloat16, 128, heads=(4, 2)) in ("triton", "torch")
    with pytest.raises(ConfigError, match=r"--attention-kernel flashinfer failed its first call .*offline"):
        resolve_kernel("flashinfer", cuda, torch.bfloat16, 128, heads=(4, 2))

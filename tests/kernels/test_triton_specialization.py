"""Serving never compiles a Triton kernel for a new batch size: every launch wrapper (MoE, FP8, DSA,
KV write, RMSNorm, RoPE) is called at batch sizes of every alignment class (1, multiples of 16,
odd), and Triton's own binder (the one a CUDA launch runs, here for an sm_90a target without a GPU)
must give each kernel the same specialization of its runtime arguments at all of them. An integer
that follows the batch and is specialized (== 1, or divisible by 16) changes it, so the test fails.
Tile constexprs may follow the row count (a bounded set of tile classes, compiled at warmup); they
are not part of the comparison."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported anywhere

from collections import defaultdict

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature  # noqa: E402

from graphcp.kernels import (  # noqa: E402
    triton_dsa,
    triton_fp8_gemm,
    triton_kv_write,
    triton_moe,
    triton_rmsnorm,
    triton_rope,
)
from graphcp.kernels.fp8_types import FP8, Fp8Experts, Fp8Weight  # noqa: E402

KERNELS = {
    "act_quant": (triton_fp8_gemm, "_act_quant_kernel"),
    "fp8_gemm": (triton_fp8_gemm, "_fp8_gemm_kernel"),
    "grouped": (triton_moe, "_grouped_gemm_kernel"),
    "fp8_grouped": (triton_moe, "_fp8_grouped_gemm_kernel"),
    "gating": (triton_moe, "_gated_activation_kernel"),
    "indexer": (triton_dsa, "_indexer_kernel"),
    "sparse_mla": (triton_dsa, "_sparse_mla_kernel"),
    "kv_write": (triton_kv_write, "_kv_write_kernel"),
    "rmsnorm": (triton_rmsnorm, "_rmsnorm_kernel"),
    "rope": (triton_rope, "_rope_kernel"),
}
BATCHES = (1, 16, 17, 48, 57)
BACKEND = make_backend(GPUTarget("cuda", 90, 32))


def _jit(kernel) -> JITFunction:
    """The compiled-mode JIT function of ``kernel`` (the interpreter's keeps the same options)."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _runtime_spec(kernel, args: tuple, kwargs: dict) -> tuple:
    """The specialization Triton's launch computes for these arguments, constexprs left out; every
    tensor as one of the same dtype at an aligned address (allocation alignment is no batch
    property)."""
    jit = _jit(kernel)
    mock = [MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
    mock_kw = {k: MockTensor(v.dtype) if isinstance(v, torch.Tensor) else v
               for k, v in kwargs.items()}
    binder = create_function_from_signature(jit.signature, jit.params, BACKEND)
    _, specialization, _ = binder(*mock, **mock_kw)
    return tuple((p.name, s) for p, s in zip(jit.params, specialization) if not p.is_constexpr)


@pytest.fixture
def launches(monkeypatch):
    """Record every launch of the kernels (name -> [runtime specialization]); the kernels do not
    run (their outputs are not looked at)."""
    seen = defaultdict(list)
    for name, (module, attr) in KERNELS.items():
        kernel = getattr(module, attr)

        def record(*args, grid, warmup, _name=name, _kernel=kernel, **kwargs):
            seen[_name].append(_runtime_spec(_kernel, args, kwargs))

        monkeypatch.setattr(kernel, "run", record)
    return seen


def _fp8_experts(experts: int, n: int, k: int) -> Fp8Experts:
    return Fp8Experts(torch.zeros(experts, n, k, dtype=FP8), torch.ones(experts, -(-n // 16),
                                                                        -(-k // 32)),
                      (torch.arange(n) // 16).to(torch.int32), 0, (16, 32))


def _launch_everything(rows: int) -> None:
    """Each wrapper once with ``rows`` batch rows (tokens, query rows, keys as a batch gives them)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen)
    ids = torch.randint(0, 4, (rows, 2), generator=gen)
    weights = torch.rand(rows, 2, generator=gen)
    gate_up, down = torch.randn(4, 48, 64), torch.randn(4, 64, 24)
    triton_moe.triton_experts(x, ids, weights, gate_up, down, 0)
    triton_moe.triton_experts_fp8(x, ids, weights, _fp8_experts(4, 48, 64),
                                  _fp8_experts(4, 64, 24), 0)
    fp8 = _fp8_experts(1, 96, 64)
    triton_fp8_gemm.triton_fp8_linear(x, Fp8Weight(fp8.weight[0], fp8.scale[0], fp8.scale_rows, 0,
                                                   fp8.block))
    keys = 16 * rows                       # a batch's pages x page size
    slots = torch.arange(keys).view(1, keys)
    row_seq, limits = torch.zeros(rows, dtype=torch.long), torch.full((rows,), keys)
    triton_dsa.indexer_scores(torch.randn(rows, 4, 32), torch.rand(rows, 4), torch.randn(keys, 32),
                              slots, row_seq, limits)
    selected = min(keys, 2 * rows + 1)     # min(index_topk, keys)
    triton_dsa.sparse_mla(torch.randn(rows, 8, 80), torch.randn(keys, 80),
                          slots[:, :selected].expand(rows, -1),
                          torch.ones(rows, selected, dtype=torch.bool), 0.1, 64)
    pool = torch.zeros(4096, 2, 32)
    qkv = torch.randn(rows, 3, 2, 32)
    triton_kv_write.triton_kv_write(pool, pool.clone(), torch.arange(rows), qkv[:, 1], qkv[:, 2])
    fused = torch.randn(rows, 4, 32)
    triton_rmsnorm.triton_rms_norm(fused[:, :2], torch.ones(32), 1e-6)
    triton_rmsnorm.triton_rms_norm(x, torch.ones(64), 1e-6, torch.randn(rows, 64))
    cos = torch.randn(rows, 32)
    triton_rope.triton_rope(fused[:, :3], cos, cos.clone())


def test_no_kernel_specializes_on_the_batch(launches):
    for rows in BATCHES:
        _launch_everything(rows)
    assert set(launches) == set(KERNELS)
    for name, specs in launches.items():
        per_batch = len(specs) // len(BATCHES)
        for i in range(per_batch):      # the i-th launch of the kernel in each batch
            calls = specs[i::per_batch]
            differing = [arg for arg, spec in calls[0] if any(dict(c)[arg] != spec
                                                              for c in calls[1:])]
            assert not differing, f"{name} specializes on the batch through {differing}"


def test_the_check_sees_a_specialized_row_count():
    """The comparison fails for a kernel that specializes its row count: the FP8 GEMM's kernel
    rebuilt without ``do_not_specialize`` gives different specializations at 1, 16 and 17 rows."""
    jit = _jit(triton_fp8_gemm._fp8_gemm_kernel)
    plain = JITFunction(jit.fn)
    specs = set()
    for rows in (1, 16, 17):
        spec = dict(_runtime_spec(plain, (), dict(
            XQ=torch.empty(0, dtype=FP8), XS=torch.empty(0), W=torch.empty(0, dtype=FP8),
            WS=torch.empty(0), WROWS=torch.empty(0, dtype=torch.int32), B=torch.empty(0),
            Y=torch.empty(0), M=rows, N=96, K=64, k_offset=0, num_kb=2, stride_xq=64,
            stride_xs=rows, stride_w=64, stride_ws=2, stride_y=96, HAS_BIAS=False, BLOCK_M=16,
            BLOCK_N=64, BLOCK_K=32, WIDE=False)))
        specs.add((spec["M"], spec["stride_xs"]))
    assert len(specs) == 3

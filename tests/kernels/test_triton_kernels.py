"""graphcp's Triton kernels against the torch oracle, on CPU in Triton's interpreter.

Shapes are kept small (the interpreter runs every program in numpy): Hq 4, sequences of at most 40 tokens.
"""
from __future__ import annotations

import os
import re

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from graphcp.cp.metadata import interleave_metadata, zigzag_metadata
from graphcp.kernels.registry import kernel_fn
from graphcp.kernels.torch_ref import torch_paged_attention
from graphcp.kernels.torch_sdpa import torch_sdpa_attention
from graphcp.kernels.triton_attention import triton_paged_attention
from graphcp.kernels.triton_kv_write import triton_kv_write

HQ = 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _page_table(gen: torch.Generator, rows: int, pages_per_row: int, spare: int = 3) -> tuple[torch.Tensor, int]:
    """Shuffled distinct page ids (page 0 stays the reserved dummy page); returns (table, num_pages)."""
    num_pages = 1 + rows * pages_per_row + spare
    ids = torch.randperm(num_pages - 1, generator=gen)[: rows * pages_per_row] + 1
    return ids.view(rows, pages_per_row), num_pages


def _pools(gen: torch.Generator, num_pages: int, page_size: int, hkv: int, d: int, dtype: torch.dtype):
    shape = (num_pages * page_size, hkv, d)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _compare(q, k_pool, v_pool, cu, page_rows, limits, page_size, max_q, max_kv, capturable, **blocks):
    scale = q.shape[-1] ** -0.5
    ref = torch_paged_attention(q.float(), k_pool.float(), v_pool.float(), cu, page_rows, limits, page_size, scale,
                                max_q, max_kv, torch.empty(q.shape, dtype=torch.float32))
    out = torch.full_like(q, float("nan"))          # every row must be written, padding included
    mq, mkv = (0, 0) if capturable else (max_q, max_kv)
    res = triton_paged_attention(q, k_pool, v_pool, cu, page_rows, limits, page_size, scale, mq, mkv, out, **blocks)
    assert res is out and res.dtype == q.dtype
    assert not torch.isnan(out).any()
    n = int(cu[-1])
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zero"
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[q.dtype], f"max abs error {err}"
    return err


# (page_size, gqa ratio, head_dim, dtype, capturable)
VARLEN_CASES = [
    (16, 1, 64, torch.float32, True),
    (1, 2, 64, torch.float32, False),
    (16, 4, 128, torch.float32, True),
    (1, 4, 128, torch.bfloat16, True),
    (16, 2, 128, torch.bfloat16, False),
    (1, 1, 64, torch.bfloat16, True),
]


@pytest.mark.parametrize("page_size,group,head_dim,dtype,capturable", VARLEN_CASES)
def test_varlen_with_prefixes(page_size, group, head_dim, dtype, capturable):
    gen = torch.Generator().manual_seed(1000 * page_size + 10 * group + head_dim)
    q_lens = [int(x) for x in torch.randint(1, 25, (3,), generator=gen)] + [0]      # one empty sequence
    prefixes = [int(x) for x in torch.randint(0, 16, (4,), generator=gen)]
    kv_lens = [p + n for p, n in zip(prefixes, q_lens)]
    S, pad = len(q_lens), 5
    P = max(-(-kv // page_size) for kv in kv_lens) + 1
    page_rows, num_pages = _page_table(gen, S, P)
    k_pool, v_pool = _pools(gen, num_pages, page_size, HQ // group, head_dim, dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64)
    limits = [kv - n + i + 1 for n, kv in zip(q_lens, kv_lens) for i in range(n)]
    limits = torch.tensor(limits + [0] * pad, dtype=torch.int64)
    q = torch.randn(int(cu[-1]) + pad, HQ, head_dim, generator=gen).to(dtype)
    _compare(q, k_pool, v_pool, cu, page_rows, limits, page_size, max(q_lens), max(kv_lens), capturable)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64), (64, 32)])
def test_tiles_and_key_blocks(block_m, block_n):
    """Sequences that are not multiples of the tile, several tiles and several key blocks per sequence."""
    gen = torch.Generator().manual_seed(block_m + 7 * block_n)
    page_size, head_dim = 4, 64
    q_lens, prefixes = [17, 3, 40, 1], [0, 21, 9, 30]
    kv_lens = [p + n for p, n in zip(prefixes, q_lens)]
    P = max(-(-kv // page_size) for kv in kv_lens)
    page_rows, num_pages = _page_table(gen, 4, P)
    k_pool, v_pool = _pools(gen, num_pages, page_size, 2, head_dim, torch.float32)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64)
    limits = torch.tensor([kv - n + i + 1 for n, kv in zip(q_lens, kv_lens) for i in range(n)] + [0] * 3)
    q = torch.randn(int(cu[-1]) + 3, HQ, head_dim, generator=gen)
    _compare(q, k_pool, v_pool, cu, page_rows, limits, page_size, max(q_lens), max(kv_lens), True,
             block_m=block_m, block_n=block_n)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_batches(data):
    """Random batches (fp32, capturable path): sequence count, lengths, prefixes, page size, GQA ratio, padding."""
    S = data.draw(st.integers(1, 5), label="S")
    q_lens = data.draw(st.lists(st.integers(0, 20), min_size=S, max_size=S), label="q_lens")
    prefixes = data.draw(st.lists(st.integers(0, 20), min_size=S, max_size=S), label="prefixes")
    page_size = data.draw(st.sampled_from([1, 2, 8, 16]), label="page_size")
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    pad = data.draw(st.integers(0, 17), label="pad")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefixes, q_lens)]
    P = max(1, max(-(-kv // page_size) for kv in kv_lens))
    page_rows, num_pages = _page_table(gen, S, P)
    k_pool, v_pool = _pools(gen, num_pages, page_size, HQ // group, 64, torch.float32)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64)
    limits = torch.tensor([kv - n + i + 1 for n, kv in zip(q_lens, kv_lens) for i in range(n)] + [0] * pad,
                          dtype=torch.int64)
    T = int(cu[-1]) + pad
    if T == 0:
        return
    q = torch.randn(T, HQ, 64, generator=gen)
    _compare(q, k_pool, v_pool, cu, page_rows, limits, page_size, max(max(q_lens), 1), max(max(kv_lens), 1), True)


def _cp_case(layout, rank, page_size, group, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    cp, head_dim = 2, 64
    extend = torch.tensor([13, 22, 8], dtype=torch.int64)
    prefix = torch.tensor([5, 0, 11], dtype=torch.int64)
    R = extend.shape[0]
    P = int(((extend + prefix).max() + page_size - 1) // page_size)
    page_table, num_pages = _page_table(gen, R, P)
    local_cap = int(extend.sum()) // cp + 4                       # room for padding rows
    make = zigzag_metadata if layout == "zigzag" else interleave_metadata
    meta = make(extend, prefix, page_table, cp, rank, local_cap, page_size)
    k_pool, v_pool = _pools(gen, num_pages, page_size, HQ // group, head_dim, dtype)
    q = torch.randn(local_cap, HQ, head_dim, generator=gen).to(dtype)
    return q, k_pool, v_pool, meta


@pytest.mark.parametrize("layout,rank,page_size,group,dtype", [
    ("zigzag", 0, 1, 2, torch.float32),
    ("zigzag", 1, 16, 4, torch.bfloat16),
    ("interleave", 1, 1, 1, torch.float32),
    ("interleave", 0, 16, 2, torch.bfloat16),
])
def test_cp_layouts(layout, rank, page_size, group, dtype):
    """Zigzag: 2R sequences sharing page rows (early blocks, then late ones). Interleave: per-query limits that
    are not contiguous within a sequence. Both with padding rows at the end, both capturable and not."""
    q, k_pool, v_pool, meta = _cp_case(layout, rank, page_size, group, dtype, seed=rank + 31 * page_size)
    if layout == "zigzag":
        assert meta.page_rows.shape[0] == 2 * 3
    else:
        lim = meta.q_limits[: int(meta.cu_seqlens_q[1])]
        assert (lim[1:] - lim[:-1] > 1).all()                  # strided positions
    assert int(meta.cu_seqlens_q[-1]) < q.shape[0]            # padding rows present
    max_q, max_kv = int(meta.q_lens.max()), int(meta.kv_lens.max())
    for capturable in (True, False):
        _compare(q, k_pool, v_pool, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size, max_q, max_kv,
                 capturable)


def test_flashattention_split_views():
    """The split path passes row slices and shifted cu_seqlens (views with offsets)."""
    q, k_pool, v_pool, meta = _cp_case("zigzag", 0, 16, 2, torch.float32, seed=5)
    r = meta.page_rows.shape[0] // 2
    n = int(meta.cu_seqlens_q[r])
    cu_late = meta.cu_seqlens_q[r:] - n
    max_q, max_kv = int(meta.q_lens.max()), int(meta.kv_lens.max())
    _compare(q[n:], k_pool, v_pool, cu_late, meta.page_rows[r:], meta.q_limits[n:], 16, max_q, max_kv, True)
    _compare(q[:n], k_pool, v_pool, meta.cu_seqlens_q[: r + 1], meta.page_rows[:r], meta.q_limits[:n], 16, max_q,
             max_kv, True)


def test_all_padding_and_shape_checks():
    q = torch.randn(6, HQ, 64)
    k_pool = v_pool = torch.randn(8, 2, 64)
    cu = torch.zeros(3, dtype=torch.int64)
    out = torch.full_like(q, float("nan"))
    rows, limits = torch.ones(2, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    triton_paged_attention(q, k_pool, v_pool, cu, rows, limits, 4, 0.125, 0, 0, out)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(AssertionError):
        bad = torch.randn(6, HQ, 48)         # not a head dim the kernel serves
        triton_paged_attention(bad, torch.randn(8, 2, 48), torch.randn(8, 2, 48), cu,
                               torch.ones(2, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int64), 4, 0.1, 0, 0,
                               torch.empty_like(bad))


@pytest.mark.parametrize("dtype,heads,head_dim", [(torch.float32, 2, 64), (torch.bfloat16, 3, 128)])
def test_kv_write(dtype, heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    num_slots, n_real, n_pad = 64, 21, 6
    slots = torch.cat([torch.randperm(num_slots - 1, generator=gen)[:n_real] + 1,
                       torch.zeros(n_pad, dtype=torch.int64)])
    kv = torch.randn(n_real + n_pad, 2, heads, head_dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]                                   # strided views, as the gathered buffer gives
    k_pool = torch.randn(num_slots, heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, heads, head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref.index_copy_(0, slots[:n_real], k[:n_real])
    v_ref.index_copy_(0, slots[:n_real], v[:n_real])
    triton_kv_write(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[1:], k_ref[1:]) and torch.equal(v_pool[1:], v_ref[1:])
    # the dummy slot holds one of the padding rows
    assert any(torch.equal(k_pool[0], k[i]) for i in range(n_real, n_real + n_pad))
    assert any(torch.equal(v_pool[0], v[i]) for i in range(n_real, n_real + n_pad))


def test_kernel_fn_capturable_only_on_cuda():
    fn, capturable = kernel_fn("triton", torch.device("cpu"))
    assert fn is triton_paged_attention and not capturable
    assert kernel_fn("triton", torch.device("cuda"))[1] is True
    assert kernel_fn("torch", torch.device("cuda")) == (torch_sdpa_attention, False)


def test_start_probe(monkeypatch):
    """The start-up probe passes the real kernel (here in the interpreter); a failing probe on CUDA makes
    auto fall back to torch and an explicit triton request a ConfigError with the reason."""
    from graphcp.errors import ConfigError
    from graphcp.kernels import resolve as probe_module
    from graphcp.kernels.registry import KernelContext
    from graphcp.kernels.resolve import check_attention, resolve_kernel

    def ctx(page_size: int) -> KernelContext:
        return KernelContext(torch.device("cpu"), torch.float32, 64, (4, 2), page_size)

    assert check_attention(triton_paged_attention, ctx(16)) is None
    assert "disagrees" in check_attention(lambda *a, **k: a[-1].zero_(), ctx(4))
    cuda = torch.device("cuda")
    monkeypatch.setattr(probe_module, "check_attention", lambda *a: None)
    assert resolve_kernel("auto", cuda, torch.bfloat16, 64, heads=(4, 2)) in ("triton", "flashinfer-paged",
                                                                              "flashinfer-trtllm")
    monkeypatch.setattr(probe_module, "check_attention", lambda *a: "failed its first call (RuntimeError: ptxas)")
    monkeypatch.setattr("graphcp.kernels.flashinfer_attention.flashinfer_installed", lambda: False)
    assert resolve_kernel("auto", cuda, torch.bfloat16, 64, heads=(4, 2)) == "torch"
    with pytest.raises(ConfigError, match="--attention-kernel triton failed its first call .*ptxas"):
        resolve_kernel("triton", cuda, torch.bfloat16, 64, heads=(4, 2))


def test_explicit_triton_with_an_unsupported_head_dim_is_a_config_error():
    """As the README promises: an explicit --attention-kernel triton that cannot serve the model's
    head_dim is refused naming the flag, never silently replaced by the torch kernel."""
    from graphcp.errors import ConfigError
    from graphcp.kernels.registry import TRITON_HEAD_DIMS
    from graphcp.kernels.resolve import resolve_kernel
    dims = re.escape(str(TRITON_HEAD_DIMS))
    with pytest.raises(ConfigError, match=rf"--attention-kernel triton supports head_dim {dims}, the model has 48"):
        resolve_kernel("triton", torch.device("cpu"), torch.float32, 48)
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32, 48) == "torch"

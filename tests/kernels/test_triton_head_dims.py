"""The Triton paged kernel at every head dim the families use (32, 64, 80, 96, 128, 192, 256): the
ones that are not a power of two run in a padded tile masked on the real dims. On CPU in Triton's
interpreter, small shapes, against the torch reference (``torch_paged_attention``) in fp32: GQA,
cached prefixes on shuffled pages, padding rows, windows and sinks at d256, a CP layout. And the
kernel choice: on CUDA, auto and an explicit ``triton`` take it at these head dims."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import json
import subprocess
import sys

import pytest
import torch
from testkit.paths import REPO

pytest.importorskip("triton")

from graphcp.cp.metadata import zigzag_metadata
from graphcp.kernels.registry import KERNELS, TRITON_HEAD_DIMS, KernelContext
from graphcp.kernels.torch_ref import torch_paged_attention
from graphcp.kernels.triton_attention import attention_tiles, block_d, triton_paged_attention

HQ = 4
FAMILY_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)


def _batch(gen, d, hkv, page_size, q_lens, prefixes, pad=3):
    """Sequences extending cached prefixes on shuffled pages (page 0 unused), then padding rows."""
    kv_lens = [n + p for n, p in zip(q_lens, prefixes)]
    pages = max(-(-kv // page_size) for kv in kv_lens)
    num_pages = 1 + len(q_lens) * pages + 2
    table = (torch.randperm(num_pages - 1, generator=gen)[:len(q_lens) * pages] + 1)
    page_rows = table.view(len(q_lens), pages)
    shape = (num_pages * page_size, hkv, d)
    k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(sum(q_lens) + pad, HQ, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    limits = torch.tensor([p + i + 1 for n, p in zip(q_lens, prefixes) for i in range(n)]
                          + [0] * pad)
    return q, k_pool, v_pool, cu, page_rows, limits


def _compare(q, k_pool, v_pool, cu, page_rows, limits, page_size, window=0, sinks=None):
    scale = q.shape[-1] ** -0.5
    n = int(cu[-1])
    max_q, max_kv = int((cu[1:] - cu[:-1]).max()), int(limits[:n].max())
    want = torch_paged_attention(q.float(), k_pool.float(), v_pool.float(), cu, page_rows, limits,
                                 page_size, scale, max_q, max_kv,
                                 torch.empty(q.shape, dtype=torch.float32), window=window,
                                 sinks=sinks)
    out = torch.full_like(q, float("nan"))          # every row must be written, padding included
    triton_paged_attention(q, k_pool, v_pool, cu, page_rows, limits, page_size, scale, 0, 0, out,
                           window=window, sinks=sinks)
    assert not torch.isnan(out).any()
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zero"
    return float((out.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("d", FAMILY_HEAD_DIMS)
def test_head_dims_with_prefix_and_gqa(d):
    """Two sequences, one over a cached prefix crossing pages, GQA 2 (kv head h // 2)."""
    gen = torch.Generator().manual_seed(d)
    batch = _batch(gen, d, 2, 4, [13, 6], [0, 11])
    assert _compare(*batch, 4) <= 1e-4


@pytest.mark.parametrize("d,window,sinks", [(256, 7, True), (256, 5, False), (256, 0, True),
                                            (80, 6, True), (192, 9, False)])
def test_window_and_sinks(d, window, sinks):
    """gpt-oss-style layers at wide and padded head dims: a sliding window, sink logits, MQA."""
    gen = torch.Generator().manual_seed(window + d)
    batch = _batch(gen, d, 1, 4, [21, 5], [3, 14])
    sink = torch.randn(HQ, generator=gen) * 2 if sinks else None
    assert _compare(*batch, 4, window=window, sinks=sink) <= 1e-4


def test_d256_on_a_zigzag_layout():
    """CP 2 zigzag rank 1 (early and late blocks of each request, prefix on one), page size 16."""
    gen = torch.Generator().manual_seed(7)
    extend, prefix, page_size, d = torch.tensor([37, 12]), torch.tensor([20, 0]), 16, 256
    pages = -(-int((extend + prefix).max()) // page_size)
    table = (torch.randperm(2 * pages + 3, generator=gen)[:2 * pages] + 1).view(2, pages)
    meta = zigzag_metadata(extend, prefix, table, 2, 1, 28, page_size)
    shape = ((2 * pages + 4) * page_size, 2, d)
    k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(28, HQ, d, generator=gen)
    err = _compare(q, k_pool, v_pool, meta.cu_seqlens_q, meta.page_rows, meta.q_limits, page_size)
    assert err <= 1e-4


def test_bf16_padded_head_dim():
    """bf16 at d96 (a padded tile), within the start-up check's tolerance."""
    gen = torch.Generator().manual_seed(3)
    batch = [t.to(torch.bfloat16) if t.is_floating_point() else t
             for t in _batch(gen, 96, 2, 4, [9, 14], [5, 0])]
    assert _compare(*batch, 4) <= 3e-2


def test_padding_never_leaks_into_real_dims():
    """Whatever the pool holds past a row's head dims (here a wider row viewed narrower: the next
    head's values), the output sees only the real dims."""
    gen = torch.Generator().manual_seed(5)
    q, k_pool, v_pool, cu, page_rows, limits = _batch(gen, 80, 2, 4, [10], [6])
    wide_k = torch.randn(k_pool.shape[0], 2, 128, generator=gen) * 100
    wide_k[..., :80] = k_pool
    wide_v = torch.randn(v_pool.shape[0], 2, 128, generator=gen) * 100
    wide_v[..., :80] = v_pool
    # strided views: the kernel reads 80 of each 128-wide row and must mask the rest
    err = _compare(q, wide_k[..., :80], wide_v[..., :80], cu, page_rows, limits, 4)
    assert err <= 1e-4


def test_tiles_per_head_dim():
    """256-wide tiles (d192, d256) halve the key block in bf16; 80/96 share d128's tiles."""
    assert [block_d(d) for d in FAMILY_HEAD_DIMS] == [32, 64, 128, 128, 128, 256, 256]
    for rows in (512, 8192):
        assert attention_tiles(rows, 96, torch.bfloat16) == attention_tiles(rows, 128,
                                                                            torch.bfloat16)
        assert attention_tiles(rows, 256, torch.bfloat16).block_n == 32
        assert attention_tiles(rows, 256, torch.bfloat16).num_warps == 8
    assert attention_tiles(8192, 256, torch.float32) == attention_tiles(8192, 128, torch.float32)
    # windowed / sink layers: smaller tiles where Triton 3.6 spilled (kernel report under 3.6)
    assert attention_tiles(512, 128, torch.float32, windowed=True) == (16, 16, 4, 2)
    assert attention_tiles(512, 256, torch.bfloat16, windowed=True).block_n == 16
    assert attention_tiles(8192, 256, torch.bfloat16, windowed=True) == \
        attention_tiles(8192, 256, torch.bfloat16)
    assert attention_tiles(512, 128, torch.bfloat16, windowed=True) == \
        attention_tiles(512, 128, torch.bfloat16)


def test_resolve_picks_triton_on_cuda_for_every_family_head_dim(monkeypatch):
    """No GPU needed: the start-up probe and flashinfer are stood in for, as in the existing
    kernel-choice tests; the choice itself is the real rule. An unlisted head dim still falls to
    torch under auto and is refused naming the flag when asked for."""
    from graphcp.errors import ConfigError
    from graphcp.kernels import resolve
    monkeypatch.setattr(resolve, "check_attention", lambda *a: None)
    monkeypatch.setattr("graphcp.kernels.flashinfer_attention.flashinfer_installed", lambda: False)
    cuda = torch.device("cuda")
    assert set(FAMILY_HEAD_DIMS) <= set(TRITON_HEAD_DIMS)
    for d in FAMILY_HEAD_DIMS:
        ctx = KernelContext(cuda, torch.bfloat16, d, (4, 2), 16, True, True)
        assert KERNELS["triton"].unsupported_reason(ctx) is None
        for window_or_sinks in (False, True):
            assert resolve.resolve_kernel("auto", cuda, torch.bfloat16, d, heads=(4, 2),
                                          window_or_sinks=window_or_sinks) == "triton"
        assert resolve.resolve_kernel("triton", cuda, torch.float32, d, heads=(4, 2)) == "triton"
    assert resolve.resolve_kernel("auto", cuda, torch.bfloat16, 48, heads=(4, 2)) == "torch"
    with pytest.raises(ConfigError, match="--attention-kernel triton supports head_dim"):
        resolve.resolve_kernel("triton", cuda, torch.bfloat16, 48, heads=(4, 2))
    # CPU keeps its choice: auto is the torch kernel at every head dim
    for d in FAMILY_HEAD_DIMS:
        assert resolve.resolve_kernel("auto", torch.device("cpu"), torch.float32, d) == "torch"


def test_check_attention_passes_at_d256_with_window_and_sinks():
    """The start-up check the engine runs on CUDA, here in the interpreter at d256."""
    from graphcp.kernels.resolve import check_attention
    ctx = KernelContext(torch.device("cpu"), torch.float32, 256, (4, 1), 16, True, True)
    assert check_attention(triton_paged_attention, ctx) is None


def test_lengths_are_not_specialised():
    """Compiled (not interpreted) kernels keep T, S, P and the window as plain runtime ints: a batch
    of a new alignment class reuses the compiled kernel."""
    code = ("import json; from graphcp.kernels import triton_attention as a, triton_mla as m; "
            "print(json.dumps({f.__name__: [p.name for p in f.params if p.do_not_specialize] "
            "for f in (a._paged_attn_kernel, m._mla_prefill_kernel)}))")
    env = dict(os.environ, PYTHONPATH=REPO, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"T", "S", "P", "window"} <= set(names["_paged_attn_kernel"])
    assert {"T", "S", "P"} <= set(names["_mla_prefill_kernel"])


@pytest.mark.parametrize("head_dim", [80, 256])
def test_engine_at_a_wide_and_a_padded_head_dim(ckpt_dir, engines, oracle, head_dim):
    """The engine with ``--attention-kernel triton`` (interpreter) at CP 2 zigzag, in graphs, on a
    one-layer Qwen3 at head_dim 80 (padded tile) and 256 (Qwen3-Next's), equal to HF; then a
    chunk over the cached prefix."""
    from testkit.engines import cp_kwargs
    from testkit.hf_reference import make_checkpoint
    from testkit.parity import Session, random_ids
    ckpt = make_checkpoint(str(ckpt_dir / f"qwen3_hd{head_dim}"), "qwen3", seed=head_dim,
                           num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                           head_dim=head_dim)
    engine = engines.get(ckpt, **cp_kwargs(2, "zigzag", attention_kernel="triton",
                                           attention_backend="trtllm_mha",
                                           cuda_graph_buckets=[16, 32]))
    assert engine.stats()["attention_kernel"] == "triton"
    s = Session(engine, oracle, ckpt)
    out = s.run([("a", random_ids(21, 211, 1)), ("b", random_ids(8, 211, 2))])
    assert out.cp_applied and out.mode == "graph"
    s.run([("a", random_ids(6, 211, 3))])
    s.release_all()

"""The Triton MLA prefill kernel (``kernels/triton_mla.py``, absorbed form over the paged latent
rows, causal by each row's limit) against the torch forms of ``kernels/mla_torch.py`` (expanded
and absorbed), on CPU in Triton's interpreter, fp32: cached prefixes on shuffled pages, zigzag
and interleave CP layouts, padding rows, head counts and latent widths that are not powers of two,
DeepSeek-V3's real widths (latent 512, rope 64). And the dense MLA op's dispatch: the Triton form
where the rank's choices accepted it, the torch break otherwise (CPU)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from graphcp.cp.metadata import HostMaxima, interleave_metadata, zigzag_metadata
from graphcp.kernels.mla_torch import MLAArgs, MLADims, mla_attention
from graphcp.kernels.registry import LAYER_KERNELS, KernelChoices, KernelContext, KernelSpec
from graphcp.kernels.triton_mla import mla_prefill_tiles, triton_mla_prefill

SMALL = MLADims(latent=32, rope=16, nope=16, value=24)


def _args(gen, dims, heads, q_lens, prefixes, page_size=4, pad=3, meta=None):
    """Random MLA inputs; ``meta`` (cu, page_rows, limits, rows) from a CP layout, else plain
    sequences extending cached prefixes on shuffled pages."""
    if meta is None:
        kv_lens = [n + p for n, p in zip(q_lens, prefixes)]
        pages = max(-(-kv // page_size) for kv in kv_lens)
        num_pages = 1 + len(q_lens) * pages + 2
        ids = torch.randperm(num_pages - 1, generator=gen)[:len(q_lens) * pages] + 1
        page_rows = ids.view(len(q_lens), pages)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        limits = torch.tensor([p + i + 1 for n, p in zip(q_lens, prefixes) for i in range(n)]
                              + [0] * pad)
        rows = sum(q_lens) + pad
    else:
        cu, page_rows, limits, rows, num_pages = meta
    width = dims.nope + dims.rope
    q = torch.randn(rows, heads, width, generator=gen)
    kv_pool = torch.randn(num_pages * page_size, dims.latent + dims.rope, generator=gen)
    kv_b = torch.randn(heads * (dims.nope + dims.value), dims.latent, generator=gen) * 0.2
    out = torch.full((rows, heads, dims.value), float("nan"))
    return MLAArgs(q, kv_pool, kv_b, cu, page_rows, limits, out, page_size, width ** -0.5, dims)


def _errors(args: MLAArgs) -> float:
    """Worst relative error of the Triton kernel against both torch forms; every row written."""
    got = triton_mla_prefill(args).clone()
    assert not torch.isnan(got).any()
    n = int(args.cu_seqlens_q[-1])
    assert torch.equal(got[n:], torch.zeros_like(got[n:])), "padding rows must be zero"
    worst = 0.0
    for form in ("expanded", "absorbed"):
        want = mla_attention(MLAArgs(**{**vars(args), "out": torch.empty_like(args.out)}),
                             form=form)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.parametrize("heads,dims,page_size", [
    (4, SMALL, 4),
    (3, MLADims(latent=48, rope=8, nope=16, value=24), 1),       # padded latent and rope
    (20, SMALL, 16),                                             # two head blocks, one partial
])
def test_prefixes_and_padding(heads, dims, page_size):
    gen = torch.Generator().manual_seed(heads)
    args = _args(gen, dims, heads, [17, 6, 1], [0, 13, 5], page_size)
    assert _errors(args) <= 1e-4


def test_deepseek_v3_widths():
    """latent 512 + rope 64, nope 128, value 128 (as released), two heads, a short batch."""
    gen = torch.Generator().manual_seed(11)
    args = _args(gen, MLADims(512, 64, 128, 128), 2, [7, 3], [4, 9], page_size=16, pad=2)
    assert _errors(args) <= 1e-4


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
def test_cp_layouts(strategy):
    """Rank 1 of CP 2: zigzag's early/late blocks, interleave's per-token limits."""
    gen = torch.Generator().manual_seed(5)
    extend, prefix, page_size = torch.tensor([29, 10]), torch.tensor([12, 0]), 4
    pages = -(-int((extend + prefix).max()) // page_size)
    table = (torch.randperm(2 * pages + 3, generator=gen)[:2 * pages] + 1).view(2, pages)
    make = zigzag_metadata if strategy == "zigzag" else interleave_metadata
    meta = make(extend, prefix, table, 2, 1, 24, page_size)
    args = _args(gen, SMALL, 4, None, None, page_size,
                 meta=(meta.cu_seqlens_q, meta.page_rows, meta.q_limits, 24, 2 * pages + 4))
    assert _errors(args) <= 1e-4


def test_head_chunks(monkeypatch):
    """Heads in chunks (the absorbed queries past the chunk budget) give the same output."""
    from graphcp.kernels import triton_mla
    gen = torch.Generator().manual_seed(2)
    args = _args(gen, SMALL, 40, [9, 4], [3, 0])
    whole = triton_mla_prefill(args).clone()
    monkeypatch.setattr(triton_mla, "_CHUNK_BYTES", 2 * 16 * 16 * 32 * 4)    # 16 heads a chunk
    args.out.fill_(float("nan"))
    assert torch.equal(triton_mla_prefill(args), whole)


def test_tiles():
    """32-row query tiles on CUDA in bf16 (tokens x heads), 16 in fp32 and in the interpreter."""
    for heads, (bh, bt) in {1: (1, 32), 4: (4, 8), 16: (16, 2), 128: (32, 1)}.items():
        t = mla_prefill_tiles(heads, torch.bfloat16)
        assert (t.block_h, t.block_t, t.block_n, t.num_warps) == (bh, bt, 32, 8)
    assert mla_prefill_tiles(128, torch.float32)[:3] == (16, 1, 16)
    assert mla_prefill_tiles(4, torch.float32, on_cuda=False)[:2] == (4, 4)


def test_dispatch(monkeypatch):
    """The dense MLA op runs the Triton kernel where the rank's choices accepted it (as a probe
    on CUDA does), the torch break otherwise; the registry names it with its reason."""
    from graphcp.attention import mla as mla_op
    spec = LAYER_KERNELS["mla_prefill"]
    assert spec.fn is triton_mla_prefill and spec.capturable("cuda")
    assert spec.unsupported_reason(KernelContext(torch.device("cpu"), torch.float32, 512)) is None
    assert "kv_lora_rank 1024" in spec.unsupported_reason(
        KernelContext(torch.device("cuda"), torch.bfloat16, 1024))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET" in spec.unsupported_reason(
        KernelContext(torch.device("cpu"), torch.float32))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(4)
    args = _args(gen, SMALL, 4, [8, 5], [2, 0])
    want = mla_attention(MLAArgs(**{**vars(args), "out": torch.empty_like(args.out)}))
    calls = []
    choices = KernelChoices()
    assert choices.probe("mla_prefill", lambda fn: fn(args), lambda: want, torch.float32)
    choices.fns["mla_prefill"] = lambda a, *rest: calls.append(a) or triton_mla_prefill(a)
    with choices.active():
        got = mla_op.attend(args, HostMaxima())
    assert calls and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    calls.clear()
    got = mla_op.attend(args, HostMaxima())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5) and not calls


def test_start_probe_at_the_model_widths(monkeypatch):
    """``attention.probe_kernels`` (the runner calls it on CUDA; the mla kind's probe) checks the
    kernel at the config's widths and the rank's heads: it accepts the real kernel (here in the
    interpreter), refuses a wrong one, and probes nothing for layers without a probing kind."""
    from testkit.mla_checkpoint import DEEPSEEK_V3, SHRUNK

    from graphcp.attention import probe_kernels
    from graphcp.models.registry import config_from_dict
    cfg = config_from_dict({**DEEPSEEK_V3, **SHRUNK, "num_hidden_layers": 2}, "config.json")
    assert set(cfg.attention_kinds) == {"mla"}
    cpu = torch.device("cpu")
    choices = KernelChoices()
    probe_kernels(choices, cfg, range(2), 2, cpu, torch.float32)
    assert choices.get("mla_prefill") is triton_mla_prefill
    wrong = KernelChoices()
    monkeypatch.setitem(LAYER_KERNELS, "mla_prefill", KernelSpec(
        "mla_prefill", "triton", "tests.kernels.test_triton_mla", "_zeros", True))
    probe_kernels(wrong, cfg, range(2), 2, cpu, torch.float32)
    assert "mla_prefill" in wrong.fns and wrong.get("mla_prefill") is None
    none = KernelChoices()
    probe_kernels(none, cfg, range(0), 1, cpu, torch.float32)
    assert "mla_prefill" not in none.fns


def _zeros(args: MLAArgs) -> torch.Tensor:
    return args.out.zero_()

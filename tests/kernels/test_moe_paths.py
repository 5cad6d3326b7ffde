"""The MoE grouped GEMMs with every family's gating (Triton's interpreter): SiLU, DeepSeek V4's
clamped SwiGLU and gpt-oss's clamped SwiGLU with per-expert biases, plain and FP8, equal to their
torch forms under expert parallelism; the families' experts take that path (only routed pairs are
computed) and their torch forms still equal transformers' activations; padding tiles write zeros."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest
import torch
from test_triton_moe_fp8 import _experts, _rel, _routing
from torch import nn

from graphcp.kernels import moe_torch
from graphcp.kernels.moe_torch import SILU, GatedActivation

pytest.importorskip("triton")
from graphcp.kernels import triton_moe

V4 = GatedActivation(limit=0.5)                              # small: the clamp bites at these scales
GPT_OSS = GatedActivation(limit=0.5, alpha=1.702, up_shift=1.0)


def _hf_v4(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """transformers' DeepseekV4 expert gating."""
    return nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _hf_gpt_oss(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """transformers' GptOssExperts gating."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def test_gated_activation_is_transformers_gating():
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(2, 50, 8, generator=gen) * 2
    assert torch.equal(SILU(gate, up), nn.functional.silu(gate) * up)
    assert torch.equal(V4(gate, up), _hf_v4(gate, up, 0.5))
    assert torch.equal(GPT_OSS(gate, up), _hf_gpt_oss(gate, up, 0.5, 1.702))
    assert not torch.equal(V4(gate, up), SILU(gate, up))            # the clamp bites here


def _plain(gen: torch.Generator, experts: int, hidden: int, inter: int, bias: bool) -> tuple:
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    biases = ((torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden,
                                                                            generator=gen))
              if bias else moe_torch.NO_BIASES)
    return gate_up, down, biases


@pytest.mark.parametrize("activation,bias", [(SILU, False), (V4, False), (GPT_OSS, True)])
def test_grouped_experts_match_torch_form_per_gating(activation, bias):
    """Six experts over two EP ranks (expert 4 empty, 5 crowded), row tiles 16 and 32, hidden 40 and
    intermediate 24 (partial K and N tiles). fp32 only: the interpreter's bf16 dots multiply raw
    bits (the bf16 gating is checked on its own below, the bf16 GEMM by the FP8 path)."""
    dtype, tol = torch.float32, 1e-5
    gen = torch.Generator().manual_seed(1)
    gate_up, down, biases = _plain(gen, 3, 40, 24, bias)
    x = torch.randn(21, 40, generator=gen) * 2
    ids, weights = _routing(21, 6, 3, gen)
    ids[ids == 4] = 5
    cast = tuple(None if b is None else b.to(dtype) for b in biases)
    args = (x.to(dtype), ids, weights.to(dtype), gate_up.to(dtype), down.to(dtype))
    for first in (0, 3):
        want = moe_torch.dense_experts_torch(*args, first, activation, cast)
        for block_m in (None, 32):
            got = triton_moe.triton_experts(*args, first, block_m, activation, cast)
            assert got.dtype == dtype and want.abs().max() > 0
            assert _rel(got, want) <= tol, (first, block_m)
    # the gating is the one asked for: SiLU's result is far from the clamped one
    if activation is not SILU:
        silu = moe_torch.dense_experts_torch(*args, 0, SILU, cast)
        assert _rel(silu, moe_torch.dense_experts_torch(*args, 0, activation, cast)) > 1e-2


@pytest.mark.parametrize("activation,bias", [(V4, False), (GPT_OSS, True)])
def test_fp8_grouped_experts_with_clamp_and_biases(activation, bias):
    """The FP8 grouped GEMM with a clamped gating and biases equals its torch form (same activation
    rounding): the loader's layout, an expert-TP slice starting inside a block, EP with pairs
    routed elsewhere."""
    gen = torch.Generator().manual_seed(2)
    gate_up, down, _ = _experts(3, 72, 64, 20, 58, gen)
    biases = ((torch.randn(3, 76, generator=gen), torch.randn(3, 72, generator=gen)) if bias
              else moe_torch.NO_BIASES)
    x = torch.randn(21, 72, generator=gen) * 3
    ids, weights = _routing(21, 6, 3, gen)
    for first in (0, 3):
        got = triton_moe.triton_experts_fp8(x, ids, weights, gate_up, down, first, None,
                                            activation, biases)
        want = moe_torch.experts_fp8_torch(x, ids, weights, gate_up, down, first, activation,
                                           biases)
        assert want.abs().max() > 0 and _rel(got, want) <= 1e-5, first


def test_gated_activation_kernel_against_torch():
    """The gating launch alone: fp32 to rounding, bf16 within one rounding of the bf16 torch form;
    columns past one program's block (inter 1100 > 1024); the rows of a padding tile (the second
    of three 2-row tiles, which the down projection never reads) are skipped: NaNs there stay
    out of the live rows."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(6, 2 * 1100, generator=gen) * 3
    h[2:4] = float("nan")
    tiles, live = torch.tensor([0, -1, 1]), [0, 1, 4, 5]
    for activation in (SILU, V4, GPT_OSS):
        want = activation(h[:, :1100], h[:, 1100:])[live]
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            got = triton_moe.gated_activation(h.to(dtype), activation, tiles)
            assert got.dtype == dtype and got.shape == (6, 1100)
            assert _rel(got[live], want) <= tol


def test_plain_grouped_gemm_padding_tile_writes_zeros():
    """A padding tile (expert -1) writes zeros even where its rows name real rows (it returns before
    reading them or a weight); rows -1 in a live tile hold the bias alone."""
    gen = torch.Generator().manual_seed(4)
    gate_up, _, (bias, _) = _plain(gen, 2, 24, 8, True)
    a = torch.randn(5, 24, generator=gen)
    rows = torch.tensor([0, 3, -1, -1] + [4, 1, 2, 0] + [1, 2, 3, 4])    # tiles of 4 rows
    tile_expert = torch.tensor([1, 0, -1])
    out = triton_moe.grouped_gemm(a, rows, gate_up, tile_expert, bias)
    assert torch.equal(out[8:], torch.zeros(4, 16))
    assert torch.allclose(out[2], bias[1]) and torch.allclose(out[3], bias[1])
    for r in (0, 1, 4, 5, 6, 7):
        e = int(tile_expert[r // 4])
        want = a[rows[r]] @ gate_up[e].t() + bias[e]
        assert _rel(out[r], want) <= 1e-6, r


def test_families_route_their_experts_through_the_grouped_gemm():
    """V4's and unquantized gpt-oss's experts are no longer torch-only: they carry their gating and
    biases to the grouped GEMM (``Experts.forward`` takes it on CUDA); MXFP4 gpt-oss layers keep
    the dequantizing torch form."""
    import transformers
    from testkit.deepseek_v4_reference import CSA, HCA, TINY
    from testkit.gpt_oss_checkpoint import tiny_config

    from graphcp.distributed.shards import EPInfo
    from graphcp.models.deepseek_v4.moe import ClampedExperts
    from graphcp.models.gpt_oss.moe import GptOssExperts
    from graphcp.models.registry import config_from_dict

    ep = EPInfo()
    raw = transformers.DeepseekV4Config(**TINY, layer_types=[CSA, "sliding_attention", HCA],
                                        compress_rates={CSA: 4, HCA: 16}).to_dict()
    v4 = ClampedExperts(config_from_dict(raw, "test"), ep)
    assert v4.triton_form and v4.activation == GatedActivation(limit=TINY["swiglu_limit"])
    assert v4.biases() == (None, None)
    plain = GptOssExperts(config_from_dict(tiny_config(1, quantized=False), "test"), 0, ep)
    assert plain.triton_form and plain.activation.up_shift == 1.0
    assert plain.biases()[0] is plain.gate_up_proj_bias
    quantized = GptOssExperts(config_from_dict(tiny_config(1), "test"), 0, ep)
    assert quantized.quantized and not quantized.triton_form
    # what Experts.forward hands the kernel on CUDA equals the module's own torch form (its
    # per-expert weights and biases, transformers' gating), here on CPU in the interpreter
    gen = torch.Generator().manual_seed(5)
    for experts in (v4, plain):
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        x = torch.randn(11, experts.gate_up_proj.shape[-1], generator=gen) * 2
        ids, weights = _routing(11, experts.num_experts, 2, gen)
        got = triton_moe.triton_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                                        experts.first, activation=experts.activation,
                                        biases=experts.biases())
        assert _rel(got, experts(x, ids, weights)) <= 1e-5


def test_traffic_load_counts_on_device_without_host_reads(monkeypatch):
    """The expert load accumulates in a device tensor: counting reads nothing back to the host
    (``tolist``/``item``/``bool`` raise while it counts); the stats read it once."""
    from graphcp.distributed.moe_comm import MoETraffic

    traffic = MoETraffic(ep_size=3, experts_per_rank=2)
    ids = torch.tensor([[0, 5], [1, 2], [4, 4]])
    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, lambda *a, _name=name: pytest.fail(f"host {_name}"))
        traffic.add_load(ids, torch.tensor([1, 0, 1]))                 # row 1 is padding
        traffic.add_load(ids.reshape(-1), torch.tensor([1, 1, 0, 0, 1, 0]))    # pairs, one copy
        traffic.add_load(ids)
    assert traffic.load.dtype == torch.int64
    # rank of each expert: 0->0, 5->2, 1->0, 2->1, 4->2
    assert traffic.as_dict()["pairs_per_ep_rank"] == [1 + 1 + 2, 0 + 0 + 1, 3 + 2 + 3]
    assert MoETraffic(2, 4).as_dict()["pairs_per_ep_rank"] == [0, 0]

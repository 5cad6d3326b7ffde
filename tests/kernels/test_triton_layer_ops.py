"""The one-launch Triton forms of the layer ops (used on CUDA) against their torch forms, in Triton's
interpreter on CPU: RMSNorm and the rotary embedding, on contiguous tensors and on column slices of a
fused qkv projection."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from graphcp.kernels import registry
from graphcp.kernels.triton_rmsnorm import triton_rms_norm
from graphcp.kernels.triton_rope import triton_rope
from graphcp.models.common.layers import rms_norm_torch, rope_torch


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


def _fused_qkv(gen: torch.Generator, t: int, hq: int, hk: int, d: int, dtype: torch.dtype):
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    return q, k


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (7, 96)), (torch.bfloat16, (5, 64)),
                                         (torch.float16, (3, 200))])
def test_rms_norm_rows(dtype, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[1], generator=gen).to(dtype)
    _close(triton_rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_add(dtype):
    """The residual add fused into the norm: the same sum (rounded to the dtype) and the norm of it."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 80, generator=gen).to(dtype)
    res = (torch.randn(6, 80, generator=gen) * 5).to(dtype)
    w = torch.randn(80, generator=gen).to(dtype)
    normed, total = triton_rms_norm(x, w, 1e-6, res)
    assert torch.equal(total, res + x) if dtype == torch.float32 else \
        (total.float() - (res + x).float()).abs().max().item() <= 2 ** -5 * total.float().abs().max().item()
    _close(normed, rms_norm_torch(total, w, 1e-6), dtype)


def test_rms_norm_head_slices():
    gen = torch.Generator().manual_seed(3)
    q, k = _fused_qkv(gen, 6, 4, 2, 64, torch.float32)
    w = torch.randn(64, generator=gen)
    for x in (q, k):
        got = triton_rms_norm(x, w, 1e-5)
        assert got.is_contiguous()
        _close(got, rms_norm_torch(x, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype,d,hq,hk", [(torch.float32, 64, 4, 2), (torch.bfloat16, 128, 3, 1),
                                           (torch.float32, 96, 20, 4)])
def test_rope(dtype, d, hq, hk):
    """Head counts above the 16-head block and a head_dim whose half is not a power of two included."""
    gen = torch.Generator().manual_seed(d + hq)
    t = 9
    q, k = _fused_qkv(gen, t, hq, hk, d, dtype)
    angles = torch.rand(t, d // 2, generator=gen) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    for x in (q, k):
        got = triton_rope(x, cos, sin)
        ref = rope_torch(x, cos[:, None], sin[:, None])
        if dtype == torch.float32:
            _close(got, ref, dtype)
        else:   # Triton's interpreter truncates on bf16 casts (GPUs round to nearest): a few units in the last place
            assert (got.float() - ref.float()).abs().max().item() <= 2 ** -5 * ref.float().abs().max().item()


def test_lookup():
    assert registry.LAYER_KERNELS["rms_norm"].fn is triton_rms_norm
    assert registry.LAYER_KERNELS["rope"].fn is triton_rope


def test_first_use_check_falls_back_to_the_torch_form(monkeypatch, caplog):
    """A Triton layer op that raises or disagrees at its start-up check is replaced by the torch form,
    with a warning; one that agrees is kept and not checked again. The choices are the rank's own
    (``KernelChoices``): ``chosen`` sees them only while they are active."""
    choices = registry.KernelChoices()
    x = torch.randn(4, 8)
    torch_call = lambda: x * 2  # noqa: E731

    def raising(fn):
        raise RuntimeError("no kernel image\nmore")

    assert not choices.probe("rope", raising, torch_call, torch.float32)
    assert choices.get("rope") is None and "failed its first call (RuntimeError: no kernel image)" in caplog.text
    assert not choices.probe("rms_norm", lambda fn: (x * 3, x), lambda: (x * 2, x), torch.float32)
    assert choices.get("rms_norm") is None and "disagrees with the torch form" in caplog.text
    calls = []
    assert choices.probe("rope", lambda fn: calls.append(fn) or x * 2, torch_call, torch.float32)
    assert registry.chosen("rope") is None                      # not active: the torch form
    with choices.active():
        assert registry.chosen("rope") is triton_rope and calls == [triton_rope]
        assert registry.chosen("rope") is triton_rope and calls == [triton_rope]   # not checked again
        with pytest.raises(RuntimeError, match="another rank's kernel choices"):
            with registry.KernelChoices().active():
                pass
    assert registry.chosen("rope") is None

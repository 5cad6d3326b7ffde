"""The Triton RMSNorm (used on CUDA) against the torch form, in Triton's interpreter on CPU."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from graphcp.models.layers import rms_norm_torch as _torch_form  # noqa: E402
from graphcp.models.triton_rmsnorm import triton_rms_norm  # noqa: E402


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (7, 96)), (torch.bfloat16, (5, 64)),
                                         (torch.float16, (3, 200))])
def test_rows(dtype, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[1], generator=gen).to(dtype)
    got, ref = triton_rms_norm(x, w, 1e-6), _torch_form(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


def test_head_slices_of_a_fused_projection():
    """q/k norms read [T, H, D] column slices of the qkv output: strided rows and heads, no copy."""
    gen = torch.Generator().manual_seed(3)
    t, hq, hk, d = 6, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    w = torch.randn(d, generator=gen)
    for x in (q, k):
        got = triton_rms_norm(x, w, 1e-5)
        assert got.is_contiguous()
        assert torch.allclose(got, _torch_form(x, w, 1e-5), rtol=1e-6, atol=1e-6)

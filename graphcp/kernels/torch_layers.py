"""The torch forms of the layer ops, as HF computes them: what the models run where no Triton form
serves, and what each Triton form is checked against."""
from __future__ import annotations

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, then back to the input dtype before the weight, as the HF reference does.
    fp32 takes torch's fused op (the same values: held bit-equal by tests/models/test_rope.py; 30% faster
    on CPU). Otherwise the last product is taken in place (same values: a fresh tensor, and
    products commute), which spares an allocation as large as x."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 1 \
            and weight.shape[0] == x.shape[-1]:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight.dtype == y.dtype and weight.shape == y.shape[-weight.dim():]:
        return y.mul_(weight)
    return weight * y


def rotated_sin(sin: torch.Tensor) -> torch.Tensor:
    """cat(-sin_lo, sin_hi): rotate_half(x) * sin == cat(x_hi * that_lo, x_lo * that_hi), exactly
    (negation is exact), so RoPE needs no negated copy of x. Made once per forward."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_major: bool = False, rot_sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D]: the HF form x * cos + rotate_half(x) * sin, each product and
    the sum rounded in x's dtype as HF rounds them (bit-equal), in four ops: the rotated product is
    written half by half from ``rot_sin`` (``rotated_sin``). ``head_major``: the result is laid out
    [H, T, D] in memory (same values, no extra cost); re-measured alternately, torch's CPU flash
    kernel reads it as fast as [T, H, D] rows (0.98-1.04x at 2-16K keys)."""
    if (cos.dtype != x.dtype or sin.dtype != x.dtype
            or torch.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape):
        return x * cos + _rotate_half(x) * sin
    rot_sin = rotated_sin(sin) if rot_sin is None else rot_sin
    half = x.shape[-1] // 2

    def fresh() -> torch.Tensor:
        if head_major and x.dim() == 3:
            t, h, d = x.shape
            return torch.empty((h, t, d), dtype=x.dtype, device=x.device).transpose(0, 1)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    rotated = fresh()
    torch.mul(x[..., half:], rot_sin[..., :half], out=rotated[..., :half])
    torch.mul(x[..., :half], rot_sin[..., half:], out=rotated[..., half:])
    return torch.mul(x, cos, out=fresh()).add_(rotated)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1), each half written straight into the result (no negated temporary)."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.neg(x[..., half:], out=out[..., :half])
    out[..., half:] = x[..., :half]
    return out


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's pairwise rotation of (x0, x1), (x2, x3), ...; the output is de-interleaved (even
    results, then odd ones), as HF writes it. cos/sin: the usual cat(freqs, freqs) tables."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

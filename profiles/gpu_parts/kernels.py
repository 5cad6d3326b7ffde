"""Part a: graphcp's Triton kernels (paged varlen attention, KV write, RMSNorm, RoPE) against the
torch reference in fp32, bf16, up to 32k tokens: causal single sequences, and varlen batches with
cached prefixes and padding rows; the same cases through flashinfer where it is installed."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import SkipPart, device_of, triton_ready

if TYPE_CHECKING:
    import torch

    from .report import Report

TITLE = "Triton kernels vs torch reference"


def paged_case(q_lens: list[int], prefixes: list[int], hq: int, hkv: int, d: int, page_size: int,
               pad: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """Random paged pools, shuffled page tables (page 0 stays the dummy page), queries and row
    limits: [q, k_pool, v_pool, cu_seqlens_q, page_rows, q_limits]."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefixes, q_lens)]
    pages_per_row = max(-(-kv // page_size) for kv in kv_lens)
    num_pages = 1 + len(q_lens) * pages_per_row + 2
    ids = torch.randperm(num_pages - 1, generator=gen)[: len(q_lens) * pages_per_row] + 1
    page_rows = ids.view(len(q_lens), pages_per_row)
    shape = (num_pages * page_size, hkv, d)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64)
    limits = torch.cat([torch.arange(n, dtype=torch.int64) + p + 1
                        for p, n in zip(prefixes, q_lens)] + [torch.zeros(pad, dtype=torch.int64)])
    q = torch.randn(int(cu[-1]) + pad, hq, d, generator=gen).to(dtype)
    return [t.to(torch.device(device)) for t in (q, k_pool, v_pool, cu, page_rows, limits)]


def reference_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        cu: torch.Tensor, page_rows: torch.Tensor, limits: torch.Tensor,
                        page_size: int, scale: float,
                        max_bytes: int = 3 << 30) -> torch.Tensor:
    """torch_paged_attention in fp32, per sequence and in query chunks so 32k x 32k never
    materializes."""
    import torch

    from graphcp.kernels.torch_ref import torch_paged_attention
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qf, kf, vf = q.float(), k_pool.float(), v_pool.float()
    bounds = cu.tolist()
    hq = q.shape[1]
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        if b == a:
            continue
        kv = int(limits[b - 1])
        rows = max(1, min(b - a, max_bytes // (4 * 4 * hq * max(kv, 1))))
        for c in range(a, b, rows):
            e = min(b, c + rows)
            lim = limits[c:e]
            sub_cu = torch.tensor([0, e - c], dtype=cu.dtype, device=cu.device)
            torch_paged_attention(qf[c:e], kf, vf, sub_cu, page_rows[s:s + 1], lim, page_size,
                                  scale, e - c, int(lim.max()), out[c:e])
    return out


def flashinfer_kernels(rep: Report, dtype: torch.dtype, head_dim: int) -> list[tuple[str, Any]]:
    """[(name, kernel)] for the flashinfer variant this GPU would use, when flashinfer is installed.
    """
    import torch

    from graphcp.kernels import flashinfer_attention as fi
    if rep.dry_run or fi.unsupported_reason(torch.device("cuda"), dtype, head_dim, True):
        return []
    variant = fi.variant_for_capability(torch.cuda.get_device_capability())
    fn = fi.flashinfer_trtllm_attention if variant == "trtllm" else fi.flashinfer_paged_attention
    return [(f"flashinfer-{variant}", fn)]


def _cases(dry_run: bool) -> list[tuple]:
    """(name, q_lens, prefixes, hq, hkv, d, page_size, padding rows, dtype, tolerance)."""
    import torch
    bf16 = torch.bfloat16
    if dry_run:   # Triton's interpreter: tiny shapes
        return [("causal 1x40 h4/2 d64 p16 fp32", [40], [0], 4, 2, 64, 16, 0, torch.float32, 1e-5),
                ("causal 1x40 h4/2 d64 p16 bf16", [40], [0], 4, 2, 64, 16, 0, bf16, 2e-2),
                ("varlen [7,20,1]+prefix [0,5,33] h4/2 d64 p1 bf16", [7, 20, 1], [0, 5, 33],
                 4, 2, 64, 1, 3, bf16, 2e-2)]
    return [("causal 1x1024 h32/8 d128 p16", [1024], [0], 32, 8, 128, 16, 0, bf16, 2e-2),
            ("causal 1x8192 h32/4 d64 p16", [8192], [0], 32, 4, 64, 16, 0, bf16, 2e-2),
            ("causal 1x32768 h32/8 d128 p16", [32768], [0], 32, 8, 128, 16, 0, bf16, 2e-2),
            ("varlen [1000,3000,17,4096]+prefix [0,2048,500,8192] h32/8 d128 p16",
             [1000, 3000, 17, 4096], [0, 2048, 500, 8192], 32, 8, 128, 16, 37, bf16, 2e-2),
            ("varlen [513,77,2048]+prefix [100,0,4000] h32/4 d64 p1", [513, 77, 2048],
             [100, 0, 4000], 32, 4, 64, 1, 5, bf16, 2e-2)]


def run(rep: Report, workdir: str) -> str:
    import torch
    why = triton_ready()
    if why:
        if rep.dry_run:
            raise SkipPart(why)
        raise RuntimeError(f"cannot test the Triton kernels: {why}")
    from graphcp.kernels.triton_attention import triton_paged_attention
    device = device_of(rep)
    cases = _cases(rep.dry_run)
    for i, (name, q_lens, prefixes, hq, hkv, d, ps, pad, dtype, tol) in enumerate(cases):
        if rep.left() < (3 if rep.dry_run else 20):
            rep.cut(f"attention cases {[c[0] for c in cases[i:]]}")
            break
        q, kp, vp, cu, rows, lim = paged_case(q_lens, prefixes, hq, hkv, d, ps, pad, dtype, device,
                                              seed=100 + i)
        scale = d ** -0.5
        out = torch.full_like(q, float("nan"))
        triton_paged_attention(q, kp, vp, cu, rows, lim, ps, scale, 0, 0, out)   # 0, 0: capturable
        ref = reference_attention(q, kp, vp, cu, rows, lim, ps, scale)
        n = int(cu[-1])
        pad_ok = bool((out[n:] == 0).all())
        err = float((out[:n].float() - ref[:n]).abs().max())      # NaN stays NaN: never within tol
        rep.check("a", f"triton attention {name}", "max abs err", err if pad_ok else float("inf"),
                  tol, padding_rows_zero=pad_ok)
        max_kv = max(p + n for p, n in zip(prefixes, q_lens))
        for fi_name, fi_fn in flashinfer_kernels(rep, dtype, d):
            fi_out = torch.full_like(q, float("nan"))
            fi_fn(q, kp, vp, cu, rows, lim, ps, scale, max(q_lens), max_kv, fi_out)
            fi_err = float((fi_out[:n].float() - ref[:n]).abs().max())
            rep.check("a", f"{fi_name} attention {name}", "max abs err",
                      fi_err if bool((fi_out[n:] == 0).all()) else float("inf"), tol)
        del q, kp, vp, out, ref
    _check_kv_write(rep, device)
    _check_layer_ops(rep, device)
    return ""


def _check_kv_write(rep: Report, device: str) -> None:
    """Scatter rows into shuffled slots; padding rows all point at the dummy slot 0."""
    import torch

    from graphcp.kernels.triton_kv_write import triton_kv_write
    shape = (30, 3, 2, 64, 64) if rep.dry_run else (32768, 64, 8, 128, 40000)
    n_rows, pad, hkv, d, slots_total = shape
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    slots = torch.cat([torch.randperm(slots_total - 16, generator=gen)[:n_rows] + 16,
                       torch.zeros(pad, dtype=torch.int64)]).to(device)
    k = torch.randn(n_rows + pad, hkv, d, generator=gen).to(bf16).to(device)
    v = torch.randn(n_rows + pad, hkv, d, generator=gen).to(bf16).to(device)
    kp = torch.zeros(slots_total, hkv, d, dtype=bf16, device=device)
    vp = torch.zeros_like(kp)
    triton_kv_write(kp, vp, slots, k, v)
    rk, rv = torch.zeros_like(kp), torch.zeros_like(vp)
    rk[slots[:n_rows]] = k[:n_rows]
    rv[slots[:n_rows]] = v[:n_rows]
    mismatch = float(((kp[1:] != rk[1:]).any() | (vp[1:] != rv[1:]).any()).item())
    rep.check("a", f"triton kv_write {n_rows}+{pad} pad rows h{hkv} d{d} bf16", "slots differing",
              mismatch, 0.0)


def _check_layer_ops(rep: Report, device: str) -> None:
    """The Triton RMSNorm and rotary embedding against their torch forms, on hidden rows and on q
    heads sliced from a fused qkv output (strided, as the model passes them)."""
    import torch

    from graphcp.kernels.triton_rmsnorm import triton_rms_norm
    from graphcp.kernels.triton_rope import triton_rope
    from graphcp.models.common.layers import rms_norm_torch, rope_torch
    t, hidden, heads, d = (9, 64, 2, 64) if rep.dry_run else (8192, 4096, 32, 128)
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(t, hidden, generator=gen) * 4).to(bf16).to(device)
    w = torch.randn(hidden, generator=gen).to(bf16).to(device)
    qkv = torch.randn(t, 3 * heads * d, generator=gen).to(bf16).to(device)
    q, wd = qkv[:, : heads * d].view(t, heads, d), w[:d].contiguous()
    angles = (torch.rand(t, d // 2, generator=gen) * 100).to(device)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(bf16)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(bf16)
    res = (torch.randn(t, hidden, generator=gen) * 4).to(bf16).to(device)
    cases = (("rmsnorm rows", triton_rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)),
             ("rmsnorm + residual add rows", triton_rms_norm(x, w, 1e-6, res)[0],
              rms_norm_torch(res + x, w, 1e-6)),
             ("rmsnorm q heads of fused qkv", triton_rms_norm(q, wd, 1e-6),
              rms_norm_torch(q, wd, 1e-6)),
             ("rope q heads of fused qkv", triton_rope(q, cos, sin),
              rope_torch(q, cos[:, None], sin[:, None])))
    for name, got, ref in cases:
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        rep.check("a", f"triton {name} {tuple(ref.shape)} bf16", "max rel err", err,
                  2e-2 if rep.dry_run else 1e-2)

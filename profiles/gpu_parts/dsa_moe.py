"""Part g: the DSA Triton kernels (indexer scoring, sparse MLA) and the grouped expert GEMM against
their torch forms run in fp32 on the same inputs (Triton's interpreter on a dry run), with their
times.

The indexer must also write -inf exactly past each row's causal limit: top-k reads that pattern to
skip invisible keys, so a kernel leaving scores there would pass a finite-only comparison and then
pick future tokens."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .common import cuda_ms, device_of, rel_err

if TYPE_CHECKING:
    import torch

    from .report import Report

TITLE = "DSA and grouped-expert Triton kernels vs fp32 torch"


def _neg_inf_mismatch(got: torch.Tensor, want: torch.Tensor) -> float:
    """Positions where the kernel's -inf (or a NaN) disagrees with the reference's."""
    import torch
    return float(((torch.isneginf(got) != torch.isneginf(want)) | torch.isnan(got)).sum())


def run(rep: Report, workdir: str) -> str:
    import torch

    from graphcp.kernels import dsa_torch, triton_dsa
    from graphcp.kernels.moe_torch import dense_experts_torch as experts_torch
    from graphcp.kernels.triton_moe import triton_experts
    dev = device_of(rep)
    dtype = torch.float32 if rep.dry_run else torch.bfloat16
    tol = 1e-5 if rep.dry_run else 1e-2        # bf16 output rounding against fp32: 2^-8 of the max
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    # Indexer: rows x heads x dim queries over a sequence's keys; all rows but the last see a part.
    sizes = (6, 16, 32, 40, 8) if rep.dry_run else (4096, 64, 128, 8192, 2048)
    rows, heads, dim, keys, topk = sizes
    q, index_keys = rand(rows, heads, dim), rand(keys, dim)
    w = torch.randn(rows, heads, generator=gen).to(dev)
    slots = torch.randperm(keys, generator=gen).view(1, keys).to(dev)
    row_seq = torch.zeros(rows, dtype=torch.long, device=dev)
    limits = torch.linspace(keys // 2, keys, rows).long().to(dev)
    want = dsa_torch.indexer_scores(q, w, index_keys, slots, row_seq, limits)   # fp32 throughout
    got = triton_dsa.indexer_scores(q, w, index_keys, slots, row_seq, limits)
    name = f"DSA indexer {rows}x{heads}x{dim} over {keys} keys"
    seen = torch.isfinite(want)
    rep.check("g", f"{name} (visible keys)", "max rel err",
              rel_err(got[seen].float().cpu(), want[seen].float().cpu()), tol)
    rep.check("g", f"{name}: -inf past the causal limit", "positions differing",
              _neg_inf_mismatch(got.cpu(), want.cpu()), 0.0, masked=int((~seen).sum()))
    selected, shown = dsa_torch.select_topk(want, slots, row_seq, limits, topk)
    mla_heads, latent, rope = (4, 32, 16) if rep.dry_run else (16, 512, 64)
    q_mla, kv = rand(rows, mla_heads, latent + rope), rand(keys, latent + rope)
    ref = dsa_torch.sparse_mla(q_mla.float(), kv.float(), selected, shown, 0.1, latent)
    out = triton_dsa.sparse_mla(q_mla, kv, selected, shown, 0.1, latent)
    rep.check("g", f"sparse MLA {rows}x{mla_heads} heads, top-{topk} vs fp32", "max rel err",
              rel_err(out.float().cpu(), ref.cpu()), tol)
    # Grouped experts: tokens routed top-k over this rank's experts.
    n, hidden, inter, experts, k = (9, 64, 32, 4, 2) if rep.dry_run else (4096, 2048, 1408, 8, 2)
    x = rand(n, hidden)
    gate_up, down = rand(experts, 2 * inter, hidden) * 0.05, rand(experts, hidden, inter) * 0.05
    ids = torch.randint(0, experts, (n, k), generator=gen).to(dev)
    weights = torch.rand(n, k, generator=gen).to(dev, dtype)
    ref = experts_torch(x.float(), ids, weights.float(), gate_up.float(), down.float(), 0)
    out = triton_experts(x, ids, weights, gate_up, down, 0)
    rep.check("g", f"grouped experts {n} tokens top-{k} over {experts} experts vs fp32",
              "max rel err", rel_err(out.float().cpu(), ref.cpu()), 1e-4 if rep.dry_run else 3e-2)
    if rep.dry_run:
        return "interpreter, tiny shapes"
    index_args = (q, w, index_keys, slots, row_seq, limits)
    mla_args = (q_mla, kv, selected, shown, 0.1, latent)
    ms = {"indexer": cuda_ms(lambda: triton_dsa.indexer_scores(*index_args), 2, 5),
          "sparse_mla": cuda_ms(lambda: triton_dsa.sparse_mla(*mla_args), 2, 5),
          "experts": cuda_ms(lambda: triton_experts(x, ids, weights, gate_up, down, 0), 2, 5),
          "experts_torch": cuda_ms(lambda: experts_torch(x, ids, weights, gate_up, down, 0), 1, 3)}
    rep.info["dsa_moe_kernel_ms"] = ms
    return ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())

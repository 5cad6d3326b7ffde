"""Times the dense MLA kernel's two forms side by side (``kernels/mla_torch.py``), at DeepSeek-V3's
per-head sizes (latent 512, rope 64, nope 128, value 128) with its 128 heads over attention TP 8,
and prints which form the cost rule picks for each case.

    python -m graphcp.tools.mla_forms [--reps 3] [--heads 16] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch

from graphcp.kernels.mla_torch import MLAArgs, MLADims, expanded_is_cheaper, mla_attention

# (new tokens, cached prefix): fresh prompts, and chunks over a long prefix
CASES = ((256, 0), (1024, 0), (512, 512), (64, 2048), (128, 2048), (256, 2048), (512, 2048))
PAGE = 16


def _case(new: int, prefix: int, heads: int, d: MLADims, device: torch.device) -> MLAArgs:
    gen = torch.Generator().manual_seed(new + prefix)
    kv_len = new + prefix
    pages = -(-kv_len // PAGE)
    pool = torch.randn((pages + 1) * PAGE, d.latent + d.rope, generator=gen)
    kv_b = torch.randn(heads * (d.nope + d.value), d.latent, generator=gen) * d.latent ** -0.5
    q = torch.randn(new, heads, d.nope + d.rope, generator=gen)
    page_row = torch.randperm(pages, generator=gen)[None] + 1          # scattered pages; 0 is dummy
    args = MLAArgs(q, pool, kv_b, torch.tensor([0, new]), page_row,
                   torch.arange(prefix + 1, kv_len + 1), torch.empty(new, heads, d.value), PAGE,
                   (d.nope + d.rope) ** -0.5, d)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(args).items()}
    return MLAArgs(**moved)


def _median_ms(args: MLAArgs, form: str, reps: int) -> float:
    mla_attention(args, form=form)                         # warm
    times = []
    for _ in range(reps):
        if args.q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        mla_attention(args, form=form)
        if args.q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    ns = parser.parse_args(argv)
    d, device = MLADims(latent=512, rope=64, nope=128, value=128), torch.device(ns.device)
    print(f"dense MLA forms, {ns.heads} heads, medians of {ns.reps}, {device}")
    print(f"{'new':>6} {'prefix':>6} {'expanded ms':>12} {'absorbed ms':>12}"
          f" {'absorbed/expanded':>18} {'rule picks':>11}")
    for new, prefix in CASES:
        args = _case(new, prefix, ns.heads, d, device)
        expanded, absorbed = (_median_ms(args, f, ns.reps) for f in ("expanded", "absorbed"))
        pick = "expanded" if expanded_is_cheaper(1, new, new + prefix, ns.heads, d) else "absorbed"
        print(f"{new:>6} {prefix:>6} {expanded:>12.1f} {absorbed:>12.1f}"
              f" {absorbed / expanded:>18.2f} {pick:>11}")


if __name__ == "__main__":
    main()

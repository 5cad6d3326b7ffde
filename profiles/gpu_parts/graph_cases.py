"""Graph replay vs eager on batches that fill no bucket exactly (parts c and d, at CP 1 and CP 2).

Every timing shape of part c fills its bucket and every request there is fresh; here the bucket is
padded (1x200 replays the 256 bucket, 3x300 the 1024 one) and some requests extend a cached prefix
(the second chunk of a request, alone or beside a fresh one). The first chunks replay as graphs too,
and end mid-page, so the second chunk's kernels read KV a graph wrote from a half-filled page.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import prefill, rel_err, require_graph

if TYPE_CHECKING:
    from .report import Report

Case = tuple[str, list[tuple[int, int]]]     # name, [(cached prefix, new tokens)] per request


def cases(dry_run: bool, cp_size: int) -> list[Case]:
    """Shapes whose CP-local tokens pad a bucket by at most 2x (past that the planner runs eagerly):
    GPU buckets (256, 1024, ...) at CP 1 and (128, 512, 1024) at CP 2; dry-run buckets (16, 32, 64).
    """
    if not dry_run:
        return [("1x200", [(0, 200)]), ("3x300", [(0, 300)] * 3),
                ("2nd chunk 250+200", [(250, 200)]),
                ("2nd chunk 1000+100 beside a fresh 150", [(1000, 100), (0, 150)])]
    if cp_size == 1:
        return [("1x12", [(0, 12)]), ("3x9", [(0, 9)] * 3), ("2nd chunk 20+12", [(20, 12)]),
                ("2nd chunk 20+6 beside a fresh 8", [(20, 6), (0, 8)])]
    return [("1x20", [(0, 20)]), ("3x12", [(0, 12)] * 3), ("2nd chunk 20+16", [(20, 16)]),
            ("2nd chunk 20+8 beside a fresh 12", [(20, 8), (0, 12)])]


def _run_path(engine: Any, tag: str, tokens: list[tuple[list[int], list[int]]],
              eager: bool) -> tuple[Any, Any]:
    """Prefill the cached prefixes, then the new chunks, in one mode; release every request after.
    -> (the prefixes' output or None, the new chunks' output)."""
    rids = [f"{tag}-{'eager' if eager else 'graph'}-{j}" for j in range(len(tokens))]
    try:
        first = [(rid, pre) for rid, (pre, _) in zip(rids, tokens) if pre]
        out = prefill(engine, first, force_eager=eager, release=False) if first else None
        chunks = [(rid, new) for rid, (_, new) in zip(rids, tokens)]
        return out, prefill(engine, chunks, force_eager=eager, release=False)
    finally:
        for rid in rids:
            engine.release(rid)


def run_cases(rep: Report, part: str, engine: Any, vocab: int, case_list: list[Case], tol: float,
              prefix: str) -> None:
    import torch
    for i, (name, requests) in enumerate(case_list):
        if rep.left() < (3 if rep.dry_run else 10):
            rep.cut(f"{prefix} padded/prefix cases {[c[0] for c in case_list[i:]]}")
            return
        gen = torch.Generator().manual_seed(1000 + i)
        tokens = [(torch.randint(0, vocab, (p,), generator=gen).tolist(),
                   torch.randint(0, vocab, (n,), generator=gen).tolist()) for p, n in requests]
        tag = f"{part}-pad{i}"
        g_first, g = _run_path(engine, tag, tokens, eager=False)
        _, e = _run_path(engine, tag, tokens, eager=True)
        label = f"{prefix} {name}"
        if g_first is not None:
            require_graph(rep, part, f"{label} (first chunk)", g_first.mode, g_first.eager_reason)
        real = max(g.per_rank_tokens) if g.per_rank_tokens else sum(n for _, n in requests)
        rep.check(part, f"graph vs eager logits {label}", "max rel err",
                  rel_err(g.logits, e.logits), tol, mode=g.mode, bucket=g.graph_bucket,
                  tokens_per_rank=real)
        require_graph(rep, part, label, g.mode, g.eager_reason)
        padded = g.graph_bucket is not None and g.graph_bucket > real
        rep.check(part, f"bucket padded {label}", "bucket filled exactly (1) / padded (0)",
                  float(not padded), 0.0, bucket=g.graph_bucket, tokens_per_rank=real)

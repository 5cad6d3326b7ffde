"""``graphcp bench`` on a DSA model: the per-rank indexer and sparse-attention work under
interleave.

Each rank scores the indexer for its own queries against every key they see, and attends each query
to at most ``index_topk`` of them; this counts both per rank (keys scored, keys attended) from the
layout, without running anything."""
from __future__ import annotations

from graphcp.cp import build_layout


def dsa_balance(cp: int, extend_lens: list[int], topk: int) -> dict:
    """Per rank: keys its queries score in the indexer and keys they attend; max/mean of each."""
    scored, attended = [], []
    for rank in range(cp):
        kv_lens = build_layout("interleave", cp, rank, extend_lens).kv_lens
        scored.append(sum(kv_lens))
        attended.append(sum(min(kv, topk) for kv in kv_lens))
    return {"indexer_keys_per_rank": scored, "sparse_keys_per_rank": attended,
            "indexer_max_over_mean": max(scored) * cp / max(1, sum(scored)),
            "sparse_max_over_mean": max(attended) * cp / max(1, sum(attended))}


def dsa_table(cases: list[tuple[int, int]], cp: int, topk: int) -> tuple[str, list[dict]]:
    rows = [{"case": f"{n}x{length}", **dsa_balance(cp, [length] * n, topk)} for n, length in cases]
    lines = ["", f"DSA work per rank under interleave at CP={cp} (index_topk {topk}): keys scored "
                 "by the indexer, keys attended",
             f"{'case':>7} {'indexer max/mean':>16} {'sparse max/mean':>15}  indexer keys per rank"]
    for r in rows:
        lines.append(f"{r['case']:>7} {r['indexer_max_over_mean']:>16.3f} "
                     f"{r['sparse_max_over_mean']:>15.3f}  {r['indexer_keys_per_rank']}")
    return "\n".join(lines), rows

"""``graphcp bench`` on a DSA or DeepSeek V4 model: the per-rank indexer and attention work under
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


def v4_balance(cp: int, extend_lens: list[int], v4) -> dict:
    """DeepSeek V4, per rank and summed over the layers: compressed entries its queries score in
    the CSA indexers, and keys they attend (the sliding window, plus the CSA top-k or every HCA
    entry whose window has closed); max/mean of each. Every rank also pools every window the batch
    closes (the same work on each rank), which is not counted here."""
    scored, attended = [], []
    for rank in range(cp):
        seen = build_layout("interleave", cp, rank, extend_lens).kv_lens    # position + 1 per query
        score = attend = 0
        for kind, rate in zip(v4.layer_types, v4.compress_rates):
            attend += sum(min(v4.sliding_window, n) for n in seen)
            entries = [n // rate for n in seen] if rate else []
            if kind.startswith("compressed_sparse"):
                score += sum(entries)
                attend += sum(min(e, v4.index_topk) for e in entries)
            else:
                attend += sum(entries)
        scored.append(score)
        attended.append(attend)
    return {"indexer_keys_per_rank": scored, "attended_keys_per_rank": attended,
            "indexer_max_over_mean": max(scored) * cp / max(1, sum(scored)),
            "attention_max_over_mean": max(attended) * cp / max(1, sum(attended))}


def v4_table(cases: list[tuple[int, int]], cp: int, v4) -> tuple[str, list[dict]]:
    rows = [{"case": f"{n}x{length}", **v4_balance(cp, [length] * n, v4)} for n, length in cases]
    lines = ["", f"DeepSeek V4 work per rank under interleave at CP={cp} (window "
                 f"{v4.sliding_window}, index_topk {v4.index_topk}): entries scored by the "
                 "indexers, keys attended",
             f"{'case':>7} {'indexer max/mean':>16} {'attention max/mean':>18}  "
             "attended keys per rank"]
    for r in rows:
        lines.append(f"{r['case']:>7} {r['indexer_max_over_mean']:>16.3f} "
                     f"{r['attention_max_over_mean']:>18.3f}  {r['attended_keys_per_rank']}")
    return "\n".join(lines), rows

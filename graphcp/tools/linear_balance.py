"""``graphcp bench`` for hybrid linear-attention models: each zigzag rank's share of the linear
layers' work and the bytes it receives per linear layer (graphcp/attention/linear_cp.py), from the
layout the engine uses (``build_layout``) and the exchange sizes the op's counters are tested against
(tests/models/test_hybrid_cp.py).

Each rank runs the conv and the delta rule over its own two blocks of every request only, from a zero
state with dk extra value columns that carry the block's transition (so a token costs (dv + dk) / dv
of a one-rank pass), then scans 2C small affine maps per request and head.
"""
from __future__ import annotations

import torch

from graphcp.attention.linear_cp import exchange_bytes
from graphcp.cp import build_layout
from graphcp.models.qwen3_next.config import HybridConfig


def linear_rows(cases: list[tuple[int, int]], cp: int, h: HybridConfig,
                dtype: torch.dtype) -> list[dict]:
    """Per case: tokens each rank runs through the linear layers, their share of the batch, the work
    against one rank running everything, and the bytes each rank receives per linear layer (``h``:
    the heads a rank holds, ``HybridConfig.per_rank`` under attention TP)."""
    dims = (h.conv_kernel, h.conv_dim, h.num_v_heads, h.head_k_dim, h.head_v_dim)
    conv_bytes = torch.empty((), dtype=dtype).element_size()
    widen = (h.head_v_dim + h.head_k_dim) / h.head_v_dim
    rows = []
    for n, length in cases:
        lens, total = [length] * n, n * length
        if cp == 1 or length < 2 * cp:      # the engine runs such a batch unsharded
            tokens, received = [total] * cp, 0
        else:
            tokens = [len(build_layout("zigzag", cp, r, lens).local_indices) for r in range(cp)]
            received = exchange_bytes(n, cp, dims, conv_bytes)
        share = [t / total for t in tokens]
        work = [s * (widen if received else 1.0) for s in share]
        rows.append({"case": f"{n}x{length}", "cp": cp, "tokens_per_rank": tokens,
                     "share_per_rank": share, "work_vs_one_rank": work,
                     "bytes_per_layer_per_rank": received, "linear_layers": len(h.linear_layers)})
    return rows


def linear_table(cases: list[tuple[int, int]], cp: int, h: HybridConfig,
                 dtype: torch.dtype) -> tuple[str, list[dict]]:
    rows = linear_rows(cases, cp, h, dtype)
    layers = len(h.linear_layers)
    lines = ["", f"linear-attention layers ({layers}) at zigzag CP={cp}, per rank: the tokens it runs "
                 "(max share of the batch),",
             "its work vs one rank running all (x (dv + dk) / dv per token for the block maps), and the",
             "KiB it receives per linear layer (conv halo + block maps; 0: the batch runs unsharded)",
             f"{'case':>7} {'tokens per rank':<24} {'max share':>9} {'max work':>8} {'KiB/layer':>10}"]
    for r in rows:
        tokens = " ".join(str(t) for t in r["tokens_per_rank"])
        lines.append(f"{r['case']:>7} {tokens:<24} {max(r['share_per_rank']):>9.3f} "
                     f"{max(r['work_vs_one_rank']):>8.3f} {r['bytes_per_layer_per_rank'] / 1024:>10.1f}")
    return "\n".join(lines), rows

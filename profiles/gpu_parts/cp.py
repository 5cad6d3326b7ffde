"""Part d: CP=2 zigzag as two rank processes sharing the device (gloo), graph mode, against the CP=1
logits of part c (computed here when part c did not run), and padded buckets and cached prefixes
graph vs eager at CP 2."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import graph_cases
from .common import checkpoint, engine_args, prefill, rel_err, require_graph, time_prefill
from .model import BUCKETS, CP1_LOGITS, DRY_BUCKETS, record_engine, shape_batch

if TYPE_CHECKING:
    from .report import Report

TITLE = "CP=2 zigzag on one device vs CP=1"
# CP-local tokens: 8x128 and 1x2048 fill 512 and 1024; the padded cases replay 128 and 512.
CP2_BUCKETS = (128, 512, 1024)


def _cp1_logits(rep: Report, path: str, vocab: int, names: list[str], workdir: str) -> dict:
    import torch

    from graphcp import Engine
    saved = os.path.join(workdir, CP1_LOGITS)
    cp1 = torch.load(saved) if os.path.exists(saved) else {}
    missing = [s for s in names if s not in cp1]
    if missing:                                       # part c did not run (or stopped early)
        with Engine(engine_args(rep, path, DRY_BUCKETS if rep.dry_run else BUCKETS)) as ref:
            for shape in missing:
                cp1[shape] = prefill(ref, shape_batch(vocab, rep.dry_run, shape)).logits
    return cp1


def run(rep: Report, workdir: str) -> str:
    from graphcp import Engine
    from graphcp.checkpoint.config import read_model_config
    path = checkpoint(rep, workdir)
    vocab = read_model_config(path).vocab_size
    names = ["1x16", "2x24"] if rep.dry_run else ["8x128", "1x2048"]
    cp1 = _cp1_logits(rep, path, vocab, names, workdir)
    cp_kw = dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag")
    tol = 1e-4 if rep.dry_run else 5e-2
    notes = []
    buckets = DRY_BUCKETS if rep.dry_run else CP2_BUCKETS
    with Engine(engine_args(rep, path, buckets, **cp_kw)) as engine:
        record_engine(rep, "d", engine.stats())
        for i, shape in enumerate(names):
            if rep.left() < (5 if rep.dry_run else 15):
                rep.cut(f"CP=2 shapes {names[i:]}")
                break
            batch = shape_batch(vocab, rep.dry_run, shape)
            out = prefill(engine, batch)
            err = rel_err(out.logits, cp1[shape])
            rep.check("d", f"CP=2 zigzag vs CP=1 logits {shape}", "max rel err", err, tol,
                      mode=out.mode, bucket=out.graph_bucket)
            require_graph(rep, "d", shape, out.mode, out.eager_reason)
            row = {"shape": shape, "mode": out.mode, "bucket": out.graph_bucket, "rel_err": err,
                   "per_rank_tokens": out.per_rank_tokens, "eager_reason": out.eager_reason}
            reps = 1 if rep.dry_run else 3
            row["eager_ms"] = time_prefill(engine, batch, True, reps)
            row["graph_ms"] = time_prefill(engine, batch, False, reps)
            rep.cp.append(row)
            if out.mode != "graph":
                notes.append(f"{shape} ran {out.mode}: {out.eager_reason}")
        graph_cases.run_cases(rep, "d", engine, vocab, graph_cases.cases(rep.dry_run, 2),
                              1e-4 if rep.dry_run else 2e-2, "CP2")
    return "; ".join(notes)

"""Host-side preparation per batch, measured without ranks: validation and planning (DP groups, page
check, layout, bucket) and the descriptor fill, the work a rank does on the host before each forward.
Page allocation (the transaction that follows a plan) is timed and reported on its own."""
from __future__ import annotations

import statistics
import time

import torch

from graphcp.batch import Request
from graphcp.cp.strategy import make_strategy
from graphcp.forward_batch import Descriptors
from graphcp.kv.pages import pages_per_request
from graphcp.planner import Planner


def measure_host_prep(requests: int = 32, length: int = 1024, cp: int = 8, reps: int = 50,
                      vocab: int = 32000, page_size: int = 16) -> dict:
    """Median microseconds per batch of ``requests`` x ``length`` new tokens at CP ``cp`` (zigzag), for
    ids given as tensors (the serving path) and as Python lists."""
    strategy = make_strategy("zigzag", cp)
    pages = requests * (-(-length // page_size)) + 1
    buckets = [strategy.aligned(b) for b in (256, 512, 1024, 2048, 4096, 8192)]
    staging = Descriptors.allocate(requests, pages_per_request(length, page_size), cp * max(buckets))
    # validation writes the ids into the graphs' staging, as the runner wires it
    planner = Planner(strategy, cp, 1, 0, vocab, pages + 1, page_size, length, requests,
                      ids_buffer=staging.input_ids)
    ids = [torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(i)) for i in range(requests)]
    out = {"case": f"{requests}x{length} at CP {cp}"}
    for kind, batch in (("tensor", [Request(f"r{i}", t) for i, t in enumerate(ids)]),
                        ("list", [Request(f"r{i}", t.tolist()) for i, t in enumerate(ids)])):
        plan_us, alloc_us, fill_us = [], [], []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            plan = planner.plan(batch, buckets=buckets)
            t1 = time.perf_counter()
            txn = planner.allocate(plan)
            t2 = time.perf_counter()
            host = plan.layout.host
            staging.set(plan.inputs(planner.pages.rows(plan.rids)), staging=True)
            t3 = time.perf_counter()
            planner.rollback(txn)
            plan_us.append((t1 - t0) * 1e6)
            alloc_us.append((t2 - t1) * 1e6)
            fill_us.append((t3 - t2) * 1e6)
            assert host.max_kv == length and plan.bucket is not None
        plan_med, fill_med = statistics.median(plan_us[2:]), statistics.median(fill_us[2:])
        out[kind] = {"plan_us": round(plan_med, 1), "fill_us": round(fill_med, 1),
                     "total_us": round(plan_med + fill_med, 1),
                     "allocate_us": round(statistics.median(alloc_us[2:]), 1)}
    out["host_prep_us"] = out["tensor"]["total_us"]
    return out


__all__ = ["measure_host_prep"]

"""Part f: capture on a dirty pool. A large block is filled with a non-zero pattern and freed (CUDA
does not zero reused memory), then an engine with the torch attention kernel, whose graph break
reads lengths on the host that the captured segment computed, captures its buckets. Before each
replay every byte of the graphs' pool (CUDA: its segments in the allocator's snapshot; CPU: the
replay arena) is set to 0xFF (NaN in every float dtype), and read back to prove it: between replays
the pool holds only dead intermediates, so a graph that reads one before writing it (a stale break
input) gives NaN. Every batch must replay as a graph and equal eager. Stale break inputs would show
here first, so this part runs first, in a fresh process."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .common import prefill, rel_err, require_graph

if TYPE_CHECKING:
    from .report import Report

TITLE = "capture on a dirty pool (torch kernel: host-reading breaks)"


def _dirty_device_memory() -> int:
    import torch
    free = torch.cuda.mem_get_info()[0]
    block = torch.empty(min(free // 4, 16 << 30), dtype=torch.uint8, device="cuda").fill_(0x7F)
    size = block.numel()
    del block
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return size


def dirty_graph_pool(graphs) -> tuple[int, int]:
    """Set every byte of the graph runner's pool to 0xFF; (bytes set, bytes that did not read back
    as 0xFF)."""
    import torch

    from graphcp.graph.cpu_pool import CpuPool
    if isinstance(graphs.pool, CpuPool):
        blocks = [graphs.pool.arena]
    else:           # the pool's segments (a pool that failed a capture was replaced: the last one)
        blocks, pool = [], tuple(graphs.pool)
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", ())) != pool:
                continue
            dev, size = torch.device("cuda", seg["device"]), seg["total_size"]
            memory = torch._C._construct_storage_from_data_pointer(seg["address"], dev, size)
            blocks.append(torch.empty(0, dtype=torch.uint8, device=dev).set_(memory, 0, (size,),
                                                                            (1,)))
    total = clean = 0
    with torch.inference_mode():          # the CPU arena was made under it
        for block in blocks:
            block.fill_(0xFF)
            total += block.numel()
            clean += int((block != 0xFF).sum())
    return total, clean


def run(rep: Report, workdir: str) -> str:
    from graphcp import Engine, EngineArgs
    from graphcp.checkpoint.config import read_model_config
    from graphcp.checkpoint.random import DEMO_QWEN3, make_random_checkpoint
    path = make_random_checkpoint(os.path.join(workdir, "demo-qwen3"), DEMO_QWEN3, seed=0)
    dirty = 0 if rep.dry_run else _dirty_device_memory()
    if rep.dry_run:
        kw = dict(device="cpu", max_total_tokens=4096, cuda_graph_buckets=(16, 64))
        shapes = [(1, 12), (2, 24)]
    else:
        kw = dict(device="cuda", max_total_tokens=65536, cuda_graph_buckets=(16, 64, 128))
        shapes = [(1, 12), (2, 40), (4, 30)]
    vocab = read_model_config(path).vocab_size
    tol = 1e-4 if rep.dry_run else 2e-2
    with Engine(EngineArgs(model_path=path, attention_kernel="torch", **kw)) as engine:
        stats = engine.stats()
        failures = stats["capture_failures"]
        rep.capture += [{"part": "f", **r} for r in stats.get("capture_records", [])]
        for i, (n, length) in enumerate(shapes):
            batch = [(f"f{i}-{j}", [(7 * j + 3 * t + i) % vocab for t in range(length)])
                     for j in range(n)]
            pool_bytes, clean = dirty_graph_pool(engine._runner.graphs)
            rep.check("f", f"graph pool dirtied before replay {n}x{length}", "bytes not 0xFF "
                      "(or no pool: 1)", float(clean if pool_bytes else 1), 0.0,
                      pool_bytes=pool_bytes)
            g = prefill(engine, batch)
            e = prefill(engine, batch, force_eager=True)
            shape = f"{n}x{length}"
            rep.check("f", f"dirty pool, torch kernel: graph vs eager {shape}", "max rel err",
                      rel_err(g.logits, e.logits), tol, mode=g.mode, bucket=g.graph_bucket)
            require_graph(rep, "f", shape, g.mode, g.eager_reason)
    rep.info["dirty_pool"] = {"dirty_bytes": dirty,
                              "capture_failures": {str(k): v for k, v in failures.items()}}
    return f"{dirty / 2**30:.1f} GiB dirtied; capture failures: {failures or 'none'}"

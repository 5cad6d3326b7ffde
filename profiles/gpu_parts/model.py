"""Part c: a ~1B random Llama checkpoint made locally: graph replay vs eager logits and prefill
latency at 1x256, 8x128, 1x2048, 1x8192, padded buckets and cached prefixes graph vs eager, and HF
transformers (sdpa) on the same weights and shapes. The CP=1 logits go to the workdir for part d."""
from __future__ import annotations

import importlib.util
import os
import statistics
import time
from typing import TYPE_CHECKING

from . import graph_cases
from .common import (
    checkpoint,
    cuda,
    device_of,
    engine_args,
    prefill,
    random_batch,
    rel_err,
    require_graph,
    time_prefill,
)

if TYPE_CHECKING:
    from .report import Report

TITLE = "1B Llama (demo-size Qwen3 on a dry run): graph vs eager vs HF"
BUCKETS = (256, 1024, 2048, 8192)
DRY_BUCKETS = (16, 32, 64)
CP1_LOGITS = "cp1_logits.pt"


def shapes(dry_run: bool) -> list[tuple[str, int, int]]:
    if dry_run:
        return [("1x16", 1, 16), ("2x24", 2, 24)]
    return [("1x256", 1, 256), ("8x128", 8, 128), ("1x2048", 1, 2048), ("1x8192", 1, 8192)]


def shape_batch(vocab: int, dry_run: bool, shape: str) -> list[tuple[str, list[int]]]:
    """The batch of a named shape: the same tokens in parts c and d."""
    names = [s[0] for s in shapes(dry_run)]
    i = names.index(shape)
    _, n, length = shapes(dry_run)[i]
    return random_batch(vocab, n, length, f"c{i}", seed=i)


def record_engine(rep: Report, part: str, stats: dict) -> None:
    """What the engine says about its graphs: buckets, kernel, failures, per-bucket capture cost."""
    rep.info[f"{part}_graph_buckets"] = stats["graph_buckets"]
    rep.info[f"{part}_capture_failures"] = stats["capture_failures"]
    rep.info.setdefault("attention_kernel", stats["attention_kernel"])
    engine = {"c": "part c's model, CP 1", "d": "part c's model, CP 2 zigzag"}.get(part, part)
    rep.kernel_choices.append({"part": part, "engine": engine,
                               "attention": stats["attention_kernel"],
                               "ops": stats.get("kernel_choices", {}),
                               "capture_failures": stats["capture_failures"]})
    for rec in stats.get("capture_records", []):
        rep.capture.append({"part": part, **rec})
    if cuda() and not rep.dry_run:
        import torch

        from graphcp.profiling import gpu_memory_used
        used = gpu_memory_used(torch.device("cuda", torch.cuda.current_device()))
        rep.info[f"{part}_device_memory_used_bytes"] = used     # device-wide (NVML): all ranks


def run(rep: Report, workdir: str) -> str:
    import torch

    from graphcp import Engine
    from graphcp.checkpoint.config import read_model_config
    path = checkpoint(rep, workdir)
    vocab = read_model_config(path).vocab_size
    reps = 1 if rep.dry_run else 5          # a dry run's latencies mean nothing: time it once
    tol = 1e-4 if rep.dry_run else 2e-2     # bf16: padded GEMM shapes may pick other cuBLAS tilings
    cp1, eager_logits = {}, {}
    t = time.monotonic()
    with Engine(engine_args(rep, path, DRY_BUCKETS if rep.dry_run else BUCKETS)) as engine:
        rep.info["engine_start_s"] = round(time.monotonic() - t, 1)
        record_engine(rep, "c", engine.stats())
        todo = shapes(rep.dry_run)
        for i, (shape, _, _) in enumerate(todo):
            if rep.left() < (5 if rep.dry_run else 25):
                rep.cut(f"timing shapes {[s[0] for s in todo[i:]]}")
                break
            batch = shape_batch(vocab, rep.dry_run, shape)
            g = prefill(engine, batch)
            e = prefill(engine, batch, force_eager=True)
            cp1[shape], eager_logits[shape] = g.logits, e.logits
            rep.check("c", f"graph vs eager logits {shape}", "max rel err",
                      rel_err(g.logits, e.logits), tol, mode=g.mode, bucket=g.graph_bucket)
            require_graph(rep, "c", shape, g.mode, g.eager_reason)
            row = {"shape": shape, "mode": g.mode, "bucket": g.graph_bucket,
                   "eager_reason": g.eager_reason}
            row["eager_ms"] = time_prefill(engine, batch, True, reps)
            row["graph_ms"] = time_prefill(engine, batch, False, reps)
            row["graph_speedup"] = row["eager_ms"] / row["graph_ms"]
            rep.timings.append(row)
            print(f"   {shape}: eager {row['eager_ms']:.2f} ms, graph {row['graph_ms']:.2f} ms "
                  f"({row['graph_speedup']:.2f}x), mode {g.mode} bucket {g.graph_bucket}",
                  flush=True)
        torch.save(cp1, os.path.join(workdir, CP1_LOGITS))
        cases = graph_cases.cases(rep.dry_run, 1)
        graph_cases.run_cases(rep, "c", engine, vocab, cases, tol, "CP1")
    if cuda() and not rep.dry_run:
        torch.cuda.empty_cache()
    return _hf(rep, path, vocab, reps, eager_logits)


def _hf(rep: Report, path: str, vocab: int, reps: int, eager_logits: dict) -> str:
    """HF transformers on the same weights: speed next to graphcp eager, and the logits against it.
    """
    import torch
    if importlib.util.find_spec("transformers") is None:
        return "HF not compared: transformers is not installed"
    if rep.left() < (10 if rep.dry_run else 30):
        rep.cut("the HF comparison")
        return ""
    import transformers
    rep.info["transformers"] = transformers.__version__
    device = device_of(rep)
    dtype = torch.float32 if rep.dry_run else torch.bfloat16
    auto = transformers.AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except TypeError:                                   # transformers < 4.56 spells it torch_dtype
        model = auto.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()

    @torch.inference_mode()
    def forward(ids: torch.Tensor) -> torch.Tensor:
        try:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        except TypeError:
            logits = model(input_ids=ids, use_cache=False).logits
        return logits[:, -1].float().cpu()      # the hand-off of engine.prefill: fp32 on host

    for shape, _, _ in shapes(rep.dry_run):
        row = next((r for r in rep.timings if r["shape"] == shape), None)
        if row is None:
            continue
        if rep.left() < (3 if rep.dry_run else 10):
            rep.cut(f"HF at {shape}")
            continue
        batch = shape_batch(vocab, rep.dry_run, shape)
        ids = torch.tensor([ids for _, ids in batch], device=device)   # equal lengths: no padding
        logits = forward(ids)
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            forward(ids)
            times.append((time.perf_counter() - t) * 1e3)
        row["hf_ms"] = statistics.median(times)
        row["eager_vs_hf"] = row["hf_ms"] / row["eager_ms"]
        note = "HF on the same weights" + ("" if rep.dry_run else "; bf16, different kernels")
        rep.check("c", f"graphcp eager vs HF logits {shape}", "max rel err",
                  rel_err(eager_logits[shape], logits), 1e-4 if rep.dry_run else 0.1, note=note)
        print(f"   {shape}: HF {row['hf_ms']:.2f} ms (graphcp eager is {row['eager_vs_hf']:.2f}x "
              "HF speed)", flush=True)
    return ""

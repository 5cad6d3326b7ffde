"""Part h: one tiny engine per family, through the engine as served (graphs, CP, EP, FP8, the
kernels the engine picks), against its fp32 reference: the same checkpoint (FP8: its dequantized
float32 twin) run by graphcp's torch forms, eagerly, on one CPU rank, in float32 (the forms the CPU
suite holds to HF transformers at 1e-4).

Logits are compared row by row, each against its own largest value (``row_rel_err``): one request
whose far keys are read wrongly moves only its own row, which a tolerance on the whole batch (or an
absolute one) hides behind a larger row. The kernel each op chose is recorded (``kernel_choices``),
with the reason wherever the torch form stands in for a Triton one.

The checkpoints are made by transformers (tests/testkit): without it the part is INCOMPLETE.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .common import SkipPart, device_of

if TYPE_CHECKING:
    import torch

    from .report import Report

TITLE = "tiny engine per family (MLA, DSA, V4, Qwen3-Next, MoE+EP, FP8) vs fp32, per row"
CP2 = dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True)
VOCAB = 211


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[str], tuple[str, str]]     # workdir -> (checkpoint, its fp32 reference)
    engine: dict = field(default_factory=dict)  # the case's engine arguments
    graph: bool = True                          # False: the configuration runs eagerly by design


def _testkit() -> None:
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(1, tests)
    if importlib.util.find_spec("transformers") is None:
        raise SkipPart("transformers is not installed: the family checkpoints are made by it")


def _once(path: str, make: Callable[[], Any]) -> None:
    if not os.path.exists(os.path.join(path, "config.json")):
        make()


def _mla(workdir: str) -> tuple[str, str]:
    from testkit.mla_checkpoint import DEEPSEEK_V3, write_release
    root = os.path.join(workdir, "fam-mla")
    if not os.path.exists(os.path.join(root, "release", "config.json")):
        write_release(root, DEEPSEEK_V3, seed=41, fp8=False, num_hidden_layers=2,
                      first_k_dense_replace=1, n_routed_experts=16, num_nextn_predict_layers=0)
    return os.path.join(root, "release"), os.path.join(root, "oracle")


def _dsa(workdir: str) -> tuple[str, str]:
    from testkit.dsa_checkpoint import make_dsa_checkpoint
    path = os.path.join(workdir, "fam-dsa")
    _once(path, lambda: make_dsa_checkpoint(path, "DeepseekV32", seed=3, n_group=1, topk_group=1))
    return path, path


def _v4(workdir: str) -> tuple[str, str]:
    from testkit.deepseek_v4_reference import make_v4_checkpoint
    path = os.path.join(workdir, "fam-v4")
    _once(path, lambda: make_v4_checkpoint(path))
    return path, path


def _qwen3_next(workdir: str) -> tuple[str, str]:
    from testkit.hybrid_reference import make_hybrid_checkpoint
    path = os.path.join(workdir, "fam-qwen3-next")
    _once(path, lambda: make_hybrid_checkpoint(path, "qwen3_next", seed=2))
    return path, path


def _moe_src(workdir: str) -> str:
    from testkit.hf_reference import make_checkpoint
    path = os.path.join(workdir, "fam-moe")
    _once(path, lambda: make_checkpoint(path, "qwen3_moe", seed=13, hidden_size=72,
                                        num_hidden_layers=3, intermediate_size=200,
                                        moe_intermediate_size=40, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[1], vocab_size=VOCAB))
    return path


def _moe(workdir: str) -> tuple[str, str]:
    path = _moe_src(workdir)
    return path, path


def _fp8(src: Callable[[str], str], tag: str) -> Callable[[str], tuple[str, str]]:
    def make(workdir: str) -> tuple[str, str]:
        from testkit.fp8_checkpoint import make_fp8_checkpoint
        path, twin = (os.path.join(workdir, f"fam-{tag}{s}") for s in ("", "-fp32"))
        _once(path, lambda: make_fp8_checkpoint(src(workdir), path, twin, (16, 32),
                                                ("lm_head", "model.layers.1.mlp.down_proj")))
        return path, twin
    return make


def _dense_src(workdir: str) -> str:
    from testkit.hf_reference import make_checkpoint
    path = os.path.join(workdir, "fam-dense")
    _once(path, lambda: make_checkpoint(path, "qwen3", seed=5, hidden_size=72,
                                        intermediate_size=200, vocab_size=VOCAB))
    return path


FAMILIES = (
    Family("MLA (DeepSeek-V3) CP 2 zigzag, graphs", _mla, dict(CP2, cp_strategy="zigzag")),
    Family("DSA (DeepSeek-V3.2) CP 2 interleave", _dsa, dict(CP2, cp_strategy="interleave"),
           graph=False),
    Family("DeepSeek V4 (CSA, sliding, HCA; hash MoE)", _v4, graph=False),   # eager by design
    Family("Qwen3-Next (Gated DeltaNet + attention)", _qwen3_next),
    Family("Qwen3-MoE TP 2 EP 2", _moe, dict(tp_size=2, ep_size=2)),
    Family("FP8 dense (block-quantized Qwen3)", _fp8(_dense_src, "fp8-dense")),
    Family("FP8 experts (block-quantized Qwen3-MoE)", _fp8(_moe_src, "fp8-moe")),
)


def row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst row's max |got - want| / max |want| (rows: requests' logits)."""
    got, want = got.float().reshape(got.shape[0], -1), want.float().reshape(want.shape[0], -1)
    err = (got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-12)
    return float(err.max())


def _batch(vocab: int) -> list[tuple[str, list[int]]]:
    import torch
    gen = torch.Generator().manual_seed(7)
    return [(f"h{i}", torch.randint(0, vocab, (n,), generator=gen).tolist())
            for i, n in enumerate((37, 61, 20))]


def _logits(args: Any, batch: list, force_eager: bool) -> tuple[torch.Tensor, dict, Any]:
    from graphcp import Engine

    from .common import prefill
    with Engine(args) as engine:
        stats = engine.stats()
        out = prefill(engine, batch, force_eager=force_eager)
    return out.logits.float().cpu(), stats, out


def run_family(rep: Report, fam: Family, workdir: str, tol: float) -> None:
    from graphcp import EngineArgs
    from graphcp.checkpoint.config import read_model_config
    t0 = time.monotonic()
    path, ref_path = fam.make(workdir)
    batch = _batch(read_model_config(path).vocab_size)
    ref_args = EngineArgs(model_path=ref_path, device="cpu", dtype="float32",
                          attention_kernel="torch", disable_cuda_graph=True, max_total_tokens=2048)
    want, _, _ = _logits(ref_args, batch, force_eager=True)
    dev = device_of(rep)
    args = EngineArgs(model_path=path, device=dev, max_total_tokens=4096 if dev == "cpu" else 65536,
                      cuda_graph_buckets=(64, 128), **fam.engine)
    got, stats, out = _logits(args, batch, force_eager=False)
    rep.check("h", f"{fam.name}: logits vs fp32 reference", "worst row rel err",
              row_rel_err(got, want), tol, mode=out.mode, bucket=out.graph_bucket,
              reason=out.eager_reason, seconds=round(time.monotonic() - t0, 1))
    if fam.graph:
        rep.check("h", f"{fam.name}: replayed as a graph", "not graph (1) / graph (0)",
                  float(out.mode != "graph"), 0.0, reason=out.eager_reason)
    rep.kernel_choices.append({"part": "h", "engine": fam.name,
                               "attention": stats["attention_kernel"],
                               "ops": stats.get("kernel_choices", {}),
                               "capture_failures": stats["capture_failures"]})


def run(rep: Report, workdir: str) -> str:
    _testkit()
    tol = 1e-4 if rep.dry_run else 3e-2        # bf16 activations against fp32, per row
    done = []
    for i, fam in enumerate(FAMILIES):
        if rep.left() < (20 if rep.dry_run else 12):
            rep.cut(f"families {[f.name for f in FAMILIES[i:]]}")
            break
        run_family(rep, fam, workdir, tol)
        done.append(fam.name.split(" ")[0])
    return f"{len(done)} of {len(FAMILIES)} families: {', '.join(done)}"

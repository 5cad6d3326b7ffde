"""FP8 block-quantized MoE experts: the same FP8 modules as transformers' FP8 integration converts
(experts yes, router no), each rank's experts and expert-TP slice dequantized exactly (slices that
start inside a block included), graphcp on the FP8 checkpoint equal to HF transformers on the
dequantized one (single rank, CP2 x EP2, CP2 with expert TP 2; graph and eager), and bad expert
scales refused before allocation."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.fp8_checkpoint import make_fp8_checkpoint
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, random_ids

from graphcp import ConfigError, Engine, EngineArgs
from graphcp.checkpoint import fp8, loader
from graphcp.checkpoint.config import read_model_config
from graphcp.checkpoint.loader import load_model
from graphcp.distributed.shards import EPInfo
from graphcp.kernels.fp8_types import FP8
from graphcp.models.common.moe import Experts
from graphcp.models.common.quantized import is_fp8
from graphcp.models.llama.model import LlamaForCausalLM

VOCAB = 211
# Blocks smaller than the model: expert gate/up [40, 72] and down [72, 40] end in partial blocks,
# and expert TP 2 splits the intermediate dim at 20, inside a row block (16) and a column block
# (32).
BLOCK = (16, 32)
# Layer 1 is dense; layer 2's experts stay unquantized (transformers converts experts as one
# module); Qwen's FP8 releases list routers too, which neither side converts anyway.
SKIP = ("lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.experts")
CP2 = {"attn_cp_size": 2, "enable_prefill_cp": True, "cp_strategy": "zigzag",
       "cuda_graph_buckets": [32, 64]}
FIRST = [("a", random_ids(37, VOCAB, 1)), ("b", random_ids(9, VOCAB, 2)),
         ("c", random_ids(20, VOCAB, 3))]
SECOND = [("b", random_ids(12, VOCAB, 4)), ("d", random_ids(30, VOCAB, 5))]


@pytest.fixture(scope="module")
def fp8_moe(ckpt_dir):
    src = make_checkpoint(str(ckpt_dir / "fp8-moe-src"), "qwen3_moe", seed=13, hidden_size=72,
                          num_hidden_layers=3, intermediate_size=200, moe_intermediate_size=40,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                          mlp_only_layers=[1])
    return make_fp8_checkpoint(
        src, str(ckpt_dir / "fp8-moe"), str(ckpt_dir / "fp8-moe-dequantized"), BLOCK, SKIP
    )


def _our_quantized(path: str) -> set[str]:
    """The checkpoint tensors graphcp's loader reads as FP8 (its two sources of names)."""
    cfg = read_model_config(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    names = set(fp8.quantized_names(model, cfg))
    for prefix, experts in model.named_modules():
        if isinstance(experts, Experts):
            tensors = experts.checkpoint_tensors(prefix, set(), cfg.hidden_size)
            names.update(fp8.quantized_expert_names(prefix, tensors, cfg))
    return names


def test_fp8_modules_as_transformers_converts(fp8_moe):
    """transformers' FP8 integration on the same config: every FP8Linear and FP8Experts it makes
    is FP8 for graphcp too, and nothing else (the routers stay unquantized)."""
    import transformers
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    hf_config = transformers.AutoConfig.from_pretrained(fp8_moe[0])
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_config)
    quant = transformers.FineGrainedFP8Config(weight_block_size=list(BLOCK),
                                              modules_to_not_convert=list(SKIP))
    replace_with_fp8_linear(hf, list(SKIP), quant, pre_quantized=True)
    want = set()
    for name, module in hf.named_modules():
        kind = type(module).__name__
        if kind == "FP8Linear":
            want.add(f"{name}.weight")
        elif "FP8Experts" in kind:
            want.update(f"{name}.{e}.{p}_proj.weight" for e in range(hf_config.num_experts)
                        for p in ("gate", "up", "down"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in want
    assert not any(".mlp.gate.weight" in n or "layers.2.mlp.experts" in n for n in want)
    assert _our_quantized(fp8_moe[0]) == want
    fp8_tensors = {n for n, t in load_file(os.path.join(fp8_moe[0], "model.safetensors")).items()
                   if t.dtype == FP8}
    assert fp8_tensors == want      # the tests' quantizer wrote exactly those


@pytest.mark.parametrize("ep", [EPInfo(2, 1, 1, 0), EPInfo(1, 0, 2, 1), EPInfo(2, 0, 2, 1)])
def test_expert_slices_dequantize_exactly(fp8_moe, ep):
    """Each rank's experts stay FP8 (the checkpoint's bytes of its slice), and each expert as the
    forward dequantizes it equals the same slice of the dequantized checkpoint, bitwise; the
    unquantized layer-2 experts load as they are. Expert-TP rank 1 holds intermediate
    rows/columns 20..39: 4 into a row block, 20 into a column block."""
    want = load_file(os.path.join(fp8_moe[1], "model.safetensors"))
    stored = load_file(os.path.join(fp8_moe[0], "model.safetensors"))
    per = 4 // ep.ep_size
    lo, hi = (0, 40) if ep.expert_tp_size == 1 else (20, 40)
    model = load_model(fp8_moe[0], torch.float32, torch.device("cpu"), ep=ep)
    assert is_fp8(model.model.layers["0"].self_attn.o_proj)
    for layer, quantized in (("0", True), ("2", False)):
        experts = model.model.layers[layer].mlp.experts
        assert experts.gate_up_proj.dtype == (FP8 if quantized else torch.float32)
        assert experts.gate_up_proj.shape == (per, 2 * (hi - lo), 72)
        for i in range(per):
            p = f"model.layers.{layer}.mlp.experts.{ep.ep_rank * per + i}"
            gate_up = torch.cat([want[f"{p}.gate_proj.weight"][lo:hi],
                                 want[f"{p}.up_proj.weight"][lo:hi]])
            got_gate_up, got_down = experts.expert_weights(i, torch.float32)
            assert torch.equal(got_gate_up, gate_up), p
            assert torch.equal(got_down, want[f"{p}.down_proj.weight"][:, lo:hi]), p
            if quantized:
                raw = torch.cat([stored[f"{p}.gate_proj.weight"][lo:hi],
                                 stored[f"{p}.up_proj.weight"][lo:hi]])
                assert torch.equal(experts.gate_up_proj[i].view(torch.uint8), raw.view(torch.uint8))
                assert experts.fp8[1].k_offset == lo % BLOCK[1]


def _parity(engine, oracle, path: str, full: bool) -> float:
    """FIRST in a graph; ``full``: then a chunked second prefill in a graph and a forced-eager one."""
    s = Session(engine, oracle, path)
    out = s.run(FIRST)
    assert out.mode == "graph", out.eager_reason
    assert out.cp_applied is (engine.args.attn_cp_size > 1)
    if full:
        assert s.run(SECOND).mode == "graph"                   # chunked "b" and a new rid
        out = s.run([("e", random_ids(16, VOCAB, 7)), ("f", random_ids(25, VOCAB, 8))],
                    force_eager=True)
        assert out.mode == "eager"
    s.release_all()
    return s.worst


@pytest.mark.parametrize("layout", ["single", "cp2_ep2", "cp2_expert_tp2"])
def test_fp8_moe_matches_hf_on_dequantized_weights(fp8_moe, engines, oracle, layout):
    """The expert-TP layout (every expert split at row/column 20) runs one batch: one bucket."""
    kwargs = {"single": {"cuda_graph_buckets": [32, 64, 128]},
              "cp2_ep2": {"tp_size": 2, "ep_size": 2, **CP2},
              "cp2_expert_tp2": {"tp_size": 2, "ep_size": 1, "moe_a2a_backend": "all_to_all",
                                 **CP2, "cuda_graph_buckets": [64]}}
    engine = engines.get(fp8_moe[0], **kwargs[layout])
    assert _parity(engine, oracle, fp8_moe[1], full=layout != "cp2_expert_tp2") <= 1e-4


@pytest.mark.parametrize(
    "damage,match",
    [
        ("missing_scale",
         "lacks 1 tensors.*'model.layers.0.mlp.experts.3.up_proj.weight_scale_inv'.*fp8 needs"),
        ("wrong_grid",
         "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv has shape \\[3, 2\\].*\\[3, 3\\]"),
        ("not_fp8", "model.layers.0.mlp.experts.3.up_proj.weight is BF16.*float8_e4m3fn"),
        ("fp8_router", "model.layers.0.mlp.gate.weight is F8_E4M3 but has no block scale"),
        ("skipped_expert_scale",
         "does not use.*'model.layers.2.mlp.experts.0.down_proj.weight_scale_inv'"),
        ("fused_fp8_experts",
         "does not use.*'model.layers.0.mlp.experts.(gate_up|down)_proj_scale_inv'"),
    ],
)
def test_bad_fp8_experts_refused_before_allocation(fp8_moe, tmp_path, monkeypatch, damage, match):
    d = shutil.copytree(fp8_moe[0], tmp_path / damage)
    path = os.path.join(d, "model.safetensors")
    weights = load_file(path)
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    if damage == "missing_scale":
        del weights[name + "_scale_inv"]
    elif damage == "wrong_grid":
        weights[name + "_scale_inv"] = weights[name + "_scale_inv"][:, :2].contiguous()
    elif damage == "not_fp8":
        weights[name] = weights[name].to(torch.bfloat16)
    elif damage == "fp8_router":
        router = "model.layers.0.mlp.gate.weight"
        weights[router] = weights[router].to(torch.float8_e4m3fn)
    elif damage == "skipped_expert_scale":
        weights["model.layers.2.mlp.experts.0.down_proj.weight_scale_inv"] = torch.ones(5, 2)
    elif damage == "fused_fp8_experts":     # transformers' FP8Experts layout: not read as FP8
        p = "model.layers.0.mlp.experts"
        for proj, rows in (("gate_up", ("gate", "up")), ("down", ("down",))):
            per_expert = [torch.cat([weights.pop(f"{p}.{e}.{r}_proj.weight") for r in rows])
                          for e in range(4)]
            for e in range(4):
                for r in rows:
                    del weights[f"{p}.{e}.{r}_proj.weight_scale_inv"]
            weights[f"{p}.{proj}_proj"] = torch.stack(per_expert)
            weights[f"{p}.{proj}_proj_scale_inv"] = torch.ones(4, 5, 3 if proj == "gate_up" else 2)
    save_file(weights, path)

    def no_allocation(*args, **kwargs):
        raise AssertionError("weights were allocated before the checkpoint was validated")

    monkeypatch.setattr(loader, "_materialize", no_allocation)
    with pytest.raises(ConfigError, match=match):
        Engine(EngineArgs(model_path=str(d), max_total_tokens=1024, disable_cuda_graph=True))

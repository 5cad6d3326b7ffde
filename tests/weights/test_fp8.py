"""FP8 block-quantized checkpoints: graphcp on the FP8 checkpoint equals HF transformers on the
exactly dequantized weights (single rank and CP2 with the FFN over TP 2, graph and eager), TP shards
that start inside a block dequantize exactly, the block-scaled Triton GEMM (interpreter) matches its
torch form and the dequantized product within FP8 rounding, and bad FP8 input is refused before
allocation."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.engines import cp_kwargs
from testkit.fp8_checkpoint import make_fp8_checkpoint, quantize_blocks
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, random_ids

from graphcp import ConfigError, Engine, EngineArgs
from graphcp.checkpoint import loader
from graphcp.checkpoint.config import read_model_config
from graphcp.checkpoint.loader import load_model
from graphcp.distributed.shards import TPInfo
from graphcp.kernels.fp8_torch import dequantize_weight, fp8_linear_torch
from graphcp.kernels.fp8_types import FP8, Fp8Weight
from graphcp.models.common.quantized import is_fp8
from graphcp.models.llama.model import LlamaForCausalLM

VOCAB = 211
# Blocks smaller than the tiny model, so edge blocks are partial (hidden 72, o_proj rows 72) and
# the FFN's TP shards (intermediate 200 over 2 ranks: rows/columns 100..199) start inside a block.
BLOCK = (16, 32)
SKIP = ("lm_head", "model.layers.1.mlp.down_proj")


@pytest.fixture(scope="session")
def fp8_ckpt(ckpt_dir):
    src = make_checkpoint(
        str(ckpt_dir / "fp8-src"), "qwen3", seed=5, hidden_size=72, intermediate_size=200
    )
    return make_fp8_checkpoint(
        src, str(ckpt_dir / "fp8"), str(ckpt_dir / "fp8-dequantized"), BLOCK, SKIP
    )


def test_config_reads_fp8_and_refuses_other_methods(fp8_ckpt, tmp_path):
    cfg = read_model_config(fp8_ckpt[0])
    assert cfg.fp8_block == BLOCK and cfg.fp8_skip == SKIP
    assert read_model_config(fp8_ckpt[1]).fp8_block is None
    bad = [({"quant_method": m}, m) for m in ("awq", "gptq", "compressed-tensors", "bitsandbytes")]
    bad += [
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "static",
        ),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e5m2"}, "scale_fmt"),
    ]
    for quant, match in bad:
        d = tmp_path / match
        shutil.copytree(fp8_ckpt[1], d)
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
        with pytest.raises(ConfigError, match=f"--model-path.*{match}"):
            read_model_config(str(d))


def _rank_shards(model: LlamaForCausalLM) -> dict[str, tuple]:
    return {f"{n}.weight": m.shard for n, m in model.named_modules() if hasattr(m, "shard")}


@pytest.mark.parametrize("rank", [0, 1])
def test_unaligned_tp_shards_dequantize_exactly(fp8_ckpt, rank):
    """Attention over TP 2 and the FFN over TP 2: every projection stays FP8 in memory on CPU, and
    its weight as the forward dequantizes it equals the same slice of the exactly dequantized
    checkpoint, bitwise, including the FFN slices that start 4 rows/columns into a block."""
    tp = TPInfo(2, rank)
    model = load_model(fp8_ckpt[0], torch.float32, torch.device("cpu"), tp, ffn_tp=tp)
    want = load_file(os.path.join(fp8_ckpt[1], "model.safetensors"))
    shards = _rank_shards(model)
    assert shards["model.layers.0.mlp.gate_proj.weight"] == (0, 100 * rank, 100 * rank + 100)
    assert shards["model.layers.0.mlp.down_proj.weight"] == (1, 100 * rank, 100 * rank + 100)
    modules = dict(model.named_modules())
    held = 0
    for name, got in model.state_dict().items():
        if name.endswith("_scale_inv"):
            continue
        ref = want[model.source_name(name)]
        if name in shards:
            dim, start, end = shards[name]
            ref = ref[start:end] if dim == 0 else ref[:, start:end]
        module = modules[name.rsplit(".", 1)[0]]
        if got.dtype == FP8:
            held += 1
            got = dequantize_weight(module.fp8, torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, ref), name
    assert held == 2 * 7 - 1      # every projection but the one modules_to_not_convert names


def _fp8_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, what per-token-group FP8 rounding of the activations may cost: each element moves
    by at most 2^-4 of itself (3 mantissa bits, round to nearest) or, below the normal range, by
    half the subnormal step, 2^-10 of its group's scale (<= max|x| / 448); plus fp32 summation
    slack."""
    elem = x.abs() * 2.0**-4 + 2.0**-10 * x.abs().max() / 448.0
    return elem @ w.abs().t() + 1e-5 * (x @ w.t()).abs().max()


def _check_gemm(
    x: torch.Tensor, w: Fp8Weight, dense: torch.Tensor, bias: torch.Tensor | None
) -> float:
    from graphcp.kernels.triton_fp8_gemm import triton_fp8_linear

    got = triton_fp8_linear(x, w, bias)
    torch_form = fp8_linear_torch(x, w, bias)
    assert float((got - torch_form).abs().max() / torch_form.abs().max()) <= 1e-5
    exact = x @ dense.t() + (0 if bias is None else bias)
    err = (got - exact).abs()
    assert (err <= _fp8_error_bound(x, dense)).all()
    return float(err.max() / exact.abs().max())


def test_triton_gemm_partial_blocks_and_offsets():
    """The real 128x128 blocks: N=192 (a partial row block), K=256 read from a column shard that
    starts 80 into a block (partial K blocks at both ends), M from 5 to 70 (every row tile of
    ``gemm_tiles``: 16, 32, 64, 128); and small blocks with a partial K block."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k, offset, block in (
        (5, 192, 256, 0, (128, 128)),
        (33, 192, 256, 80, (128, 128)),
        (70, 192, 256, 80, (128, 128)),
        (17, 96, 200, 4, (16, 32)),
    ):
        whole = torch.randn(n, k + offset, generator=gen)
        q, scale = quantize_blocks(whole, block)
        cols = (torch.arange(k) + offset) // block[1]
        dense = q[:, offset:].float() * scale.repeat_interleave(block[0], 0)[:n][:, cols]
        w = Fp8Weight(
            q[:, offset:].contiguous(),
            scale,
            (torch.arange(n) // block[0]).to(torch.int32),
            offset,
            block,
        )
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        x[0] = 0.0  # an all-zero (padding) row stays finite
        err = _check_gemm(x, w, dense, torch.randn(n, generator=gen) if m > 5 else None)
        assert 0 < err < 0.1


def test_kept_fp8_weights_and_gemm_at_unaligned_shards(fp8_ckpt):
    """FP8 weights and scale slices in the state dict (what weight_bytes counts): the checkpoint's
    own bytes for each rank's slice; q/k/v and gate/up fused with their scale rows, back to back
    (no copy at fusion); and the Triton GEMM (interpreter) on each rank's slice against the
    dequantized slice."""
    want = load_file(os.path.join(fp8_ckpt[1], "model.safetensors"))
    stored = load_file(os.path.join(fp8_ckpt[0], "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 72, generator=gen)
    for rank in (0, 1):
        tp = TPInfo(2, rank)
        kept = load_model(fp8_ckpt[0], torch.float32, torch.device("cpu"), tp, ffn_tp=tp)
        sd = kept.state_dict()
        quantized = [n for n, t in sd.items() if t.dtype == FP8]
        assert (
            len(quantized) == 2 * 7 - 1 and "model.layers.1.mlp.down_proj.weight" not in quantized
        )
        shards = _rank_shards(kept)
        for name in quantized:      # the checkpoint's bytes of the slice, as stored
            assert torch.equal(sd[name].view(torch.uint8),
                               _slice(stored[name], shards[name]).view(torch.uint8)), name
        for i in (0, 1):
            layer, p = kept.model.layers[str(i)], f"model.layers.{i}."
            qkv, gate_up = layer.self_attn.qkv[0], layer.mlp.gate_up[0]
            assert qkv.weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
            assert gate_up.scale.data_ptr() == layer.mlp.gate_proj.weight_scale_inv.data_ptr()
            fused = {
                "self_attn.qkv": (qkv, x, ("q_proj", "k_proj", "v_proj")),
                "mlp.gate_up": (gate_up, x, ("gate_proj", "up_proj")),
            }
            o_in = torch.randn(5, 128 // 2, generator=gen)  # attention TP 2: half the heads
            cases = [*fused.values(), (layer.self_attn.o_proj.fp8, o_in, ("o_proj",))]
            if i == 0:
                assert layer.mlp.down_proj.fp8.k_offset == (100 * rank) % BLOCK[1]
                cases.append(
                    (layer.mlp.down_proj.fp8, torch.randn(7, 100, generator=gen), ("down_proj",))
                )
            else:  # modules_to_not_convert: loaded as it is
                assert not is_fp8(layer.mlp.down_proj)
            for w, inp, names in cases:
                kind = "self_attn" if names[0] in ("q_proj", "o_proj") else "mlp"
                full = [f"{p}{kind}.{n}.weight" for n in names]
                _check_gemm(inp, w, torch.cat([_slice(want[n], shards[n]) for n in full]), None)


def _slice(tensor: torch.Tensor, shard: tuple[int, int, int]) -> torch.Tensor:
    dim, start, end = shard
    return tensor[start:end] if dim == 0 else tensor[:, start:end]


def _parity(engine, oracle, path: str, cp: int) -> float:
    s = Session(engine, oracle, path)
    out = s.run([("a", random_ids(37, VOCAB, 1)), ("b", random_ids(20, VOCAB, 2))])
    assert out.mode == "graph", out.eager_reason
    assert out.cp_applied is (cp > 1)
    out = s.run(
        [("a", random_ids(11, VOCAB, 3)), ("c", random_ids(25, VOCAB, 4))], force_eager=True
    )
    assert out.mode == "eager"
    s.release_all()
    return s.worst


@pytest.mark.parametrize("cp", [1, 2])
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(fp8_ckpt, engines, oracle, cp):
    """CP2 zigzag with --tp 2: the FFN splits over TP 2 (the default), rows 100..199 on rank 1."""
    engine = engines.get(fp8_ckpt[0], **cp_kwargs(cp))
    assert _parity(engine, oracle, fp8_ckpt[1], cp) <= 1e-4


@pytest.mark.parametrize(
    "damage,match",
    [
        ("missing_scale", "lacks 1 tensors.*'model.layers.0.mlp.up_proj.weight_scale_inv'"),
        (
            "wrong_grid",
            "model.layers.0.mlp.up_proj.weight_scale_inv has shape \\[13, 2\\].*\\[13, 3\\]",
        ),
        ("not_fp8", "model.layers.0.mlp.up_proj.weight is F32.*float8_e4m3fn"),
        (
            "fp8_without_scale",
            "model.layers.1.mlp.down_proj.weight is F8_E4M3 but has no block scale",
        ),
        ("scale_not_expected", "does not use.*'model.layers.1.mlp.down_proj.weight_scale_inv'"),
    ],
)
def test_bad_fp8_checkpoints_refused_before_allocation(
    fp8_ckpt, tmp_path, monkeypatch, damage, match
):
    d = shutil.copytree(fp8_ckpt[0], tmp_path / damage)
    path = os.path.join(d, "model.safetensors")
    weights = load_file(path)
    name = "model.layers.0.mlp.up_proj.weight"
    if damage == "missing_scale":
        del weights[name + "_scale_inv"]
    elif damage == "wrong_grid":
        weights[name + "_scale_inv"] = weights[name + "_scale_inv"][:, :2].contiguous()
    elif damage == "not_fp8":
        weights[name] = weights[name].float()
    elif damage == "fp8_without_scale":
        skipped = "model.layers.1.mlp.down_proj.weight"
        weights[skipped] = weights[skipped].to(torch.float8_e4m3fn)
    elif damage == "scale_not_expected":
        weights["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(5, 7)
    save_file(weights, path)

    def no_allocation(*args, **kwargs):
        raise AssertionError("weights were allocated before the checkpoint was validated")

    monkeypatch.setattr(loader, "_materialize", no_allocation)
    with pytest.raises(ConfigError, match=match):
        Engine(EngineArgs(model_path=str(d), max_total_tokens=1024, disable_cuda_graph=True))


def test_ue8m0_scales_match_hf_and_other_scales_are_refused(ckpt_dir, engines, oracle, tmp_path):
    """scale_fmt ue8m0 (DeepSeek V3.1 on): power-of-two scales stored as float32 load exactly; a
    scale that is no power of two contradicts the config and is refused, naming it."""
    src = make_checkpoint(str(ckpt_dir / "fp8-src"), "qwen3", seed=5, hidden_size=72,
                          intermediate_size=200)
    path, dequantized = make_fp8_checkpoint(src, str(ckpt_dir / "fp8-ue8m0"),
                                            str(ckpt_dir / "fp8-ue8m0-dequantized"), BLOCK, SKIP,
                                            scale_fmt="ue8m0")
    assert read_model_config(path).fp8_scale_fmt == "ue8m0"
    engine = engines.get(path)
    assert _parity(engine, oracle, dequantized, 1) <= 1e-4
    bad = shutil.copytree(path, tmp_path / "not-a-power-of-two")
    weights = load_file(os.path.join(bad, "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight_scale_inv"][0, 0] *= 1.5
    save_file(weights, os.path.join(bad, "model.safetensors"))
    with pytest.raises(ConfigError, match="up_proj.weight_scale_inv.*scale_fmt is 'ue8m0'"):
        Engine(EngineArgs(model_path=str(bad), max_total_tokens=1024, disable_cuda_graph=True))

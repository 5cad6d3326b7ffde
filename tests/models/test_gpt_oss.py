"""gpt-oss (``GptOssForCausalLM``) equal to HF transformers at fp32 on tiny checkpoints written as
the releases are (testkit/gpt_oss_checkpoint.py: the released config, bf16 tensors, MXFP4 experts
in ``*_blocks`` / ``*_scales``, a sharded index), with prompts well past the sliding window: logits
and every layer's cached K/V, chunked prefill, one rank and zigzag CP 2 in graphs, EP 2, attention
TP 2 with expert TP 2, interleave CP 2, PP 2 (eager), MXFP4 and unquantized experts. The MXFP4 experts stay 4-bit
in memory; broken MXFP4 files are refused by name."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.gpt_oss_checkpoint import GptOssHF, make_gpt_oss
from testkit.hf_reference import rel_err
from testkit.parity import Session, random_ids

from graphcp import ConfigError
from graphcp.checkpoint.loader import load_model
from graphcp.checkpoint.meta import weight_bytes_by_dtype
from graphcp.kernels.mxfp4_torch import dequantize_mxfp4, fp4_table

VOCAB = 211
WINDOW = 12             # testkit's tiny config: every prompt below runs past it
FIRST = [("a", random_ids(70, VOCAB, 1)), ("b", random_ids(41, VOCAB, 2))]        # 111 tokens
SECOND = [("a", random_ids(30, VOCAB, 3)), ("c", random_ids(50, VOCAB, 4))]      # chunked + new
WORST: dict[str, float] = {}     # layout -> worst logits / KV relative error (printed at the end)


@pytest.fixture(scope="module")
def mxfp4(ckpt_dir):
    return make_gpt_oss(str(ckpt_dir / "gpt-oss-mxfp4"), layers=2, seed=3)


@pytest.fixture(scope="module")
def plain(ckpt_dir):
    return make_gpt_oss(str(ckpt_dir / "gpt-oss-plain"), layers=2, quantized=False, seed=4)


@pytest.fixture(scope="module")
def hf():
    yield GptOssHF()
    print("\ngpt-oss worst relative errors:", WORST)


def _parity(engine, hf, path: str, layout: str, graphs: bool = True) -> None:
    """FIRST (fresh), SECOND (one request continued, one new), one batch forced eager."""
    s = Session(engine, hf, path)
    for batch in (FIRST, SECOND):
        out = s.run(batch)
        assert out.mode == ("graph" if graphs else "eager"), out.eager_reason
    s.run([("d", random_ids(45, VOCAB, 5))], force_eager=True)
    WORST[layout] = max(WORST.get(layout, 0.0), s.worst)
    s.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_mxfp4_unpacks_as_transformers():
    """Every nibble and a range of exponents, against transformers' own dequantizer."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 5, 4), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)    # [E, in, out]
    ours = dequantize_mxfp4(blocks.flatten(-2), scales, fp4_table("cpu"), torch.float32)
    assert torch.equal(ours.transpose(1, 2), theirs)


def _expert_values(path: str) -> int:
    """Expert weight values of the whole model (both layers)."""
    raw = json.load(open(os.path.join(path, "config.json")))
    hidden, inter, experts = raw["hidden_size"], raw["intermediate_size"], raw["num_local_experts"]
    return raw["num_hidden_layers"] * experts * 3 * hidden * inter


def test_experts_stay_in_four_bits(mxfp4, plain):
    """A rank holds the packed bytes (half a byte per value) and scales (one byte per 32), never
    a dequantized copy of the experts."""
    ours = weight_bytes_by_dtype(load_model(mxfp4, torch.float32, torch.device("cpu")))
    unquantized = weight_bytes_by_dtype(load_model(plain, torch.float32, torch.device("cpu")))
    values = _expert_values(mxfp4)
    assert ours["uint8"] == values // 2 + values // 32
    assert ours["float32"] == unquantized["float32"] - values * 4


def _broken(src: str, dst: str, change) -> str:
    """A copy of ``src`` whose expert shard ``change`` edits in place."""
    os.makedirs(dst, exist_ok=True)
    for file in os.listdir(src):
        data = open(os.path.join(src, file), "rb").read()
        open(os.path.join(dst, file), "wb").write(data)
    shard = os.path.join(dst, "model-00002-of-00002.safetensors")
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("change,message", [
    (lambda t: t["model.layers.1.mlp.experts.down_proj_scales"].view(-1)[3].fill_(255),
     "down_proj_scales holds NaN"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": t[
        "model.layers.0.mlp.experts.gate_up_proj_blocks"].to(torch.int16)}),
     "gate_up_proj_blocks is I16, but MXFP4 blocks and scales are uint8"),
    (lambda t: t.pop("model.layers.0.mlp.experts.down_proj_scales"),
     "lacks 1 tensors, e.g. 'model.layers.0.mlp.experts.down_proj_scales'"),
])
def test_broken_mxfp4_files_are_refused_by_name(mxfp4, tmp_path, change, message):
    path = _broken(mxfp4, str(tmp_path / "broken"), change)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"] = {n: fn for n, fn in index["weight_map"].items()
                           if n in load_file(os.path.join(path, fn))}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(ConfigError, match=message):
        load_model(path, torch.float32, torch.device("cpu"))


def test_the_config_decides_which_experts_are_mxfp4(plain, tmp_path):
    """Plain experts under an MXFP4 quantization_config: the blocks and scales the config promises
    (two layers, two projections) are missing, by name."""
    path = _broken(plain, str(tmp_path / "claims-mxfp4"), lambda t: None)
    raw = json.load(open(os.path.join(path, "config.json")))
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    json.dump(raw, open(os.path.join(path, "config.json"), "w"))
    missing = r"lacks 8 tensors.*experts\.gate_up_proj_(blocks|scales)"
    with pytest.raises(ConfigError, match=missing):
        load_model(path, torch.float32, torch.device("cpu"))


def test_one_rank_in_graphs_matches_hf(engines, hf, mxfp4):
    engine = engines.get(mxfp4, cuda_graph_buckets=[128])
    _parity(engine, hf, mxfp4, "one rank, MXFP4, graphs")


def test_cp2_zigzag_ep2_in_graphs_matches_hf(engines, hf, mxfp4):
    """Each CP rank holds half of every request (zigzag) and two of the four experts."""
    engine = engines.get(mxfp4, tp_size=2, ep_size=2, attn_cp_size=2, enable_prefill_cp=True,
                         cp_strategy="zigzag", cuda_graph_buckets=[64])
    _parity(engine, hf, mxfp4, "CP 2 zigzag x EP 2, MXFP4, graphs")
    one = engines.get(mxfp4, cuda_graph_buckets=[128]).stats()["weight_bytes"]
    # each rank holds half the 4-bit experts and their fp32 biases, nothing more
    raw = json.load(open(os.path.join(mxfp4, "config.json")))
    values, hidden = _expert_values(mxfp4), raw["hidden_size"]
    biases = 2 * raw["num_local_experts"] * (2 * raw["intermediate_size"] + hidden) * 4
    half = (values // 2 + values // 32 + biases) // 2
    assert engine.stats()["weight_bytes_per_rank"] == [one - half] * 2


def test_attention_tp2_expert_tp2_in_graphs_matches_hf(engines, hf, mxfp4):
    """Two heads and their sinks per rank; each expert split over both ranks in whole MXFP4
    blocks (32 of the 64 intermediate features each), the down bias added once."""
    engine = engines.get(mxfp4, tp_size=2, cuda_graph_buckets=[128])
    _parity(engine, hf, mxfp4, "attention TP 2 x expert TP 2, MXFP4, graphs")


def test_interleave_cp2_ep2_all_to_all_unquantized_matches_hf(engines, hf, plain):
    """Unquantized experts (transformers' [E, in, out] tensors, gate/up interleaved), the
    all-to-all token flow; interleave runs eagerly."""
    engine = engines.get(plain, tp_size=2, ep_size=2, attn_cp_size=2, enable_prefill_cp=True,
                         cp_strategy="interleave", moe_a2a_backend="all_to_all")
    _parity(engine, hf, plain, "CP 2 interleave x EP 2 all-to-all, unquantized", graphs=False)


def test_pipeline_stages_match_hf(engines, hf, mxfp4):
    """Two pipeline stages of one layer each (a sliding layer, then a full one), MXFP4; PP runs
    eagerly, as in SGLang."""
    engine = engines.get(mxfp4, pp_size=2, disable_cuda_graph=True)
    _parity(engine, hf, mxfp4, "PP 2, MXFP4", graphs=False)


def test_hf_oracle_sees_the_window_and_the_sinks(mxfp4, hf):
    """The oracle's logits move with the window and the sinks (so parity checks both)."""
    import transformers
    model = copy.deepcopy(hf.models.get(mxfp4) or hf.load(mxfp4))     # the oracle stays as loaded
    ids = torch.tensor([random_ids(60, VOCAB, 9)])
    with torch.no_grad():
        base = model(ids).logits[0, -1]
        model.config.sliding_window = 1000
        for layer in model.model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = 1000
        wide = model(ids).logits[0, -1]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        no_sinks = model(ids).logits[0, -1]
    assert isinstance(model, transformers.GptOssForCausalLM)
    assert rel_err(wide, base) > 1e-3 and rel_err(no_sinks, wide) > 1e-3

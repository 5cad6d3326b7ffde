"""Bad configuration -> ConfigError naming the flag; bad requests -> RequestError naming the request, with
nothing written, no page leaked, and exact results from the next batch."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.engines import cp_kwargs
from testkit.parity import Session, random_ids

from graphcp import ConfigError, Engine, EngineArgs, Request, RequestError

VOCAB = 211


@pytest.mark.parametrize("kwargs,flag", [
    (dict(model_path=None), "--model-path"),
    (dict(model_path="/nonexistent/dir"), "--model-path"),
    (dict(dtype="float64"), "--dtype"),
    (dict(device="tpu"), "--device"),
    (dict(attention_backend="fa9"), "--attention-backend"),
    (dict(attention_kernel="cutlass"), "--attention-kernel"),
    (dict(enable_prefill_cp=True, cp_strategy="ring", tp_size=2, attn_cp_size=2), "--cp-strategy"),
    (dict(enable_prefill_cp=True, tp_size=2, attn_cp_size=2), "--cp-strategy must be set when --enable-prefill-cp"),
    (dict(tp_size=0), "--tp"),
    (dict(page_size=0), "--page-size"),
    (dict(page_size=12), "--page-size"),
    (dict(tp_size=3, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag"),
     "--tp must be divisible by --dp x --attn-cp-size"),
    (dict(attn_cp_size=2, tp_size=2), "--enable-prefill-cp"),
])
def test_bad_config_names_the_flag(checkpoint, kwargs, flag):
    kwargs = {"model_path": checkpoint, **kwargs}
    with pytest.raises(ConfigError, match=flag.replace("-", r"\-").replace("x", "x")):
        EngineArgs(**kwargs)


def test_from_cli_sglang_flags(checkpoint):
    args = EngineArgs.from_cli(["--model-path", checkpoint, "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
                                "--cp-strategy", "zigzag", "--cuda-graph-buckets", "32", "64", "--page-size", "8"])
    assert (args.tp_size, args.attn_cp_size, args.cp_strategy, args.cp_size) == (2, 2, "zigzag", 2)
    assert args.cuda_graph_buckets == (32, 64) and args.page_size == 8
    with pytest.raises(ConfigError, match="--cp-strategy"):
        EngineArgs.from_cli(["--model-path", checkpoint, "--enable-prefill-cp"])
    with pytest.raises(ConfigError, match="bad flags"):
        EngineArgs.from_cli(["--model-path", checkpoint, "--tp", "two"])


def _copy(checkpoint: str, dst: str) -> str:
    shutil.copytree(checkpoint, dst)
    return dst


def test_pickle_checkpoint_is_refused(checkpoint, tmp_path):
    d = _copy(checkpoint, str(tmp_path / "pickled"))
    os.remove(os.path.join(d, "model.safetensors"))
    open(os.path.join(d, "pytorch_model.bin"), "wb").write(b"not loaded")
    with pytest.raises(ConfigError, match="pickle"):
        Engine(EngineArgs(model_path=d))


@pytest.mark.parametrize("damage,match", [
    ("huge_vocab", "vocab_size"), ("huge_layers", "num_hidden_layers"), ("huge_hidden", "hidden_size"),
    ("shape", "shape"), ("missing", "lacks"), ("nan", "NaN"),
    ("arch", "not supported"), ("extra", "does not use"), ("quantized", "quant_method 'awq'"),
])
def test_hostile_checkpoints(checkpoint, tmp_path, damage, match):
    from graphcp import Engine
    d = _copy(checkpoint, str(tmp_path / damage))
    cfg_path, w_path = os.path.join(d, "config.json"), os.path.join(d, "model.safetensors")
    cfg, weights = json.load(open(cfg_path)), load_file(w_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    if damage == "huge_vocab":
        cfg["vocab_size"] = 10**12
    elif damage == "huge_layers":
        cfg["num_hidden_layers"] = 10**6
    elif damage == "huge_hidden":
        cfg["hidden_size"] = 10**7
    elif damage == "shape":
        weights[name] = weights[name][:, :-1].contiguous()
    elif damage == "missing":
        del weights[name]
    elif damage == "nan":
        weights[name][0, 0] = float("nan")
    elif damage == "arch":
        cfg["architectures"] = ["GPT2LMHeadModel"]
    elif damage == "quantized":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    elif damage == "extra":
        weights["model.layers.0.self_attn.secret"] = torch.zeros(2)
    json.dump(cfg, open(cfg_path, "w"))
    save_file(weights, w_path)
    with pytest.raises(ConfigError, match=match):
        Engine(EngineArgs(model_path=d, max_total_tokens=1024, disable_cuda_graph=True))


def _bad_batches(vocab: int):
    good = ("ok", random_ids(20, vocab, 1))
    return [
        ([], "empty batch"),
        ([good, ("e", [])], "'e'.*empty"),
        ([good, ("float", [1.5, 2.0])], "'float'.*ints, got torch.float"),
        ([good, ("bool", [True, False])], "'bool'.*ints, got torch.bool"),
        ([good, ("nested", [[1, 2], [3, 4]])], "'nested'.*flat list"),
        ([good, ("big", [0, vocab])], f"'big'.*{vocab}"),
        ([good, ("neg", [-1, 3])], "'neg'.*-1"),
        ([good, ("ok", [1, 2])], "'ok' appears twice"),
        ([good, ("long", random_ids(600, vocab, 2))], "'long'.*context"),
        ([("p1", random_ids(300, vocab, 3)), ("p2", random_ids(300, vocab, 4))], "'p2'.*KV tokens"),
    ]


@pytest.mark.parametrize("cp", [1, 2])
def test_bad_requests_leave_engine_serving(checkpoint, engines, oracle, cp):
    engine = engines.get(checkpoint, **cp_kwargs(cp, max_total_tokens=512))
    s = Session(engine, oracle, checkpoint)
    s.run([("held", random_ids(40, VOCAB, 9))])                 # a cached request that must survive
    free = engine.stats()["kv_tokens_free"]
    for batch, match in _bad_batches(VOCAB):
        with pytest.raises(RequestError, match=match):
            engine.prefill([Request(rid, ids) for rid, ids in batch])
        assert engine.stats()["kv_tokens_free"] == free, f"pages leaked after {match!r}"
    with pytest.raises(RequestError, match="'ghost' is unknown"):
        engine.release("ghost")
    with pytest.raises(RequestError, match="'ghost'"):
        engine.kv_cache("ghost")
    s.run([("held", random_ids(9, VOCAB, 10)), ("after", random_ids(30, VOCAB, 11))])   # still exact
    s.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_flashinfer_on_cpu_is_refused_at_start(checkpoint):
    """An explicit kernel the machine cannot run stops the engine before it serves, naming the flag."""
    from graphcp import Engine
    with pytest.raises(ConfigError, match="--attention-kernel flashinfer"):
        Engine(EngineArgs(model_path=checkpoint, device="cpu", attention_kernel="flashinfer"))


def test_kv_pool_larger_than_memory_is_refused_at_start(checkpoint):
    from graphcp import Engine
    with pytest.raises(ConfigError, match=r"--max-total-tokens 100000000000: the KV pool needs .* GiB per rank"):
        Engine(EngineArgs(model_path=checkpoint, device="cpu", max_total_tokens=10**11, disable_cuda_graph=True))

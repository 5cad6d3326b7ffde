"""An unmodified SGLang decode receives graphcp's KV: graphcp's prefill engine speaks SGLang
0.5.23's PD protocol (bootstrap server, ZMQ control, Mooncake writes into the decode's pages, the
aux row) against a decode harness built from SGLang's own classes in a subprocess
(``tests/scripts/sglang_decode_harness.py``). The received KV equals ``engine.kv_cache`` bitwise and HF's
cache within TOL, the aux row carries the first token and the room, nothing outside the room's
pages changes, and every concluded transfer frees its pages. SGLang's own prefill classes send into
the same harness as a self-check, and SGLang's sampler is the oracle for the first token."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # graphcp's endpoints stay on loopback
pytest.importorskip(
    "mooncake.engine",
    reason="the Mooncake Transfer Engine is not importable: pip install "
    "'graphcp[pd]' and apt-get install libibverbs1 librdmacm1 libnuma1 (README, PD section)",
)
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("zmq") is None:
    pytest.skip(
        "SGLang 0.5.23 is not installed (make setup installs it: README, SGLang PD section)",
        allow_module_level=True,
    )

import torch
from testkit.engines import cp_kwargs
from testkit.hf_reference import rel_err
from testkit.mla_checkpoint import DEEPSEEK_V3, write_release
from testkit.parity import TOL, random_ids
from testkit.sglang import Harness

from graphcp import ConfigError, EngineArgs, Request, RequestError
from graphcp.distributed.procs import free_port
from graphcp.pd.sglang.sampling import SamplingParams, first_token

VOCAB = 211
@pytest.fixture(scope="module")
def mla_paths(ckpt_dir):
    """A DeepSeek-V3 (dense MLA, no indexer) checkpoint and HF's twin; written on first use."""
    return str(ckpt_dir / "sglang-mla" / "release"), str(ckpt_dir / "sglang-mla" / "oracle")


@pytest.fixture(scope="module")
def decode(checkpoint, mla_paths):
    """One SGLang decode process with three decode instances: the dense checkpoint in fp32, the same
    in SGLang's own dtype resolution (fp16: a geometry graphcp's fp32 pool does not match), MLA."""
    harness = Harness(
        {
            "dense": f"{checkpoint}:float32",
            "fp16": f"{checkpoint}:auto",
            "mla": f"{mla_paths[1]}:float32",
        }
    )  # the twin: no auto_map to remote code
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def cp_engine(checkpoint, engines, decode):
    """CP 2 with LayerSplit (each CP rank owns one of the two layers) x attention TP 2 (one KV
    head each)."""
    return engines.get(
        checkpoint,
        **{**cp_kwargs(2, "interleave"), "tp_size": 4},
        disaggregation_mode="prefill",
        enable_dsa_cache_layer_split=True,
        disaggregation_bootstrap_port=free_port(),
    )


def _bootstrap(engine) -> str:
    return f"127.0.0.1:{engine.args.disaggregation_bootstrap_port}"


def _all_free(engine) -> None:
    """Every page is back once the transfers concluded (released right after their status)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["kv_tokens_free"] == stats["kv_tokens_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"pages leaked: {engine.stats()['kv_tokens_free']} of {engine.stats()['kv_tokens_total']}"
    )


def _check_dense(got: dict, ours: list, ref: list, n: int) -> None:
    """Decode rows (K of each layer, then V) equal the engine's cache bitwise, HF's within TOL."""
    layers = len(ours)
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(ours, ref)):
        k_got, v_got = (got["rows"][i].transpose(0, 1) for i in (layer, layers + layer))
        assert k_got.shape == k.shape == (2, n, 32)
        assert k_got.equal(k) and v_got.equal(v), (
            f"layer {layer}: the decode's pages differ from graphcp's"
        )
        assert rel_err(k_got, k_ref) <= TOL and rel_err(v_got, v_ref) <= TOL


def test_dense_cp2_layer_split_attention_tp2_into_decode_tp1(
    cp_engine, decode, checkpoint, oracle, tmp_path
):
    """Both orders: the forward before the decode's metadata (b), and the metadata first (a)."""
    ids_a, ids_b = random_ids(45, VOCAB, 21), random_ids(70, VOCAB, 22)
    out = cp_engine.prefill(
        [Request("b", ids_b, bootstrap_room=7001, sampling_params={"temperature": 0})]
    )
    assert cp_engine.transfer_status("b")["state"] == "waiting"
    ours = cp_engine.kv_cache("b")
    reply = decode.ask(
        op="receive",
        decode="dense",
        bootstrap=_bootstrap(cp_engine),
        room=7001,
        tokens=len(ids_b),
        out=str(tmp_path / "b.pt"),
    )
    assert reply == {"status": "success", "touched_outside": 0}
    got = torch.load(tmp_path / "b.pt")
    _check_dense(got, ours, oracle(checkpoint, ids_b)[1], len(ids_b))
    status = cp_engine.transfer_status("b")
    assert (
        status["state"] == "success" and status["first_token"] == out.next_token_ids[0]
    )  # greedy at T=0
    aux = got["aux"]
    assert (
        aux["output_id"] == out.next_token_ids[0]
        and aux["room"] == 7001
        and aux["cached_tokens"] == [0] * 16
    )
    logprobs = torch.log_softmax(out.logits[0], -1)
    assert abs(aux["logprob"] - float(logprobs[aux["output_id"]])) < 1e-5
    assert aux["top_ids"][:5] == torch.topk(logprobs, 5).indices.tolist()
    # The decode's metadata first: the transfer waits for the forward.
    decode.send(
        op="receive",
        decode="dense",
        bootstrap=_bootstrap(cp_engine),
        room=7002,
        tokens=len(ids_a),
        out=str(tmp_path / "a.pt"),
    )
    deadline = time.monotonic() + 120
    while not cp_engine._sglang.rooms.get(7002, None) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = cp_engine.prefill(
        [Request("a", ids_a, bootstrap_room=7002, sampling_params={"sampling_seed": 3})]
    )
    assert decode.reply() == {"status": "success", "touched_outside": 0}
    got = torch.load(tmp_path / "a.pt")
    ref = oracle(checkpoint, ids_a)[1]
    assert (
        max(
            rel_err(r, x)
            for i, (k, v) in enumerate(ref)
            for r, x in (
                (got["rows"][i].transpose(0, 1), k),
                (got["rows"][2 + i].transpose(0, 1), v),
            )
        )
        <= TOL
    )
    sampled = first_token(out.logits[0], SamplingParams(sampling_seed=3), len(ids_a) - 1).token
    assert got["aux"]["output_id"] == sampled == cp_engine.transfer_status("a")["first_token"]
    _all_free(cp_engine)


def test_first_token_is_sglang_samplers(decode):
    """graphcp's first token equals SGLang's own sampler (its seeded path and MurmurHash kernel)
    for greedy, temperature, top-k, top-p and min-p rows at several positions and seeds."""
    cases = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, sampling_seed=11),
        dict(temperature=1.3, top_k=20, sampling_seed=5),
        dict(temperature=0.9, top_p=0.8),
        dict(temperature=1.0, top_k=50, top_p=0.95, sampling_seed=-4),
        dict(top_k=1),
    ]
    generator = torch.Generator().manual_seed(9)
    for i, case in enumerate(cases * 2):
        logits = torch.randn(VOCAB, generator=generator) * 3
        params, position = SamplingParams.parse("s", case), 17 + 31 * i
        want = decode.ask(
            op="sample",
            logits=logits.tolist(),
            position=position,
            params=dict(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                min_p=params.min_p,
                seed=42 if params.sampling_seed is None else params.sampling_seed,
            ),
        )
        assert first_token(logits, params, position).token == want["token"], case


def test_failed_transfer_tells_the_decode_why(cp_engine, decode, tmp_path):
    """A decode that tokenized another prompt (more pages than graphcp holds) gets Failed with
    graphcp's reason; the engine reports it and frees the pages."""
    ids = random_ids(30, VOCAB, 23)
    cp_engine.prefill([Request("f", ids, bootstrap_room=7003)])
    reply = decode.ask(
        op="receive",
        decode="dense",
        bootstrap=_bootstrap(cp_engine),
        room=7003,
        tokens=60,
        out=str(tmp_path / "f.pt"),
    )
    assert reply["status"] == "failed" and "tokenized different prompts" in reply["reason"]
    status = cp_engine.transfer_status("f")
    assert status["state"] == "failed" and "4 pages" in status["reason"]
    _all_free(cp_engine)


def test_abort_is_acked_by_every_endpoint_and_frees_the_pages(cp_engine, decode, tmp_path):
    """The decode aborts a room before graphcp prefilled it: all four endpoints it contacted (CP 2
    layer split x attention TP 2) ACK; the later forward concludes failed and frees its pages."""
    reply = decode.ask(
        op="abort",
        decode="dense",
        bootstrap=_bootstrap(cp_engine),
        room=7004,
        tokens=40,
        out=str(tmp_path / "x.pt"),
    )
    assert reply == {"status": "acked", "acks": 4}
    cp_engine.prefill([Request("x", random_ids(40, VOCAB, 24), bootstrap_room=7004)])
    _all_free(cp_engine)
    status = cp_engine.transfer_status("x")
    assert status["state"] == "failed" and status["reason"] == "aborted by the decode"


def test_mla_into_decode(engines, decode, mla_paths, tmp_path):
    """DeepSeek-V3 (dense MLA) into SGLang's MLATokenToKVPool: [latent | rope] rows bitwise."""
    from testkit.mla_checkpoint import MLAOracle

    ckpt, twin = mla_paths
    if not os.path.isdir(ckpt):
        write_release(
            os.path.dirname(ckpt),
            DEEPSEEK_V3,
            seed=41,
            fp8=False,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            n_routed_experts=16,
            num_nextn_predict_layers=0,
        )
    engine = engines.get(
        ckpt,
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=free_port(),
        cuda_graph_buckets=[64],
    )
    ids = random_ids(37, VOCAB, 25)
    engine.prefill([Request("m", ids, bootstrap_room=7005)])
    ours = engine.kv_cache("m")
    reply = decode.ask(
        op="receive",
        decode="mla",
        bootstrap=_bootstrap(engine),
        room=7005,
        tokens=len(ids),
        out=str(tmp_path / "m.pt"),
    )
    assert reply == {"status": "success", "touched_outside": 0}
    rows = torch.load(tmp_path / "m.pt")["rows"]
    ref = MLAOracle()(twin, ids)[1]
    for layer, ((latent, rope, _), (latent_ref, rope_ref)) in enumerate(zip(ours, ref)):
        got = rows[layer][:, 0]
        assert got.equal(torch.cat([latent, rope], dim=-1)), f"layer {layer}"
        assert rel_err(got[:, :32], latent_ref) <= TOL and rel_err(got[:, 32:], rope_ref) <= TOL
    _all_free(engine)


def test_sharded_cp2_zigzag_into_decode(checkpoint, engines, decode, oracle, tmp_path):
    """KV sharding (CP 2 zigzag in graphs x attention TP 2, one KV head each): the bootstrap
    server publishes enable_kv_cache_sharding, SGLang's decode (TP 1) pulls from every CP rank and
    each writes its head of the pages it owns; a request longer than one rank's pool arrives whole,
    bitwise the gathered cache."""
    engine = engines.get(
        checkpoint,
        **{**cp_kwargs(2, "zigzag"), "tp_size": 4},
        cuda_graph_buckets=[64, 128],
        max_total_tokens=128,
        disaggregation_mode="prefill",
        enable_kv_cache_sharding=True,
        disaggregation_bootstrap_port=free_port(),
    )
    ids = random_ids(150, VOCAB, 27)  # 10 pages of 16: one rank's pool holds 8
    out = engine.prefill(
        [Request("s", ids, bootstrap_room=7008, sampling_params={"temperature": 0})]
    )
    assert out.cp_applied and out.mode == "graph", out.eager_reason
    assert engine.stats()["kv_pages_used_per_rank"] == [5] * 4  # (cp, attention tp) ranks
    ours = engine.kv_cache("s")
    reply = decode.ask(
        op="receive",
        decode="dense",
        bootstrap=_bootstrap(engine),
        room=7008,
        tokens=len(ids),
        out=str(tmp_path / "s.pt"),
    )
    assert reply == {"status": "success", "touched_outside": 0}
    got = torch.load(tmp_path / "s.pt")
    _check_dense(got, ours, oracle(checkpoint, ids)[1], len(ids))
    assert got["aux"]["output_id"] == out.next_token_ids[0] and got["aux"]["room"] == 7008
    _all_free(engine)
    assert engine.stats()["kv_pages_used_per_rank"] == [0] * 4


def test_geometry_mismatch_is_refused_naming_the_dtype(checkpoint, engines, decode, tmp_path):
    """A decode whose pool is fp16 (SGLang's own resolution of this fp32 checkpoint) against
    graphcp's fp32: refused, the reason names the dtype, nothing is written, the pages are freed."""
    engine = engines.get(
        checkpoint,
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=free_port(),
        disable_cuda_graph=True,
    )
    engine.prefill([Request("g", random_ids(20, VOCAB, 26), bootstrap_room=7006)])
    reply = decode.ask(
        op="receive",
        decode="fp16",
        bootstrap=_bootstrap(engine),
        room=7006,
        tokens=20,
        out=str(tmp_path / "g.pt"),
    )
    assert (
        reply["status"] == "failed" and "dtype (2-byte elements on the decode)" in reply["reason"]
    )
    assert "dtype" in engine.transfer_status("g")["reason"]
    _all_free(engine)


def test_sglang_prefill_self_check(checkpoint, decode, tmp_path):
    """SGLang's own prefill classes into the same harness: if this fails after an SGLang upgrade,
    the harness (or the wire) changed, not graphcp."""
    prefill = Harness({"dense": f"{checkpoint}:float32"}, "--self-check-prefill")
    try:
        prefill.send(room=7007, tokens=50, first_token=9, out=str(tmp_path / "sent.pt"))
        reply = decode.ask(
            op="receive",
            decode="dense",
            bootstrap=f"127.0.0.1:{prefill.port}",
            room=7007,
            tokens=50,
            out=str(tmp_path / "got.pt"),
        )
        assert prefill.reply() == {"status": "success"}
    finally:
        prefill.close()
    assert reply == {"status": "success", "touched_outside": 0}
    got, sent = torch.load(tmp_path / "got.pt"), torch.load(tmp_path / "sent.pt")
    assert (
        all(a.equal(b) for a, b in zip(got["rows"], sent["rows"])) and got["aux"]["output_id"] == 9
    )


def test_bad_rooms_and_flags_name_what_to_change(checkpoint, engines, ckpt_dir):
    engine = engines.get(checkpoint, disable_cuda_graph=True)
    with pytest.raises(RequestError, match="--disaggregation-bootstrap-port"):
        engine.prefill([Request("r", [1, 2, 3], bootstrap_room=5)])
    with pytest.raises(ConfigError, match="--disaggregation-mode prefill"):
        EngineArgs(model_path=checkpoint, disaggregation_bootstrap_port=9000)
    with pytest.raises(ConfigError, match="--disaggregation-bootstrap-port must be a TCP port"):
        EngineArgs(
            model_path=checkpoint, disaggregation_mode="prefill", disaggregation_bootstrap_port=0
        )
    pd = engines.get(
        checkpoint,
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=free_port(),
        disable_cuda_graph=True,
    )
    for room, match in ((0, "room 0"), (-3, r"\[1, 2\*\*64\)"), ("7", "integer")):
        with pytest.raises(RequestError, match=match):
            pd.prefill([Request("r", [1, 2, 3], bootstrap_room=room)])
    with pytest.raises(RequestError, match=r"sampling_params\['regex'\]"):
        pd.prefill([Request("r", [1, 2, 3], bootstrap_room=8, sampling_params={"regex": "a+"})])
    with pytest.raises(RequestError, match=r"sampling_params\['top_p'\]"):
        pd.prefill([Request("r", [1, 2, 3], bootstrap_room=8, sampling_params={"top_p": 0})])
    assert pd.stats()["kv_tokens_free"] == pd.stats()["kv_tokens_total"]  # nothing was prefilled
    from testkit.dsa_checkpoint import make_dsa_checkpoint

    dsa = str(ckpt_dir / "sglang-dsa")
    if not os.path.isdir(dsa):
        make_dsa_checkpoint(dsa, "DeepseekV32", seed=3, n_group=1, topk_group=1)
    with pytest.raises(ConfigError, match="index_topk"):
        engines.get(dsa, disaggregation_mode="prefill", disaggregation_bootstrap_port=free_port())


def _with_tokenizer(src: str, dst: str) -> str:
    """A copy of the checkpoint with a word-level tokenizer ("w0".."w199") and a chat template."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if os.path.isdir(dst):
        return dst
    shutil.copytree(src, dst)
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {**{f"w{i}": i for i in range(200)}, **{s: 200 + i for i, s in enumerate(specials)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> w7 {% endif %}"
    )
    PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        additional_special_tokens=specials[1:],
        chat_template=template,
    ).save_pretrained(dst)
    return dst


def _post(port: int, path: str, body: dict) -> tuple[int, object]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_generate_end_to_end(checkpoint, decode, oracle, ckpt_dir, tmp_path):
    """``graphcp serve`` as SGLang's router drives a prefill worker: a batched /generate of text
    (the checkpoint's tokenizer), a chat completion (its chat template), each room's KV at the
    decode equal to HF's on the ids the decode's own tokenization gives; clients' requests share
    prefill calls."""
    import threading
    import urllib.request

    from transformers import AutoTokenizer

    from graphcp.serve.cli import build

    path = _with_tokenizer(checkpoint, str(ckpt_dir / "qwen3-tokenizer"))
    bootstrap = free_port()
    server = build(
        [
            "--model-path",
            path,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap),
            "--disable-cuda-graph",
            "--max-total-tokens",
            "4096",
            "--port",
            "0",
        ]
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine, tokenizer = server.engine, AutoTokenizer.from_pretrained(path)
    try:
        for route, key in (
            ("/health", None),
            ("/get_model_info", "model_path"),
            ("/get_server_info", "version"),
        ):
            with urllib.request.urlopen(
                f"http://127.0.0.1:{server.port}{route}", timeout=10
            ) as reply:
                assert reply.status == 200 and (key is None or key in json.loads(reply.read()))
        texts = [
            " ".join(f"w{(7 * i) % 200}" for i in range(31)),
            " ".join(f"w{(3 * i + 1) % 200}" for i in range(18)),
        ]
        ids = [tokenizer(t)["input_ids"] for t in texts]
        decode.send(
            op="receive",
            decode="dense",
            bootstrap=f"127.0.0.1:{bootstrap}",
            room=8001,
            tokens=len(ids[0]),
            out=str(tmp_path / "s1.pt"),
        )
        answer: list = []
        body = {
            "text": texts,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap,
            "bootstrap_room": [8001, 8002],
            "sampling_params": {"temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 3,
        }
        post = threading.Thread(target=lambda: answer.append(_post(server.port, "/generate", body)))
        post.start()
        assert decode.reply()["status"] == "success"
        assert (
            decode.ask(
                op="receive",
                decode="dense",
                bootstrap=f"127.0.0.1:{bootstrap}",
                room=8002,
                tokens=len(ids[1]),
                out=str(tmp_path / "s2.pt"),
            )["status"]
            == "success"
        )
        post.join(60)
        code, replies = answer[0]
        assert code == 200 and len(replies) == 2
        for i, reply in enumerate(replies):
            got = torch.load(tmp_path / f"s{i + 1}.pt")
            assert reply["output_ids"] == [got["aux"]["output_id"]] and reply["meta_info"][
                "prompt_tokens"
            ] == len(ids[i])
            assert (
                reply["meta_info"]["output_top_logprobs"][0][0][1] == reply["output_ids"][0]
            )  # greedy
            ref = oracle(path, ids[i])[1]
            assert (
                max(rel_err(got["rows"][j].transpose(0, 1), ref[j % 2][j // 2]) for j in range(4))
                <= TOL
            )
        messages = [{"role": "user", "content": "w3 w4 w5"}]
        chat_ids = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True
        )
        chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
        decode.send(
            op="receive",
            decode="dense",
            bootstrap=f"127.0.0.1:{bootstrap}",
            room=8003,
            tokens=len(chat_ids),
            out=str(tmp_path / "s3.pt"),
        )
        code, chat = _post(
            server.port, "/v1/chat/completions", {"messages": messages, "bootstrap_room": 8003}
        )
        assert decode.reply()["status"] == "success" and code == 200
        assert chat["usage"]["prompt_tokens"] == len(chat_ids)
        code, bad = _post(
            server.port, "/generate", {"text": "w1 w2", "sampling_params": {"regex": "w+"}}
        )
        assert code == 400 and "regex" in bad["error"]["message"]
        # Three clients at once, while the engine is busy: they share a prefill call.
        sizes, prefill = [], engine.prefill
        engine.prefill = lambda batch, *a, **k: sizes.append(len(batch)) or prefill(batch, *a, **k)
        with engine._lock:
            clients = [
                threading.Thread(
                    target=_post, args=(server.port, "/generate", {"input_ids": [1 + i, 2, 3]})
                )
                for i in range(3)
            ]
            for client in clients:
                client.start()
            deadline = time.monotonic() + 30  # all three taken or queued behind the busy engine
            while (
                not sizes or sizes[0] + server.pending.qsize() < 3
            ) and time.monotonic() < deadline:
                time.sleep(0.01)
        for client in clients:
            client.join(30)
        assert sum(sizes) == 3 and max(sizes) >= 2, sizes
        _all_free(engine)
    finally:
        server.close()
        engine.close()

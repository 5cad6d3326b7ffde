"""graphcp's SGLang-protocol prefill as a served worker: SGLang's own prefill classes into the same
decode harness (a self-check of the harness), bad rooms and flags, and ``graphcp serve`` driven as
SGLang's router drives a prefill worker (``tests/scripts/sglang_decode_harness.py``)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from testkit.hf_reference import rel_err
from testkit.parity import TOL
from testkit.sglang import Harness
from testkit.sglang_pd import all_free, require_sglang_pd

from graphcp import ConfigError, EngineArgs, Request, RequestError
from graphcp.distributed.procs import free_port

require_sglang_pd()      # skips the module without Mooncake or SGLang


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
        all_free(engine)
    finally:
        server.close()
        engine.close()

"""PD disaggregation, prefill side: KV moved by Mooncake (tcp on 127.0.0.1) from a CP=2 zigzag engine's
KV pools into a receiver process equals HF's cache, also after a second chunk; a receiver that is gone
makes transfer_kv raise TransferError in bounded time, nothing leaks, and the engine keeps serving."""
from __future__ import annotations

import os
import signal
import time

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")        # as graphcp sets it before its own import of mooncake
pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine is not importable: pip install "
                    "'graphcp[pd]' and apt-get install libibverbs1 librdmacm1 libnuma1 (README, PD section)")

from testkit.engines import cp_kwargs
from testkit.hf_reference import rel_err
from testkit.parity import TOL, random_ids

from graphcp import ConfigError, EngineArgs, Request, RequestError, TransferError
from graphcp.pd import KVReceiver

VOCAB = 211
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pd_engine(checkpoint, engines):
    return engines.get(checkpoint, **cp_kwargs(2, disaggregation_mode="prefill", cuda_graph_buckets=[32, 64],
                                               disaggregation_transfer_timeout_s=TIMEOUT_S))


@pytest.fixture(scope="module")
def receiver(checkpoint):
    with KVReceiver(checkpoint, max_tokens=256, max_requests=3) as rx:
        yield rx


def _check_received(rx, engine, oracle, path, rid, history):
    """The receiver's copy equals HF's cache for the whole history and the engine's own cache bitwise."""
    got, ours = rx.kv(rid), engine.kv_cache(rid)
    _, ref = oracle(path, history)
    assert len(got) == len(ref) == len(ours)
    worst = 0.0
    for layer, ((k, v), (k_ref, v_ref), (k_ours, v_ours)) in enumerate(zip(got, ref, ours)):
        assert k.shape == k_ref.shape == (2, len(history), 32), f"{rid} layer {layer}: {tuple(k.shape)}"
        worst = max(worst, rel_err(k, k_ref), rel_err(v, v_ref))
        assert k.equal(k_ours) and v.equal(v_ours), f"{rid} layer {layer}: received KV differs from the pool"
    assert worst <= TOL, f"{rid}: received KV rel err {worst:.2e} against HF"
    return worst


def _kv_bytes(tokens: int) -> int:
    return 2 * 2 * tokens * 2 * 32 * 4          # layers x (k, v) x tokens x kv_heads x head_dim x fp32


def test_transfer_matches_hf_with_a_second_chunk(pd_engine, receiver, checkpoint, oracle):
    history = {"a": random_ids(45, VOCAB, 1), "b": random_ids(70, VOCAB, 2)}
    out = pd_engine.prefill([Request(rid, ids) for rid, ids in history.items()])
    assert out.cp_applied and out.per_rank_tokens == [58, 57]
    for rid, ids in history.items():
        report = pd_engine.transfer_kv(rid, receiver.destination(rid))
        assert report["bytes"] == _kv_bytes(len(ids)) and report["ranks"] == 2   # each CP rank sent its layers
        _check_received(receiver, pd_engine, oracle, checkpoint, rid, ids)
    # A later chunk extends "a" (chunked prefill); the new transfer carries the whole cache again.
    chunk = random_ids(33, VOCAB, 3)
    out = pd_engine.prefill([Request("a", chunk)])
    assert out.cp_applied
    history["a"] += chunk
    assert pd_engine.transfer_kv("a", receiver.destination("a"))["bytes"] == _kv_bytes(78)
    _check_received(receiver, pd_engine, oracle, checkpoint, "a", history["a"])
    for rid in history:
        pd_engine.release(rid)
        receiver.free(rid)
    stats = pd_engine.stats()
    assert stats["kv_tokens_free"] == stats["kv_tokens_total"]


def test_receiver_gone_raises_transfer_error_and_engine_keeps_serving(pd_engine, receiver, checkpoint, oracle):
    gone = KVReceiver(checkpoint, max_tokens=256, max_requests=1)
    pid = gone._proc.pid
    ids = random_ids(40, VOCAB, 4)
    pd_engine.prefill([Request("c", ids)])
    destination = gone.destination("c")
    gone.close()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    free_before = pd_engine.stats()["kv_tokens_free"]
    start = time.monotonic()
    with pytest.raises(TransferError, match="'c'"):
        pd_engine.transfer_kv("c", destination)
    assert time.monotonic() - start < TIMEOUT_S + 5
    # The request's KV stays until released, and the engine serves the next prefill and transfer.
    assert pd_engine.stats()["kv_tokens_free"] == free_before
    assert pd_engine.kv_cache("c")[0][0].shape == (2, 40, 32)
    pd_engine.transfer_kv("c", receiver.destination("c"))
    _check_received(receiver, pd_engine, oracle, checkpoint, "c", ids)
    more = random_ids(50, VOCAB, 5)
    assert pd_engine.prefill([Request("d", more)]).cp_applied
    pd_engine.transfer_kv("d", receiver.destination("d"))
    _check_received(receiver, pd_engine, oracle, checkpoint, "d", more)
    for rid in ("c", "d"):
        pd_engine.release(rid)
        receiver.free(rid)
    stats = pd_engine.stats()
    assert stats["kv_tokens_free"] == stats["kv_tokens_total"]


def test_hung_receiver_times_out(pd_engine, receiver, checkpoint, oracle):
    """A receiver that stops answering (SIGSTOP) fails the transfer after --disaggregation-transfer-timeout."""
    ids = random_ids(30, VOCAB, 7)
    pd_engine.prefill([Request("h", ids)])
    with KVReceiver(checkpoint, max_tokens=64, max_requests=1) as hung:
        destination = hung.destination("h")
        os.kill(hung._proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(TransferError, match="'h'"):
                pd_engine.transfer_kv("h", destination)
            assert TIMEOUT_S - 0.5 < time.monotonic() - start < TIMEOUT_S + 5
        finally:
            os.kill(hung._proc.pid, signal.SIGCONT)
    pd_engine.transfer_kv("h", receiver.destination("h"))
    _check_received(receiver, pd_engine, oracle, checkpoint, "h", ids)
    pd_engine.release("h")
    receiver.free("h")


def test_bad_transfers_name_the_request_or_key(pd_engine, receiver):
    pd_engine.prefill([Request("e", random_ids(20, VOCAB, 6))])
    with pytest.raises(RequestError, match="'nobody' is unknown"):
        pd_engine.transfer_kv("nobody", receiver.destination("e"))
    with pytest.raises(RequestError, match=r"destination\['rid'\]"):
        pd_engine.transfer_kv("e", {**receiver.destination("x"), "rid": "x"})
    with pytest.raises(RequestError, match="no 'session' key"):
        pd_engine.transfer_kv("e", {k: v for k, v in receiver.destination("e").items() if k != "session"})
    with pytest.raises(RequestError, match=r"destination\['max_tokens'\]"):
        pd_engine.transfer_kv("e", {**receiver.destination("e"), "max_tokens": 8})
    with pytest.raises(RequestError, match=r"destination\['num_kv_heads'\]"):
        pd_engine.transfer_kv("e", {**receiver.destination("e"), "num_kv_heads": 4})
    with pytest.raises(TransferError, match="'e': KV incomplete"):
        receiver.kv("e")                      # nothing was written: the header says so
    pd_engine.release("e")
    for rid in ("e", "x"):
        receiver.free(rid)


def test_transfer_needs_prefill_mode(checkpoint, engines):
    engine = engines.get(checkpoint)
    with pytest.raises(ConfigError, match="--disaggregation-mode prefill"):
        engine.transfer_kv("a", {})


@pytest.mark.parametrize("kwargs,flag", [
    (dict(disaggregation_mode="decode"), "--disaggregation-mode"),
    (dict(disaggregation_transfer_backend="nixl"), "--disaggregation-transfer-backend"),
    (dict(disaggregation_transfer_protocol="ucx"), "--disaggregation-transfer-protocol"),
    (dict(disaggregation_transfer_backend="mooncake_tcp", disaggregation_transfer_protocol="rdma"),
     "--disaggregation-transfer-protocol"),
    (dict(disaggregation_transfer_timeout_s=0), "--disaggregation-transfer-timeout"),
])
def test_bad_pd_flags_name_the_flag(checkpoint, kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(model_path=checkpoint, **kwargs)


def test_pd_cli_flags(checkpoint):
    args = EngineArgs.from_cli(["--model-path", checkpoint, "--disaggregation-mode", "prefill",
                                "--disaggregation-transfer-backend", "mooncake_tcp",
                                "--disaggregation-transfer-timeout", "7"])
    assert args.disaggregation_mode == "prefill" and args.resolved_transfer_protocol() == "tcp"
    assert args.disaggregation_transfer_timeout_s == 7.0


def test_senders_split_heads_layers_and_pages(checkpoint):
    """Attention-TP ranks send their heads (one write per token), pipeline stages and CP ranks their layers,
    pages read in place wherever they lie in the pool: the receiver assembles the whole cache."""
    import torch

    from graphcp.checkpoint.config import read_model_config
    from graphcp.kv import CachePart, PagedPool, RequestKV
    from graphcp.pd.sender import KVSender
    layers, heads, head_dim, page = 2, 2, 32, 4
    tokens = 11
    k_full = torch.randn(layers, heads, tokens, head_dim)
    v_full = torch.randn(layers, heads, tokens, head_dim)
    state = RequestKV(pages=[5, 2, 7], cached_len=tokens)        # scattered pages, the last one partial
    slots = torch.tensor([p * page + i for p in state.pages for i in range(page)][:tokens])
    senders = []
    for tp_rank in range(2):                          # attention TP 2 x pipeline 2: one layer and one head each
        for stage in range(2):
            row = (1, head_dim)                       # one KV head per attention-TP rank
            pool = PagedPool({stage: (CachePart("k", row), CachePart("v", row))}, 8, page, torch.float32,
                             torch.device("cpu"))
            pool.write_kv(stage, slots, k_full[stage, tp_rank:tp_rank + 1].transpose(0, 1),
                          v_full[stage, tp_rank:tp_rank + 1].transpose(0, 1))
            senders.append(KVSender(pool, read_model_config(checkpoint), range(stage, stage + 1), cp_size=1,
                                    cp_rank=0, attn_tp_rank=tp_rank, protocol="tcp", timeout_s=TIMEOUT_S))
    with KVReceiver(checkpoint, max_tokens=16, max_requests=1) as rx:
        destination = rx.destination("s")
        for i, sender in enumerate(senders):
            report = sender.send("s", state, destination)
            assert report["bytes"] == 2 * tokens * head_dim * 4
            if i < len(senders) - 1:
                with pytest.raises(TransferError, match="KV incomplete"):
                    rx.kv("s")                    # parts still missing: the header says which
        got = rx.kv("s")
    for layer, (k, v) in enumerate(got):
        assert k.equal(k_full[layer]) and v.equal(v_full[layer])


def test_pd_bench_cli(checkpoint, tmp_path, capsys):
    import json

    from graphcp.tools.cli import main
    out = tmp_path / "pd.json"
    assert main(["pd-bench", "--model-path", checkpoint, "--tp", "1", "--attn-cp-size", "1", "--tokens", "40", "--reps",
                 "2", "--disable-cuda-graph", "--json", str(out)]) == 0
    case = json.loads(out.read_text())["cases"][0]
    assert case["tokens"] == 40 and case["bytes"] == _kv_bytes(40) and case["sending_ranks"] == 1
    assert case["gb_per_s"] > 0 and case["prefill_end_to_received_ms"] >= case["rank_write_ms"] > 0
    assert "prefill end -> received ms" in capsys.readouterr().out


def test_layer_split_matches_hf_and_holds_its_layers_only(ckpt_dir, engines, oracle):
    """--enable-dsa-cache-layer-split at CP=2 interleave: outputs and KV equal HF (a second chunk fetches the
    prefix of the other rank's layers), each rank holds 2 of 4 layers plus a scratch layer the size of the
    largest batch (about 1/C of the unsplit pool), and each rank sends its own layers."""
    from testkit.hf_reference import make_checkpoint
    from testkit.parity import Session
    path = str(ckpt_dir / "qwen3-4layers")
    if not os.path.isdir(path):
        make_checkpoint(path, "qwen3", num_hidden_layers=4)
    engine = engines.get(path, **cp_kwargs(2, "interleave", disaggregation_mode="prefill",
                                           enable_dsa_cache_layer_split=True))
    s = Session(engine, oracle, path)
    s.run([("p", random_ids(37, VOCAB, 8)), ("q", random_ids(20, VOCAB, 9))])
    s.run([("p", random_ids(29, VOCAB, 10)), ("r", random_ids(11, VOCAB, 11))])     # chunked + fresh
    stats = engine.stats()
    slots = stats["kv_tokens_total"] + 16                                             # + the dummy page
    unsplit = 4 * 2 * slots * 2 * 32 * 4
    # Each rank holds its 2 of 4 layers in full, and a scratch K/V layer grown to the largest batch seen:
    # 7 pages (p's 5 + r's 1 + the dummy), at most half again (growth steps).
    largest = 2 * (3 * 7 * 16 // 2) * 2 * 32 * 4
    scratch = [b - unsplit // 2 for b in stats["kv_bytes_per_rank"]]
    assert all(0 < s <= largest for s in scratch), (scratch, largest)
    assert max(stats["kv_bytes_per_rank"]) / unsplit < 0.51                          # about 1/C
    with KVReceiver(path, max_tokens=128, max_requests=1) as rx:
        report = engine.transfer_kv("p", rx.destination("p"))
        assert report["ranks"] == 2 and report["bytes"] == 4 * 2 * 66 * 2 * 32 * 4
        _, ref = oracle(path, s.history["p"])
        for (k, v), (k_ref, v_ref) in zip(rx.kv("p"), ref):
            assert rel_err(k, k_ref) <= TOL and rel_err(v, v_ref) <= TOL
    s.release_all()
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_layer_split_flag_needs_prefill_interleave_pp1(checkpoint):
    base = dict(model_path=checkpoint, enable_dsa_cache_layer_split=True, **cp_kwargs(2, "interleave"))
    with pytest.raises(ConfigError, match="--disaggregation-mode prefill"):
        EngineArgs(**base)
    with pytest.raises(ConfigError, match="--cp-strategy interleave"):
        EngineArgs(**{**base, "cp_strategy": "zigzag", "disaggregation_mode": "prefill"})
    with pytest.raises(ConfigError, match="--pp 1"):
        EngineArgs(**base, disaggregation_mode="prefill", pp_size=2)


def test_pd_bench_sets_prefill_mode_before_checking_flags(checkpoint, capsys):
    """pd-bench is a prefill worker: --enable-dsa-cache-layer-split is judged with prefill mode already set
    (here it still needs interleave CP, which the error names)."""
    from graphcp.tools.cli import main
    assert main(["pd-bench", "--model-path", checkpoint, "--tp", "1", "--attn-cp-size", "1",
                 "--enable-dsa-cache-layer-split"]) != 0
    err = capsys.readouterr().err
    assert "--cp-strategy interleave" in err and "--disaggregation-mode" not in err

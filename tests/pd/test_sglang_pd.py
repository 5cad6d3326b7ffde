"""An unmodified SGLang decode receives graphcp's KV: graphcp's prefill engine speaks SGLang
0.5.23's PD protocol (bootstrap server, ZMQ control, Mooncake writes into the decode's pages, the
aux row) against a decode harness built from SGLang's own classes in a subprocess
(``tests/scripts/sglang_decode_harness.py``). The received KV equals ``engine.kv_cache`` bitwise and HF's
cache within TOL, the aux row carries the first token and the room, nothing outside the room's
pages changes, and every concluded transfer frees its pages. SGLang's own prefill classes send into
the same harness as a self-check, and SGLang's sampler is the oracle for the first token."""

from __future__ import annotations

import os
import time

import torch
from testkit.engines import cp_kwargs
from testkit.hf_reference import rel_err
from testkit.mla_checkpoint import DEEPSEEK_V3, write_release
from testkit.parity import TOL, random_ids
from testkit.sglang_pd import all_free, bootstrap_addr, check_dense, require_sglang_pd

from graphcp import Request
from graphcp.distributed.procs import free_port
from graphcp.pd.sglang.sampling import SamplingParams, first_token

require_sglang_pd()      # skips the module without Mooncake or SGLang

VOCAB = 211


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
        bootstrap=bootstrap_addr(cp_engine),
        room=7001,
        tokens=len(ids_b),
        out=str(tmp_path / "b.pt"),
    )
    assert reply == {"status": "success", "touched_outside": 0}
    got = torch.load(tmp_path / "b.pt")
    check_dense(got, ours, oracle(checkpoint, ids_b)[1], len(ids_b))
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
        bootstrap=bootstrap_addr(cp_engine),
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
    all_free(cp_engine)


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
        bootstrap=bootstrap_addr(cp_engine),
        room=7003,
        tokens=60,
        out=str(tmp_path / "f.pt"),
    )
    assert reply["status"] == "failed" and "tokenized different prompts" in reply["reason"]
    status = cp_engine.transfer_status("f")
    assert status["state"] == "failed" and "4 pages" in status["reason"]
    all_free(cp_engine)


def test_abort_is_acked_by_every_endpoint_and_frees_the_pages(cp_engine, decode, tmp_path):
    """The decode aborts a room before graphcp prefilled it: all four endpoints it contacted (CP 2
    layer split x attention TP 2) ACK; the later forward concludes failed and frees its pages."""
    reply = decode.ask(
        op="abort",
        decode="dense",
        bootstrap=bootstrap_addr(cp_engine),
        room=7004,
        tokens=40,
        out=str(tmp_path / "x.pt"),
    )
    assert reply == {"status": "acked", "acks": 4}
    cp_engine.prefill([Request("x", random_ids(40, VOCAB, 24), bootstrap_room=7004)])
    all_free(cp_engine)
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
        bootstrap=bootstrap_addr(engine),
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
    all_free(engine)


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
        bootstrap=bootstrap_addr(engine),
        room=7008,
        tokens=len(ids),
        out=str(tmp_path / "s.pt"),
    )
    assert reply == {"status": "success", "touched_outside": 0}
    got = torch.load(tmp_path / "s.pt")
    check_dense(got, ours, oracle(checkpoint, ids)[1], len(ids))
    assert got["aux"]["output_id"] == out.next_token_ids[0] and got["aux"]["room"] == 7008
    all_free(engine)
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
        bootstrap=bootstrap_addr(engine),
        room=7006,
        tokens=20,
        out=str(tmp_path / "g.pt"),
    )
    assert (
        reply["status"] == "failed" and "dtype (2-byte elements on the decode)" in reply["reason"]
    )
    assert "dtype" in engine.transfer_status("g")["reason"]
    all_free(engine)

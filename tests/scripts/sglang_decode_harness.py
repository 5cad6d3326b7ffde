"""An SGLang decode rank's receiving end, built from SGLang's own classes (no graphcp import): the
KV pool SGLang's decode allocates for the checkpoint (``MHATokenToKVPool`` / ``MLATokenToKVPool``
on the CPU, geometry and dtype as SGLang's ``ModelConfig`` resolves them), its ``MetadataBuffers``,
and ``MooncakeKVManager`` in DECODE mode with a ``MooncakeKVReceiver`` per room, wired as
``DecodePreallocQueue._init_kv_manager`` wires them. The prefill under test is whatever answers on
the bootstrap address: graphcp, or SGLang's own prefill classes (``--self-check``).

One process is one decode rank. It reads JSON commands on stdin, one per line, and answers one JSON
line each: ``{"op": "receive", "decode": NAME, "bootstrap": "host:port", "room": R, "tokens": N,
"out": PATH}`` (on the decode instance NAME, built at its first command) allocates pages
(scattered, never page 0), sends the metadata and polls until Success or Failed; the received rows,
the aux row and whether anything outside the room's pages changed go to ``out`` (torch.save).
``{"op": "abort", ...}`` sends the metadata, aborts the room and waits for every ABORT_ACK.
``{"op": "sample", ...}`` runs SGLang's sampler on one row of logits (the first-token oracle).
Run with tests/scripts/sglang_stubs on PYTHONPATH (torchvision), SGLANG_HOST_IP, MOONCAKE_PROTOCOL=tcp,
TRITON_INTERPRET=1 and TORCHDYNAMO_DISABLE=1 (the sampler's kernels on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

SENTINEL = -7.25  # every pool slot starts as this; a write outside the room's pages shows


def publish(args: argparse.Namespace, model_path: str, mode: str = "decode"):
    """The process-wide config SGLang's KV manager reads (not the server_args it is given)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_path,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        device="cpu",
        skip_tokenizer_init=True,
        page_size=args.page_size,
        tp_size=args.tp_size,
        disaggregation_bootstrap_port=args.port,
        port=args.port + 1,
    )
    runtime_context.publish(
        server_args,
        role="scheduler",
        ranks=runtime_context.SpawnRanks(world_rank=args.tp_rank, gpu_id=args.tp_rank),
    )
    runtime_context.get_parallel().override_permanently(pp_group=None)
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )

    init_mooncake_transfer_engine(os.environ["SGLANG_HOST_IP"], args.tp_rank, None)
    return server_args


def build(
    args: argparse.Namespace,
    server_args,
    model_path: str,
    dtype: str,
    mode: str = "decode",
):
    """One decode instance: (manager, pool buffers, metadata buffers). Several may share the
    process (and its Mooncake engine), each talking to its own prefill. ``mode`` "prefill": SGLang's
    own prefill side instead (the self-check)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        MetadataBuffers,
        get_kv_transfer_buf_infos,
        setup_state_kv_args,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    config = ModelConfig(model_path=model_path, dtype=dtype)  # "auto": SGLang's own resolution
    tokens = args.pages * args.page_size
    mla = config.attention_arch.name == "MLA"
    if mla:
        pool = MLATokenToKVPool(
            tokens,
            args.page_size,
            config.dtype,
            config.kv_lora_rank,
            config.qk_rope_head_dim,
            config.num_hidden_layers,
            "cpu",
            False,
        )
        buffers = pool.kv_buffer
    else:
        heads = max(1, config.get_total_num_kv_heads() // args.tp_size)
        pool = MHATokenToKVPool(
            tokens,
            args.page_size,
            config.dtype,
            heads,
            config.head_dim,
            config.num_hidden_layers,
            "cpu",
            False,
        )
        buffers = pool.k_buffer + pool.v_buffer
    for buf in buffers:
        buf.fill_(SENTINEL)
    meta = MetadataBuffers(
        8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=1
    )
    kv_args = KVArgs()
    kv_args.engine_rank = args.tp_rank
    kv_args.pp_rank, kv_args.system_dp_rank = 0, 0
    kv_args.kv_cache_dtype_str, kv_args.kv_layout = "auto", None
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(
        pool
    )
    kv_args.num_draft_entries, kv_args.kv_layer_ids = 0, []
    kv_args.page_size = args.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(kv_args, pool, None, total_kv_layers=config.num_hidden_layers)
    kv_args.ib_device, kv_args.gpu_id = None, args.tp_rank
    kv_args.prefill_start_layer, kv_args.prefill_end_layer = 0, config.num_hidden_layers
    kv_args.kv_head_num = kv_args.total_kv_head_num = 1 if mla else config.get_total_num_kv_heads()
    mgr = MooncakeKVManager(kv_args, DisaggregationMode(mode), server_args, is_mla_backend=mla)
    return mgr, buffers, meta


def pages_for(room: int, count: int, total: int) -> np.ndarray:
    """Scattered pages (never page 0, SGLang's padding page), different per room."""
    rng = np.random.default_rng(room % (1 << 32))
    return (rng.permutation(total - 1)[:count] + 1).astype(np.int32)


def receive(mgr, buffers, meta, cmd: dict, page_size: int, total_pages: int) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    addr, room = cmd["bootstrap"], cmd["room"]
    deadline = time.monotonic() + cmd.get("timeout", 60)
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            return {"status": "no-bootstrap"}
        time.sleep(0.2)
    receiver = MooncakeKVReceiver(mgr, addr, room)
    receiver.init(room % mgr.prefill_info_table[addr].dp_size)
    pages = pages_for(room, -(-cmd["tokens"] // page_size), total_pages)
    aux_index = cmd.get("aux_index", 1)
    meta.clear_slot(aux_index)
    receiver.send_metadata(pages, aux_index)
    if cmd["op"] == "abort":
        receiver.abort()
        required = len(receiver.bootstrap_infos)
        while not mgr.is_abort_release_safe(room, required):
            if time.monotonic() > deadline:
                return {
                    "status": "no-ack",
                    "acks": len(mgr._deferred_abort_ack_tracker[room].prefill_ranks),
                }
            time.sleep(0.05)
        return {"status": "acked", "acks": required}
    while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
        if time.monotonic() > deadline:
            return {"status": "timeout", "poll": int(state)}
        time.sleep(0.02)
    if state == KVPoll.Failed:
        try:
            receiver.failure_exception()
        except Exception as e:
            return {"status": "failed", "reason": str(e)}
    while int(meta.bootstrap_room[aux_index, 0]) == 0:  # the decode's readiness gate
        if time.monotonic() > deadline:
            return {"status": "no-aux"}
        time.sleep(0.01)
    slots = torch.from_numpy(
        (pages[:, None].astype(np.int64) * page_size + np.arange(page_size)).reshape(-1)
    )
    slots = slots[: cmd["tokens"]]
    mask = torch.ones(buffers[0].shape[0], dtype=torch.bool)
    mask[
        torch.from_numpy(
            pages.astype(np.int64)[:, None] * page_size + np.arange(page_size)
        ).reshape(-1)
    ] = False
    touched = sum(int((buf[mask] != SENTINEL).any(dim=-1).sum()) for buf in buffers)
    rows = [buf[slots].clone() for buf in buffers]
    for buf in buffers:  # the pages are free again for the next room
        buf[~mask] = SENTINEL
    aux = {
        "output_id": int(meta.output_ids[aux_index, 0]),
        "room": int(meta.bootstrap_room[aux_index, 0]),
        "cached_tokens": meta.cached_tokens[aux_index].tolist(),
        "logprob": float(meta.output_token_logprobs_val[aux_index, 0]),
        "top_logprobs": meta.output_top_logprobs_val[aux_index].tolist(),
        "top_ids": meta.output_top_logprobs_idx[aux_index].tolist(),
    }
    torch.save({"rows": rows, "aux": aux}, cmd["out"])
    receiver.clear()
    return {"status": "success", "touched_outside": touched}


def sample(cmd: dict) -> dict:
    """SGLang's own sampler functions on one row of logits (its seeded path, the MurmurHash Triton
    kernel run by Triton's interpreter): the oracle for graphcp's first token."""
    import sglang.srt.layers.sampler as sampler
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel

    def murmur(seed: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        out = torch.empty((seed.shape[0], columns.shape[0]), dtype=torch.uint32)
        grid = (seed.shape[0], -(-columns.shape[0] // 1024))
        murmur_hash32_kernel[grid](
            seed, positions, columns, out, seed.shape[0], columns.shape[0], BLOCK_SIZE=1024
        )
        return out

    sampler.murmur_hash32 = murmur  # its CPU path needs sgl_kernel, not installed here
    logits = torch.tensor([cmd["logits"]], dtype=torch.float32)
    p = cmd["params"]
    if p["temperature"] < 1e-6 or p["top_k"] == 1:
        return {"token": int(torch.argmax(logits, -1))}
    probs = torch.softmax(logits / p["temperature"], dim=-1)
    seed, position = torch.tensor([p["seed"]]), torch.tensor([cmd["position"]])
    if p["top_k"] == -1 and p["top_p"] >= 1.0 and p["min_p"] <= 0:
        token = sampler.sampling_from_probs_torch(probs, sampling_seed=seed, positions=position)
    else:
        top_k = torch.tensor([p["top_k"] if p["top_k"] != -1 else 1 << 30])
        token = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
            probs,
            top_k,
            torch.tensor([p["top_p"]]),
            torch.tensor([p["min_p"]]),
            False,
            seed,
            position,
        )
    return {"token": int(token[0])}


def self_check_prefill(args: argparse.Namespace, model_path: str, dtype: str) -> None:
    """SGLang's own prefill (bootstrap server, MooncakeKVManager in PREFILL mode, MooncakeKVSender)
    sends one room from a pool of random rows: ``{"room": R, "tokens": N, "out": PATH}`` on stdin;
    the rows it sent go to ``out``. If graphcp and this disagree with the harness after an SGLang
    upgrade, this shows which side broke."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer, MooncakeKVSender

    server_args = publish(args, model_path, "prefill")
    MooncakeKVBootstrapServer(host="127.0.0.1", port=args.port)
    mgr, buffers, meta = build(args, server_args, model_path, dtype, "prefill")
    generator = torch.Generator().manual_seed(5)
    for buf in buffers:
        buf.copy_(torch.randn(buf.shape, generator=generator).to(buf.dtype))
    print(json.dumps({"ready": True}), flush=True)
    cmd = json.loads(sys.stdin.readline())
    room, tokens, ps = cmd["room"], cmd["tokens"], args.page_size
    sender = MooncakeKVSender(mgr, f"127.0.0.1:{args.port}", room)
    deadline = time.monotonic() + 60
    while sender.poll() != KVPoll.WaitingForInput and time.monotonic() < deadline:
        time.sleep(0.02)
    pages = pages_for(room + 1, -(-tokens // ps), args.pages)
    meta.output_ids[2, 0], meta.bootstrap_room[2, 0] = cmd["first_token"], room
    sender.init(len(pages), 2)
    sender.send(pages)
    while (state := sender.poll()) not in (
        KVPoll.Success,
        KVPoll.Failed,
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    slots = torch.from_numpy((pages[:, None].astype(np.int64) * ps + np.arange(ps)).reshape(-1))[
        :tokens
    ]
    torch.save({"rows": [buf[slots].clone() for buf in buffers]}, cmd["out"])
    print(
        json.dumps({"status": "success" if state == KVPoll.Success else f"poll {int(state)}"}),
        flush=True,
    )
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        help="NAME=MODEL_PATH:DTYPE, a decode instance (built at its first command)",
    )
    parser.add_argument("--port", type=int, required=True, help="this decode's own bootstrap port")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument(
        "--self-check-prefill",
        action="store_true",
        help="be SGLang's own prefill for the first --decode model instead",
    )
    args = parser.parse_args()
    specs = {name: spec.rsplit(":", 1) for name, spec in (d.split("=", 1) for d in args.decode)}
    if args.self_check_prefill:
        self_check_prefill(args, *next(iter(specs.values())))
    server_args = publish(args, next(iter(specs.values()))[0])
    instances: dict = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "sample":
            print(json.dumps(sample(cmd)), flush=True)
            continue
        name = cmd["decode"]
        if name not in instances:
            instances[name] = build(args, server_args, *specs[name])
        reply = receive(*instances[name], cmd, args.page_size, args.pages)
        print(json.dumps(reply), flush=True)
    sys.stdout.flush()
    os._exit(0)  # SGLang's manager threads never return


if __name__ == "__main__":
    main()

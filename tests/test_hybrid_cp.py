"""Zigzag CP of the linear-attention layers over real gloo groups: one spawn of 4 ranks checks a
group of 2 (ranks 0 and 1), then the group of 4.

Each rank holds only its zigzag rows (``graphcp.cp.build_layout``) and runs the hand-off op
(graphcp/attention/linear_cp.py). Checked on every rank:
- the op alone against the single-rank recurrence on the whole batch: its rows' outputs and every
  request's final conv window and delta state, over a fresh batch (one request shorter than 2C) and
  a batch of continued requests (their cached states) beside a fresh one;
- the Qwen3-Next model against HF logits at each of its rows and HF's final linear caches, through
  a fresh batch and a chunked continuation, with a gathering stand-in for the full-attention layers;
- the op captured under the CPU capture emulation (its two exchanges are breaks under gloo) replays
  another batch as its eager call computes it.
"""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hybrid_reference import (ByKind, GatheredFullAttention, HybridHF, StateSlots,
                              graph_equals_eager, make_hybrid_checkpoint, rel_err)

from graphcp.attention.linear_cp import ZigzagLinearAttention, exchange_bytes
from graphcp.attention.linear_op import LocalLinearAttention, RequestStates
from graphcp.cp import build_layout
from graphcp.dist.comm import CPComm
from graphcp.forward_context import forward_context
from graphcp.models import load_model

TOL = 1e-4
OP_BATCHES = [[("0", 37), ("1", 5), ("2", 64)],        # fresh; "1" leaves blocks empty at C = 4
              [("0", 29), ("2", 3), ("3", 50)]]        # "0", "2" continue, "3" is fresh
LENGTHS = {"a": 190, "b": 57, "c": 3}
MODEL_BATCHES = [[("a", 0, 130), ("b", 0, 57)], [("a", 130, 190), ("c", 0, 3)]]


def _tokens() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {rid: torch.randint(0, 211, (n,), generator=gen).tolist() for rid, n in LENGTHS.items()}


def _zigzag(world: int, rank: int, lens: list[int], prefix: list[int]):  # noqa: ANN202
    """(this rank's token indices, every request's 2C block lengths, the local row capacity)."""
    layouts = [build_layout("zigzag", world, r, lens, prefix) for r in range(world)]
    early = [layout.q_lens_early for layout in layouts]          # block r of each request
    late = [layout.q_lens_late for layout in reversed(layouts)]   # blocks C .. 2C-1
    blocks = [[lens_q[q] for lens_q in early + late] for q in range(len(lens))]
    assert [sum(b) for b in blocks] == lens
    return layouts[rank].local_indices, torch.tensor(blocks), max(layouts[0].per_rank_tokens)


def _rows(full: torch.Tensor, index: list[int], cap: int, fill: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``full``, then padding rows of ``fill`` up to ``cap``."""
    out = fill[:cap].clone()
    out[:len(index)] = full[torch.tensor(index, dtype=torch.int64)]
    return out


def _op_check(model, comm: CPComm) -> dict:  # noqa: ANN001
    mixer = model.model.layers["0"].linear_attn
    h = model.config.hybrid
    pools = [StateSlots(model.config, [0]) for _ in range(2)]
    gen, cached, worst = torch.Generator().manual_seed(7), {}, {"rows": 0.0, "states": 0.0}
    for batch in OP_BATCHES:
        rids, lens = [r for r, _ in batch], [n for _, n in batch]
        prefix = [cached.get(r, 0) for r in rids]
        inputs = [torch.randn(sum(lens), h.conv_dim, generator=gen),
                  -0.3 * torch.rand(sum(lens), h.num_v_heads, generator=gen),
                  torch.rand(sum(lens), h.num_v_heads, generator=gen)]
        rows = torch.arange(sum(lens))
        ref = LocalLinearAttention(pools[0].states(rids), torch.tensor(lens)[:, None], rows,
                                   torch.ones_like(rows), sum(lens))(0, *inputs, mixer=mixer)
        index, blocks, cap = _zigzag(comm.size, comm.rank, lens, prefix)
        garbage = [torch.randn((cap,) + x.shape[1:], generator=gen) for x in inputs]
        local = [_rows(x, index, cap, fill) for x, fill in zip(inputs, garbage)]
        op = ZigzagLinearAttention(pools[1].states(rids), blocks, comm, cap)
        mine = blocks[:, [comm.rank, 2 * comm.size - 1 - comm.rank]]
        assert op.max_len == max(int(mine.max()), 1)     # eagerly: this rank's longest block
        out = op(0, *local, mixer=mixer)
        assert op.num_exchanges == 2 and not out[len(index):].any()
        dims = (h.conv_kernel, h.conv_dim, h.num_v_heads, h.head_k_dim, h.head_v_dim)
        assert op.bytes_received == exchange_bytes(len(rids), comm.size, dims, conv_bytes=4)
        worst["rows"] = max(worst["rows"], rel_err(out[:len(index)], ref[index]))
        for r in rids:
            mine, theirs = pools[1].request_state(r)[0], pools[0].request_state(r)[0]
            worst["states"] = max(worst["states"], rel_err(mine[0], theirs[0]),
                                  rel_err(mine[1], theirs[1]))
        cached.update({r: p + n for r, p, n in zip(rids, prefix, lens)})
    return worst


def _graph_check(model, comm: CPComm) -> dict:  # noqa: ANN001
    mixer, h = model.model.layers["2"].linear_attn, model.config.hybrid
    pool = StateSlots(model.config, [2]).pool
    gen, batches = torch.Generator().manual_seed(11), ([37, 5, 64], [50, 20, 9])
    layouts = [_zigzag(comm.size, comm.rank, lens, [0] * 3) for lens in batches]
    cap = max(c for _, _, c in layouts)
    inputs = [torch.empty(cap, h.conv_dim), torch.empty(cap, h.num_v_heads),
              torch.empty(cap, h.num_v_heads)]
    block_lens, state_in, state_out = (layouts[0][1].clone(), torch.tensor([0, 2, 0]),
                                       torch.tensor([1, 2, 3]))
    ops = []

    def fill() -> None:
        for t in inputs:
            t.copy_(torch.rand(t.shape, generator=gen))
        inputs[1].mul_(-0.3)

    def next_batch() -> None:
        fill()
        block_lens.copy_(layouts[1][1])
        state_in.copy_(torch.tensor([3, 0, 2]))
        state_out.copy_(torch.tensor([3, 1, 2]))

    def make_op() -> ZigzagLinearAttention:
        ops.append(ZigzagLinearAttention(RequestStates(pool, state_in, state_out), block_lens, comm,
                                         cap))
        return ops[-1]

    fill()
    tensors = [pool.part(2, "conv"), pool.part(2, "recurrent")]
    err = graph_equals_eager(make_op, mixer, inputs, tensors, next_batch)
    # warmup, eager: two exchanges each; the captured op's two also run again at the replay
    assert [op.num_exchanges for op in ops] == [2, 4, 2]
    return {"replay": err}


def _model_check(model, comm: CPComm, reference: dict) -> dict:  # noqa: ANN001
    h = model.config.hybrid
    pool = StateSlots(model.config, h.linear_layers)
    kv, tokens, worst = {}, _tokens(), {"logits": 0.0, "states": 0.0}
    for batch in MODEL_BATCHES:
        rids = [r for r, _, _ in batch]
        lens, prefix = [e - s for _, s, e in batch], [s for _, s, _ in batch]
        ids = torch.tensor([t for r, s, e in batch for t in tokens[r][s:e]])
        positions = torch.cat([torch.arange(s, e) for _, s, e in batch])
        requests = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        index, blocks, cap = _zigzag(comm.size, comm.rank, lens, prefix)
        pad = torch.full((cap,), -1)
        row_req, row_pos = _rows(requests, index, cap, pad), _rows(positions, index, cap, pad)
        ops = ByKind(h.linear_layers, ZigzagLinearAttention(pool.states(rids), blocks, comm, cap),
                     GatheredFullAttention(kv, comm.group, rids, row_req, row_pos))
        with forward_context(ops):
            hidden = model(_rows(ids, index, cap, pad.clamp(min=0)), row_pos.clamp(min=0))
            logits = model.compute_logits(hidden)[:len(index)]
        theirs = torch.stack([reference[rids[q]][0][p] for q, p in
                              zip(row_req[:len(index)].tolist(), row_pos[:len(index)].tolist())])
        worst["logits"] = max(worst["logits"], rel_err(logits, theirs))
    for rid in LENGTHS:
        states, ref_caches = pool.request_state(rid), reference[rid][1]
        for layer, (window, state) in states.items():
            worst["states"] = max(worst["states"], rel_err(window, ref_caches[layer][0]),
                                  rel_err(state, ref_caches[layer][1]))
    return worst


def _rank_main(rank: int, world: int, port: int, ckpt: str, ref_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1])          # every rank takes part in creating it
        model = load_model(ckpt, torch.float32, torch.device("cpu"))
        reference = torch.load(ref_path)
        groups = [(pair, 2), (None, world)] if rank < 2 else [(None, world)]
        for group, size in groups:
            comm = CPComm(group, size, rank)
            with torch.no_grad():
                result = {"op": _op_check(model, comm), "graph": _graph_check(model, comm),
                          "model": _model_check(model, comm, reference)}
            with open(os.path.join(out_dir, f"C{size}_rank{rank}.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hybrid_case(tmp_path_factory):
    """A Qwen3-Next checkpoint (dense and MoE FFNs) and HF's logits and caches for each request."""
    root = tmp_path_factory.mktemp("hybrid_cp")
    path = make_hybrid_checkpoint(str(root / "qwen3_next"), "qwen3_next", seed=2)
    hf = HybridHF(path)
    ref_path = str(root / "reference.pt")
    torch.save({rid: hf.run(ids) for rid, ids in _tokens().items()}, ref_path)
    return path, ref_path, root


def test_zigzag_linear_handoff_equals_one_rank(hybrid_case):
    path, ref_path, out_dir = hybrid_case
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(4, port, path, ref_path, str(out_dir)), nprocs=4)
    for size in (2, 4):
        for rank in range(size):
            result = json.loads((out_dir / f"C{size}_rank{rank}.json").read_text())
            print(f"C={size} rank {rank}: " + ", ".join(
                f"{part} {key} {err:.1e}" for part, errs in result.items()
                for key, err in errs.items()))
            for part, errs in result.items():
                assert all(err <= TOL for err in errs.values()), (size, rank, part, errs)

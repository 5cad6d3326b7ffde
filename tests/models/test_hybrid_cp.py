"""Zigzag CP of the linear-attention op over a real gloo group of 2 ranks.

Each rank holds only its zigzag rows (``graphcp.cp.build_layout``) and runs the hand-off op
(graphcp/attention/linear_cp.py). Checked on every rank:
- the op alone against the single-rank recurrence on the whole batch: its rows' outputs and every
  request's final conv window and delta state, over a fresh batch (one request shorter than 2C, so
  a block is empty) and a batch of continued requests (their cached states) beside a fresh one;
  the bytes it receives against ``exchange_bytes``;
- the op captured under the CPU capture emulation (its two exchanges are breaks under gloo) replays
  another batch as its eager call computes it.
The models end to end under CP 2 and 4, graphs included, against HF: tests/models/test_hybrid_engine.py.
"""
from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testkit.hybrid_reference import StateSlots, graph_equals_eager, make_hybrid_checkpoint, rel_err

from graphcp.attention.linear_cp import ZigzagLinearAttention, exchange_bytes
from graphcp.attention.linear_op import LocalLinearAttention, RequestStates
from graphcp.checkpoint.loader import load_model
from graphcp.cp import build_layout
from graphcp.distributed.comm import CPComm

TOL = 1e-4
OP_BATCHES = [[("0", 37), ("1", 3), ("2", 64)],        # fresh; "1" leaves its last block empty
              [("0", 29), ("2", 3), ("3", 50)]]        # "0", "2" continue, "3" is fresh


def _zigzag(world: int, rank: int, lens: list[int], prefix: list[int]):
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


def _op_check(model, comm: CPComm) -> dict:
    mixer = model.model.layers["0"].linear_attn
    h = model.config.family_config
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
                                   torch.ones_like(rows))(0, *inputs, mixer=mixer)
        index, blocks, cap = _zigzag(comm.size, comm.rank, lens, prefix)
        garbage = [torch.randn((cap,) + x.shape[1:], generator=gen) for x in inputs]
        local = [_rows(x, index, cap, fill) for x, fill in zip(inputs, garbage)]
        op = ZigzagLinearAttention(pools[1].states(rids), blocks, comm, cap)
        mine = blocks[:, [comm.rank, 2 * comm.size - 1 - comm.rank]]
        needed = int(((mine + 63) // 64).sum())           # eagerly: the chunks its blocks need
        assert op.layout.seq.shape[0] == max(needed, 1)
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


def _graph_check(model, comm: CPComm) -> dict:
    mixer, h = model.model.layers["2"].linear_attn, model.config.family_config
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


def _rank_main(rank: int, world: int, port: int, ckpt: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load_model(ckpt, torch.float32, torch.device("cpu"))
        comm = CPComm(None, world, rank)
        with torch.no_grad():
            result = {"op": _op_check(model, comm), "graph": _graph_check(model, comm)}
        with open(os.path.join(out_dir, f"C{world}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_zigzag_linear_handoff_equals_one_rank(tmp_path):
    path = make_hybrid_checkpoint(str(tmp_path / "qwen3_next"), "qwen3_next", seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, path, str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = json.loads((tmp_path / f"C2_rank{rank}.json").read_text())
        print(f"C=2 rank {rank}: " + ", ".join(f"{part} {key} {err:.1e}"
                                               for part, errs in result.items()
                                               for key, err in errs.items()))
        for part, errs in result.items():
            assert all(err <= TOL for err in errs.values()), (rank, part, errs)

"""MoE token flows (SPEC section 10): how each rank's CP-local rows meet experts spread over the TP
world.

Experts are split over ``ep`` ranks (the ``tp / ep`` adjacent ranks of EP rank ``tp_rank // (tp /
ep)`` hold experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``), each expert split over those
``expert_tp = tp / ep`` ranks along its intermediate dimension. Two flows:

- ``none``: all-gather every rank's rows over the TP world, run the local experts (and expert-TP
  slice) on all of them, reduce-scatter the partial sums back to each rank's own rows: the dense
  FFN's layer communicator. On NCCL these collectives and the Triton expert kernel are captured.
- ``all_to_all``: each rank routes its own real rows (padding rows are never sent), sends each
  (row, expert) pair to the ranks holding that expert with one all-to-all (after exchanging the
  per-destination counts), runs its experts, and returns the outputs with a second all-to-all; the
  sender applies the routing weights.

A block may give a per-row integer (DeepSeek V4's hash-routed layers: each row's token id) that the
router needs: ``none`` gathers it with the rows; under ``all_to_all`` each rank routes its own rows,
so the ids stay beside them.

The all-to-all's split sizes depend on the routing and must be known on the host, so the exchange is
a graph break on every backend, NCCL included. The capturable alternative, a fixed-capacity
exchange, must size each destination's buffer for the worst case (all of a rank's pairs to one
rank: ``tp`` times the real bytes) or drop tokens past a capacity factor, which changes results.
graphcp keeps exact results and real byte counts, and pays one host sync per MoE layer, which is
small next to a prefill's expert GEMMs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from graphcp.distributed.comm import FFNCommunicator, all_gather_into
from graphcp.forward_context import current_valid_rows, route
from graphcp.graph.protocol import capture_active, graph_break
from graphcp.profiling import nvtx_range


class MoETraffic:
    """What one rank's MoE token flow moved, counted from the tensors it hands to the collectives:
    bytes per collective (sent to other ranks), MoE layer calls, and the (row, expert) pairs of
    this rank's real rows per EP rank (the expert load). Counted in eager forwards; a graph replay
    runs no Python outside its breaks, so there only the all-to-all (a break) counts. ``graphcp
    bench`` measures eager forwards.

    Byte counts come from shapes (host ints); the expert load accumulates in a device tensor, read
    only when the stats are asked (``as_dict``), so counting never syncs the host."""

    def __init__(self, ep_size: int, experts_per_rank: int) -> None:
        self.ep_size, self.experts_per_rank = ep_size, experts_per_rank
        self.bytes: dict[str, int] = {}
        self.layer_calls = 0
        self.load: torch.Tensor | None = None     # [ep_size] int64 pairs, on the ids' device
        self.pairs_sent = 0      # all_to_all: pairs dispatched (real rows x top-k x expert TP)

    def add_bytes(self, name: str, nbytes: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + int(nbytes)

    def add_load(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """ids [rows, k] (or [pairs]) routed experts; keep [rows] (or [pairs]): nonzero where the
        row counts (a real row, one copy of a pair), None: every row."""
        ranks = (ids // self.experts_per_rank).reshape(-1)
        if keep is None:
            counted = torch.ones_like(ranks)
        else:
            keep = keep[:, None].expand_as(ids) if ids.dim() == 2 else keep
            counted = (keep != 0).reshape(-1).to(ranks.dtype)
        if self.load is None or self.load.device != ranks.device:
            self.load = torch.zeros(self.ep_size, dtype=torch.long, device=ranks.device)
        self.load.scatter_add_(0, ranks, counted)

    @property
    def pairs_per_ep_rank(self) -> list[int]:
        """The expert load per EP rank (one host read)."""
        return [0] * self.ep_size if self.load is None else self.load.tolist()

    def as_dict(self) -> dict:
        return {"bytes": dict(self.bytes), "layer_calls": self.layer_calls,
                "pairs_per_ep_rank": self.pairs_per_ep_rank, "pairs_sent": self.pairs_sent}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GatherScatterMoE:
    """``--moe-a2a-backend none``: the dense FFN's gather / reduce-scatter around local experts."""

    def __init__(self, layout: FFNCommunicator, traffic: MoETraffic, counts_load: bool) -> None:
        self.layout, self.traffic = layout, traffic
        self.counts_load = counts_load       # one rank per attention-TP group counts its rows' load

    def run(self, x: torch.Tensor, router: Callable, experts: Callable,
            row_ids: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        everyone = self.layout.gather(x)
        everyone_ids = None if row_ids is None else self.layout.gather(row_ids)
        weights, ids = route(router, everyone, everyone_ids)
        partial = experts(everyone, ids, weights)
        if not capture_active():
            self._count(x, ids, partial, rows)
        return self.layout.scatter(partial, rows)

    def _count(self, x: torch.Tensor, ids: torch.Tensor, partial: torch.Tensor, rows: int) -> None:
        t, layout = self.traffic, self.layout
        t.layer_calls += 1
        others = (layout.tp_size - 1) / layout.tp_size
        t.add_bytes("all_gather", _nbytes(x) * (layout.tp_size - 1))      # my rows, to every peer
        # The reduce-scatter takes one block per rank (attention-TP peers get copies of one block);
        # every block but my own leaves this rank.
        t.add_bytes("reduce_scatter", _nbytes(partial) * layout.attn_tp_size * others)
        if self.counts_load:
            t.add_load(ids[layout.block * rows:(layout.block + 1) * rows], current_valid_rows())


class AllToAllMoE:
    """``--moe-a2a-backend all_to_all``: dispatch and combine, two all-to-alls over the TP world.

    Attention-TP peers hold the same rows: each dispatches an equal share of them and the peers
    all-gather the combined rows afterwards, so no row is sent twice."""

    def __init__(self, group: dist.ProcessGroup | None, tp_size: int, tp_rank: int,
                 experts_per_rank: int, expert_tp: int, attn_tp_group: dist.ProcessGroup | None,
                 attn_tp_size: int, attn_tp_rank: int, traffic: MoETraffic) -> None:
        self.group, self.tp_size, self.tp_rank = group, tp_size, tp_rank
        self.experts_per_rank, self.expert_tp = experts_per_rank, expert_tp
        self.attn_tp_group, self.attn_tp_size = attn_tp_group, attn_tp_size
        self.attn_tp_rank, self.traffic = attn_tp_rank, traffic

    def run(self, x: torch.Tensor, router: Callable, experts: Callable,
            row_ids: torch.Tensor | None = None) -> torch.Tensor:
        rows, hidden = x.shape
        valid = current_valid_rows()
        valid = x.new_ones(rows, dtype=torch.long) if valid is None else valid
        if self.attn_tp_size > 1:
            share = -(-rows // self.attn_tp_size)
            pad = share * self.attn_tp_size - rows
            mine = slice(self.attn_tp_rank * share, (self.attn_tp_rank + 1) * share)
            x = nn.functional.pad(x, (0, 0, 0, pad))[mine]
            valid = nn.functional.pad(valid, (0, pad))[mine]
            row_ids = None if row_ids is None else nn.functional.pad(row_ids, (0, pad))[mine]
        weights, ids = route(router, x, row_ids)   # each rank routes its own rows, ids beside them
        out = x.new_empty(x.shape)
        _dispatch_combine(self, out, x, ids, weights, valid, experts)
        if self.attn_tp_size == 1:
            return out
        full = out.new_empty((self.attn_tp_size * out.shape[0], hidden))
        all_gather_into(full, out, self.attn_tp_group)
        if not capture_active():
            self.traffic.add_bytes("attn_tp_all_gather", _nbytes(out) * (self.attn_tp_size - 1))
        return full[:rows]


@graph_break(collective=True)
def _dispatch_combine(comm: AllToAllMoE, out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, valid: torch.Tensor,
                      experts: Callable) -> torch.Tensor:
    with nvtx_range("moe_all_to_all"):
        k, etp, n = ids.shape[1], comm.expert_tp, ids.shape[0]
        rows = torch.arange(n, device=x.device).repeat_interleave(k * etp)
        expert = ids.reshape(-1).repeat_interleave(etp)
        weight = weights.reshape(-1).repeat_interleave(etp)
        peer = torch.arange(etp, device=x.device).repeat(n * k)
        # padding rows' pairs sort past every rank and are cut once the counts are on the host
        dest = torch.where(valid.index_select(0, rows) != 0,
                           expert // comm.experts_per_rank * etp + peer, comm.tp_size)
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=comm.tp_size + 1)[:comm.tp_size]
        recv_counts = torch.empty_like(send_counts)
        _all_to_all(recv_counts, send_counts, None, None, comm.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()     # the layer's one host sync
        order = order[:sum(send)]
        rows, expert, weight, peer = rows[order], expert[order], weight[order], peer[order]
        send_x = x.index_select(0, rows)
        recv_x = x.new_empty((sum(recv), x.shape[1]))
        _all_to_all(recv_x, send_x, recv, send, comm.group)
        recv_expert = expert.new_empty(sum(recv))
        _all_to_all(recv_expert, expert, recv, send, comm.group)
        y = experts(recv_x, recv_expert[:, None], recv_x.new_ones((recv_x.shape[0], 1)))
        back = x.new_empty(send_x.shape)
        _all_to_all(back, y, send, recv, comm.group)
        _count(comm, peer == 0, send, recv, send_x, expert, y)
        out.zero_()
        return out.index_add_(0, rows, back * weight[:, None])


def _count(comm: AllToAllMoE, first_copy: torch.Tensor, send: list[int], recv: list[int],
           send_x: torch.Tensor, expert: torch.Tensor, y: torch.Tensor) -> None:
    """Bytes that left this rank (rows to itself stay): counts, rows and ids out, outputs back;
    the load of each pair once (``first_copy``: expert-TP rank 0's copy), on the device."""
    t, me = comm.traffic, comm.tp_rank
    t.layer_calls += 1
    t.pairs_sent += send_x.shape[0]
    row = send_x.shape[1] * send_x.element_size()
    t.add_bytes("all_to_all_dispatch", (sum(send) - send[me]) * (row + expert.element_size())
                + 8 * (comm.tp_size - 1))
    t.add_bytes("all_to_all_combine", (sum(recv) - recv[me]) * y.shape[1] * y.element_size())
    t.add_load(expert, first_copy)


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                in_splits: list[int] | None, group: dist.ProcessGroup | None) -> None:
    """all_to_all_single; under gloo, CUDA tensors travel through host memory."""
    if out.is_cuda and dist.get_backend(group) != "nccl":
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host, inp.cpu().contiguous(), out_splits, in_splits, group=group)
        out.copy_(host)
        return
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)


def moe_communicator(args, num_experts: int, groups, tp_rank: int,
                     attn_tp_rank: int):
    """This rank's MoE token flow (None on a one-rank TP world: every expert is local)."""
    if args.tp_size == 1:
        return None
    per = num_experts // args.ep_size
    traffic = MoETraffic(args.ep_size, per)
    if args.moe_a2a_backend == "all_to_all":
        return AllToAllMoE(groups.tp, args.tp_size, tp_rank, per, args.expert_tp_size,
                           groups.attn_tp, args.attn_tp_size, attn_tp_rank, traffic)
    atp = args.attn_tp_size
    layout = FFNCommunicator(groups.tp, args.tp_size, atp, tp_rank // atp)
    return GatherScatterMoE(layout, traffic, counts_load=attn_tp_rank == 0)

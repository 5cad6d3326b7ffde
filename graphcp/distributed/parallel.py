"""One rank's place in the parallel layout, resolved once at start: its groups, its collectives, the
tensor-parallel slices its layers load, and its pipeline stage's layers."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from graphcp.config import EngineArgs
from graphcp.distributed.comm import CPComm, FFNCommunicator, all_reduce
from graphcp.distributed.moe_comm import moe_communicator
from graphcp.distributed.shards import EPInfo, TPInfo, pipeline_stage
from graphcp.distributed.topology import Groups, RankInfo, build_groups, expert_place, rank_info, rank_of
from graphcp.forward_context import MoECommunicator


class ModelShape(Protocol):
    """What the layout reads of a model (a ``models.config.ModelConfig``)."""
    num_hidden_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]


@dataclass
class RankParallel:
    me: RankInfo
    groups: Groups
    comm: CPComm | None                    # the attention CP group's collectives
    attn_tp: TPInfo                        # heads and the vocabulary are split over attention TP
    ffn_tp: TPInfo                         # the dense FFN's split (the TP world by default)
    communicator: FFNCommunicator | None   # moves rows between the attention and the FFN layout
    ep: EPInfo                             # which experts (EP rank) and which slice of them (expert TP)
    moe_comm: MoECommunicator | None       # brings rows to their experts (MoE models)
    layers: range                          # this pipeline stage's layers
    first_stage: bool
    last_stage: bool
    ranks_per_device: int                  # ranks of this host sharing this rank's device
    device: torch.device
    cp_ranks: list[int]                    # global ranks of this rank's CP group, by CP rank

    @classmethod
    def build(cls, args: EngineArgs, rank: int, cfg: ModelShape, device: torch.device) -> "RankParallel":
        me = rank_info(args, rank)
        groups = build_groups(args, me) if args.world_size > 1 else Groups(None, None)
        atp = args.attn_tp_size
        comm = CPComm(groups.cp, args.cp_size, me.cp_rank) if args.cp_size > 1 else None
        shards = rank_shards(args, cfg, rank, groups)
        tp_rank = rank % args.tp_size
        wide = shards.ffn_tp.size > atp
        communicator = FFNCommunicator(groups.tp, args.tp_size, atp, tp_rank // atp) if wide else None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
        moe = moe_communicator(args, cfg.num_experts, groups, tp_rank, me.attn_tp_rank) if cfg.moe_layers else None
        return cls(me, groups, comm, shards.attn_tp, shards.ffn_tp, communicator, shards.ep, moe, shards.layers,
                   me.pp_rank == 0, me.pp_rank == args.pp_size - 1, ranks_per_device(device, local_world), device,
                   [rank_of(args, me.pp_rank, me.dp_rank, c, me.attn_tp_rank) for c in range(args.cp_size)])

    def average(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of ``values`` over every rank."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return values
        t = values.to(self.device)
        all_reduce(t, None)
        return (t / torch.distributed.get_world_size()).cpu()

    def min_over_world(self, value: int) -> int:
        """The smallest ``value`` over every rank (pool sizes must agree everywhere)."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    def all_ranks_agree(self, ok: bool) -> bool:
        """All-rank AND over the TP world, CP and attention-TP ranks alike (graph capture keeps the
        same buckets on every rank that meets in a collective)."""
        if self.groups.tp is None:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.long, device=self.device)
        all_reduce(flag, self.groups.tp)
        return int(flag.item()) == 0


@dataclass(frozen=True)
class RankShards:
    """What a rank's model holds: its heads and vocabulary (attention TP), its slice of the dense
    FFN, its experts and their slice, its pipeline stage's layers."""
    attn_tp: TPInfo
    ffn_tp: TPInfo
    ep: EPInfo
    layers: range


def rank_shards(args: EngineArgs, cfg: ModelShape, rank: int, groups: Groups | None = None) -> RankShards:
    """A rank's shards from the flags alone (``graphcp memory`` builds every rank's model from
    them without a process group; ``groups`` attaches the collectives at start)."""
    groups = groups or Groups(None, None)
    me = rank_info(args, rank)
    attn_tp = TPInfo(args.attn_tp_size, me.attn_tp_rank, groups.attn_tp)
    # The dense FFN is split over the whole TP world by default; when that is wider than attention TP,
    # a layer communicator gathers every CP/DP rank's tokens before it and hands each rank its rows after.
    wide = args.resolved_ffn_tp_size > args.attn_tp_size
    ffn_tp = TPInfo(args.tp_size, rank % args.tp_size, groups.tp) if wide else attn_tp
    layers = range(*pipeline_stage(cfg.num_hidden_layers, args.pp_size, me.pp_rank))
    # MoE: experts split over EP ranks of the TP world, each over expert TP (see distributed/moe_comm.py).
    ep_rank, expert_tp_rank = expert_place(args, rank)
    return RankShards(attn_tp, ffn_tp, EPInfo(args.ep_size, ep_rank, args.expert_tp_size, expert_tp_rank),
                      layers)


def ranks_per_device(device: torch.device, local_world_size: int) -> int:
    """Ranks of this host that share ``device``: every rank on CPU; on CUDA, ranks map round-robin onto
    the visible GPUs (local rank % device count)."""
    if device.type != "cuda":
        return local_world_size
    return -(-local_world_size // max(1, torch.cuda.device_count()))

"""The rank map, in one place: TP world = DP x attention CP x attention TP, repeated per pipeline stage.

rank = pp_rank * tp + dp_rank * (cp * attn_tp) + cp_rank * attn_tp + attn_tp_rank. Ranks of one attention TP
group hold the same tokens (different heads); ranks of one CP group hold different tokens of the same
requests; DP groups hold different requests; pipeline stages hold different layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from graphcp.config import EngineArgs


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    attn_tp_rank: int

    @property
    def is_output(self) -> bool:
        """The rank of its pipeline stage that answers for its DP group: its first CP and attention-TP rank.
        (The engine takes the answers of the last stage's output ranks: ``ModelRunner.answers``.)"""
        return self.cp_rank == 0 and self.attn_tp_rank == 0


def rank_info(args: EngineArgs, rank: int) -> RankInfo:
    atp, cp = args.attn_tp_size, args.cp_size
    pp_rank, tp_rank = divmod(rank, args.tp_size)
    dp_rank, rest = divmod(tp_rank, cp * atp)
    cp_rank, atp_rank = divmod(rest, atp)
    return RankInfo(rank, pp_rank, dp_rank, cp_rank, atp_rank)


def rank_of(args: EngineArgs, pp_rank: int, dp_rank: int, cp_rank: int, attn_tp_rank: int) -> int:
    atp, cp = args.attn_tp_size, args.cp_size
    return pp_rank * args.tp_size + dp_rank * cp * atp + cp_rank * atp + attn_tp_rank


@dataclass
class Groups:
    cp: dist.ProcessGroup | None        # this rank's attention CP group (None when CP is 1)
    attn_tp: dist.ProcessGroup | None   # this rank's attention TP group (None when attention TP is 1)
    tp: dist.ProcessGroup | None = None  # the TP world of this pipeline stage: the dense FFN's group


def build_groups(args: EngineArgs, me: RankInfo) -> Groups:
    """Every rank creates every group, in the same order (torch.distributed requires it)."""
    atp, cp, world = args.attn_tp_size, args.cp_size, args.world_size
    groups = Groups(None, None)
    if args.tp_size > 1:
        if args.tp_size == world:
            groups.tp = dist.group.WORLD
        else:
            for pp in range(args.pp_size):
                g = dist.new_group(list(range(pp * args.tp_size, (pp + 1) * args.tp_size)))
                if pp == me.pp_rank:
                    groups.tp = g
    if cp > 1:
        if cp == world:
            groups.cp = groups.tp
        else:
            for pp in range(args.pp_size):
                for dp in range(args.dp_size):
                    for a in range(atp):
                        g = dist.new_group([rank_of(args, pp, dp, c, a) for c in range(cp)])
                        if (pp, dp, a) == (me.pp_rank, me.dp_rank, me.attn_tp_rank):
                            groups.cp = g
    if atp > 1:
        for pp in range(args.pp_size):
            for dp in range(args.dp_size):
                for c in range(cp):
                    g = dist.new_group([rank_of(args, pp, dp, c, a) for a in range(atp)])
                    if (pp, dp, c) == (me.pp_rank, me.dp_rank, me.cp_rank):
                        groups.attn_tp = g
    return groups


def rank_map(args: EngineArgs) -> str:
    """A table of every rank's place, logged at start."""
    lines = [f"graphcp rank map: tp={args.tp_size} (dp={args.dp_size} x attn_cp={args.cp_size} x "
             f"attn_tp={args.attn_tp_size}), pp={args.pp_size}, world={args.world_size}",
             "  rank  pp  dp  cp  attn_tp"]
    for r in range(args.world_size):
        i = rank_info(args, r)
        lines.append(f"  {r:>4}  {i.pp_rank:>2}  {i.dp_rank:>2}  {i.cp_rank:>2}  {i.attn_tp_rank:>7}")
    return "\n".join(lines)


def expert_place(args: EngineArgs, rank: int) -> tuple[int, int]:
    """(EP rank, expert-TP rank) of a rank, as SGLang lays them out: the TP world is ep groups of
    ``tp / ep`` adjacent ranks, each group holding ``num_experts / ep`` experts split along their
    intermediate dimension. The MoE collectives run over the TP world (``Groups.tp``)."""
    return divmod(rank % args.tp_size, args.expert_tp_size)

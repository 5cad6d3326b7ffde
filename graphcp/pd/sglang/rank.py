"""One rank's part of an SGLang transfer: the targets addressed to its (cp, attention TP, pipeline)
rank, written from its pool pages with its Mooncake engine (``KVSender``, the pool registered).
Under KV sharding each CP rank writes only the request's pages it stores (SGLang's sharded prefill
sends the same way: its ``filter_kv_indices_for_shard_rank``)."""

from __future__ import annotations

import numpy as np

from graphcp.config import TORCH_DTYPES
from graphcp.errors import ConfigError, TransferError
from graphcp.kv.sharding import ShardedPool, local_page, page_owner
from graphcp.pd.sglang.geometry import Geometry, Target, geometry_for, rank_writes

# ``runner`` below is the rank's ModelRunner (not imported: the runner imports this module).


def rank_geometry(runner) -> Geometry:
    args, pool = runner.args, runner.pool
    name = next(n for n, d in TORCH_DTYPES.items() if d == pool.dtype)
    return geometry_for(
        runner.model_config,
        args.page_size,
        name,
        pool.dtype.itemsize,
        args.attn_tp_size,
        (runner.par.layers,),
    )


def sglang_write(runner, rid: str, targets: list[Target]) -> dict[int, str | None]:
    """Write this rank's targets of ``rid``: {target index: None, or why it failed}. Ranks of DP
    groups that do not hold ``rid`` answer nothing."""
    if runner.sender is None:
        raise ConfigError("SGLang transfers need --disaggregation-mode prefill")
    state = runner.planner.pages.requests.get(rid)
    me = runner.par.me
    mine = [
        i
        for i, t in enumerate(targets)
        if (t.cp, t.tp, t.pp) == (me.cp_rank, me.attn_tp_rank, me.pp_rank)
    ]
    if state is None or not mine:
        return {}
    geo = rank_geometry(runner)
    per = geo.kv_heads // geo.attn_tp_size
    heads = (
        range(me.attn_tp_rank * per, (me.attn_tp_rank + 1) * per) if geo.kind == "mha" else range(1)
    )
    stage = runner.par.layers
    layers = runner.pool.held_layers(stage)
    pages, owned = np.asarray(state.pages, dtype=np.int64), None
    if isinstance(runner.pool, ShardedPool):  # the pages this CP rank stores, its own numbers
        cp = runner.pool.cp_size
        owned = page_owner(pages, cp) == runner.pool.cp_rank
        pages = local_page(pages, cp)
    out: dict[int, str | None] = {}
    for i in mine:
        src, dst, lengths = rank_writes(
            geo,
            runner.pool.transfer_parts,
            layers,
            stage,
            heads,
            pages,
            state.cached_len,
            targets[i],
            owned,
        )
        try:
            if src:
                runner.sender.write(rid, targets[i].session, src, dst, lengths, "KV pages")
            out[i] = None
        except TransferError as e:
            out[i] = str(e)
    return out


def cached_lens(runner, rids: list[str]) -> list[int | None]:
    """Tokens cached for each of ``rids`` (None where another DP group holds it)."""
    requests = runner.planner.pages.requests
    return [requests[r].cached_len if r in requests else None for r in rids]

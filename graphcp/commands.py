"""The commands a rank serves, in one table for the in-process engine and the worker process, and how
the engine merges the ranks' replies into one answer."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from graphcp.batch import PrefillOutput, RankReply

if TYPE_CHECKING:
    from graphcp.runner import ModelRunner


def _prefill(runner: "ModelRunner", payload: tuple) -> RankReply | None:
    requests, count_ops, force_eager = payload
    reply = runner.prefill(requests, count_ops=count_ops, force_eager=force_eager)
    return reply if runner.answers else None


COMMANDS: dict[str, Callable[["ModelRunner", Any], Any]] = {
    "prefill": _prefill,
    "kv_cache": lambda runner, rid: runner.kv_cache(rid),
    "release": lambda runner, rid: runner.release(rid),
    "stats": lambda runner, _: runner.stats(),
    "counters": lambda runner, _: runner.collective_counts(),
    "transfer_kv": lambda runner, payload: runner.transfer_kv(*payload),    # PD prefill worker
    "sglang_write": lambda runner, payload: runner.sglang_write(*payload),  # SGLang PD (pd/sglang)
    "cached_lens": lambda runner, rids: runner.cached_lens(rids),
}


def execute(runner: "ModelRunner", cmd: str, payload: Any, over_ipc: bool = False) -> Any:
    """Run one command on this rank. ``over_ipc``: logits travel as numpy (plain bytes, cheaper than
    torch's shared-memory tensor passing for a few rows)."""
    if cmd not in COMMANDS:
        raise ValueError(f"unknown command {cmd!r}")
    result = COMMANDS[cmd](runner, payload)
    if over_ipc and isinstance(result, RankReply):
        out, aux = result.output, result.output.aux_hidden_states
        result = replace(result, output=replace(out, logits=out.logits.numpy(),
                                                aux_hidden_states=None if aux is None else aux.numpy()))
    return result


def merge(cmd: str, replies: list[Any]) -> Any:
    """One answer from the ranks' replies: outputs of every DP group in request order, KV parts of every
    pipeline stage and attention-TP rank, rank 0's stats with each rank's weight bytes."""
    if cmd == "prefill":
        return _merge_prefill([r for r in replies if r is not None])
    # CP ranks hold the same cache (KV sharding gathers it), except under LayerSplit (each its
    # own layers)
    if cmd == "kv_cache":
        return _merge_kv([p for p in replies if p is not None and (p["cp_rank"] == 0 or p["some_layers"])])
    if cmd == "transfer_kv":
        from graphcp.pd.sender import merge_reports
        return merge_reports(replies)
    if cmd == "sglang_write":          # each target is written by one rank
        return {i: error for reply in replies for i, error in reply.items()}
    if cmd == "cached_lens":           # the DP group holding each request answers
        return [next((n for n in lens if n is not None), None) for lens in zip(*replies)]
    if cmd == "stats":
        stats = dict(replies[0])
        stats["weight_bytes_per_rank"] = [r["weight_bytes"] for r in replies]
        stats["peak_rss_bytes_per_rank"] = [r["peak_rss_bytes"] for r in replies]
        stats["moe_traffic_per_rank"] = [r.get("moe_traffic") for r in replies]   # MoE token flows
        stats["kv_bytes_per_rank"] = [r["kv_bytes"] for r in replies]
        stats["graph_pool_bytes_per_rank"] = [r["graph_pool_bytes"] for r in replies]
        stats["state_bytes_per_rank"] = [r["state_bytes"] for r in replies]   # per-request state
        if stats.get("kv_sharding"):         # each rank's own pages (KV sharding)
            stats["kv_pages_used_per_rank"] = [r["kv_pages_used"] for r in replies]
        return stats
    return replies[0]


def _merge_prefill(replies: list[RankReply]) -> PrefillOutput:
    replies = sorted(replies, key=lambda r: r.dp_group)
    outs = [r.output for r in replies]
    for o in outs:
        if not isinstance(o.logits, torch.Tensor):
            o.logits = torch.from_numpy(o.logits)
        if o.aux_hidden_states is not None and not isinstance(o.aux_hidden_states, torch.Tensor):
            o.aux_hidden_states = torch.from_numpy(o.aux_hidden_states)
    if len(outs) == 1:
        return outs[0]
    order = [i for r in replies for i in r.request_indices]
    logits = torch.cat([o.logits for o in outs])[torch.argsort(torch.tensor(order))]
    reasons = [o.eager_reason for o in outs if o.eager_reason]
    return PrefillOutput(logits=logits, next_token_ids=logits.argmax(-1).tolist(),
                         mode="graph" if all(o.mode == "graph" for o in outs) else "eager",
                         graph_bucket=outs[0].graph_bucket, eager_reason=reasons[0] if reasons else None,
                         cp_applied=all(r.output.cp_applied for r in replies if r.request_indices),
                         per_rank_tokens=[n for o in outs for n in o.per_rank_tokens],
                         aux_hidden_states=_merge_aux(replies))


def _merge_aux(replies: list[RankReply]) -> torch.Tensor | None:
    """Every DP group's aux rows, request by request in the caller's order."""
    if all(r.output.aux_hidden_states is None for r in replies):
        return None
    rows = {}
    for r in replies:
        if r.request_indices:
            parts = r.output.aux_hidden_states.split(r.extend_lens)
            rows.update(zip(r.request_indices, parts))
    return torch.cat([rows[i] for i in sorted(rows)])


def _merge_kv(parts: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's entry, its attention-TP ranks' heads joined as the layer's kind joins them."""
    from graphcp.attention.kinds import KINDS
    by_layer: dict[int, list[tuple[int, tuple]]] = {}
    kinds: dict[int, str] = {}
    for part in parts:
        for i, (kv, kind) in enumerate(zip(part["layers"], part["kinds"])):
            if kind == "gqa" and part["attn_tp_rank"] % part.get("kv_replicas", 1):
                continue            # a replica of a lower attention-TP rank's KV head
            by_layer.setdefault(part["first_layer"] + i, []).append((part["attn_tp_rank"], kv))
            kinds[part["first_layer"] + i] = kind
    out = []
    for layer in sorted(by_layer):
        shards = [kv for _, kv in sorted(by_layer[layer], key=lambda x: x[0])]
        # one attention-TP rank: the layer as the rank returned it (DSA too)
        out.append(shards[0] if len(shards) == 1 else KINDS[kinds[layer]].join(shards))
    return out

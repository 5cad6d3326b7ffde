"""The engine's SGLang PD glue: it starts the control plane, picks each room's first token after a
prefill, and runs a room's writes on the ranks under the engine's lock (so a release, which takes
the same lock, never frees pages a write is reading). The engine hands in its lock and its locked
call (``call(cmd, payload, timeout)``)."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from graphcp.batch import PrefillOutput, Request
from graphcp.checkpoint.config import read_model_config
from graphcp.config import TORCH_DTYPES, EngineArgs, resolve_dtype
from graphcp.distributed.shards import pipeline_stage
from graphcp.errors import ConfigError, RequestError
from graphcp.pd.sglang.bootstrap import local_ip
from graphcp.pd.sglang.control import PrefillControl
from graphcp.pd.sglang.geometry import Target, geometry_for
from graphcp.pd.sglang.sampling import SamplingParams, first_token

Call = Callable[[str, object, "float | None"], object]


def check_model(args: EngineArgs) -> None:
    """Before any rank starts: a model SGLang's decode pools cannot take is a ConfigError."""
    geometry_for(
        read_model_config(args.model_path), args.page_size, "float32", 4, args.attn_tp_size, ()
    )


def start_control(
    args: EngineArgs, spmd: bool, lock: threading.RLock, call: Call, release: Callable[[str], None]
) -> PrefillControl:
    if spmd:
        raise ConfigError(
            "--disaggregation-bootstrap-port: the SGLang control plane runs in the engine's "
            "own process; start the engine in a plain process, not under torchrun"
        )
    import torch

    cfg = read_model_config(args.model_path)
    dtype = resolve_dtype(args.dtype, torch.device(args.resolved_device()))
    name = next(n for n, d in TORCH_DTYPES.items() if d == dtype)
    stages = tuple(
        range(*pipeline_stage(cfg.num_hidden_layers, args.pp_size, p)) for p in range(args.pp_size)
    )
    geo = geometry_for(cfg, args.page_size, name, dtype.itemsize, args.attn_tp_size, stages)
    holder: list[PrefillControl] = []
    timeout = args.rank_timeout_s + args.disaggregation_transfer_timeout_s

    def transfer(rid: str, targets: list[Target]) -> list[str | None]:
        """Every rank writes its targets; an error (or None) per target."""
        with lock:
            if not holder[0].live(rid):
                return ["the transfer was cancelled"] * len(targets)
            done = call("sglang_write", (rid, targets), timeout)
        return [
            done[i]
            if i in done
            else f"no rank of the engine wrote target {i} (its DP group lost {rid!r})"
            for i in range(len(targets))
        ]

    holder.append(
        PrefillControl(
            geo,
            args.dp_size,
            args.cp_size,
            args.enable_dsa_cache_layer_split,
            args.enable_kv_cache_sharding,
            local_ip(),
            args.disaggregation_bootstrap_port,
            transfer,
            release,
        )
    )
    return holder[0]


def prefill_rooms(
    control: PrefillControl | None,
    lock: threading.RLock,
    call: Call,
    batch: Sequence[Request],
    count_host_ops: bool,
    force_eager: bool,
) -> PrefillOutput:
    """``engine.prefill`` for a batch with bootstrap rooms: after the forward, each room's first
    token and its length go to the control plane, which transfers once the decode is there."""
    if control is None:
        rid = next(r.rid for r in batch if r.bootstrap_room is not None)
        raise RequestError(
            f"request {rid!r}: bootstrap_room needs an engine started with "
            f"--disaggregation-bootstrap-port (EngineArgs disaggregation_bootstrap_port)"
        )
    rooms = [(i, r) for i, r in enumerate(batch) if r.bootstrap_room is not None]
    with lock:
        params = {}
        for _, r in rooms:
            control.check(r.rid, r.bootstrap_room)
            params[r.rid] = SamplingParams.parse(r.rid, r.sampling_params)
        if len({r.bootstrap_room for _, r in rooms}) != len(rooms):
            raise RequestError("two requests of one batch carry the same bootstrap_room")
        out = call("prefill", (list(batch), count_host_ops, force_eager), None)
        lens = call("cached_lens", [r.rid for _, r in rooms], None)
        for (i, r), tokens in zip(rooms, lens):
            first = first_token(out.logits[i], params[r.rid], tokens - 1)
            control.forward_done(r.rid, r.bootstrap_room, tokens, first)
    return out

"""The engine's SGLang PD glue: it starts the control plane, picks each room's first token after a
prefill, and runs a room's writes on the ranks under the engine's lock (so a release, which takes the
same lock, never frees pages a write is reading)."""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Sequence

from graphcp.batch import PrefillOutput, Request
from graphcp.config import TORCH_DTYPES, resolve_dtype
from graphcp.errors import ConfigError, RequestError
from graphcp.models import read_model_config
from graphcp.models.parallel import pipeline_stage
from graphcp.pd.sglang.control import PrefillControl
from graphcp.pd.sglang.geometry import Target, geometry_for
from graphcp.pd.sglang.sampling import SamplingParams, first_token

if TYPE_CHECKING:
    from graphcp.engine import Engine


def local_ip() -> str:
    """The address decode workers reach this engine on: SGLang's own ``SGLANG_HOST_IP`` when set,
    else the interface of the default route (127.0.0.1 on a machine without one)."""
    if os.environ.get("SGLANG_HOST_IP"):
        return os.environ["SGLANG_HOST_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))          # no packet is sent
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def start_control(engine: "Engine") -> PrefillControl:
    args = engine.args
    if engine._spmd:
        raise ConfigError("--disaggregation-bootstrap-port: the SGLang control plane runs in the engine's "
                          "own process; start the engine in a plain process, not under torchrun")
    cfg = read_model_config(args.model_path)
    dtype = resolve_dtype(args.dtype, _device(args))
    name = next(n for n, d in TORCH_DTYPES.items() if d == dtype)
    stages = tuple(range(*pipeline_stage(cfg.num_hidden_layers, args.pp_size, p)) for p in range(args.pp_size))
    geo = geometry_for(cfg, args.page_size, name, dtype.itemsize, args.attn_tp_size, stages)
    return PrefillControl(geo, args.dp_size, args.cp_size, args.enable_dsa_cache_layer_split, local_ip(),
                          args.disaggregation_bootstrap_port, lambda rid, targets: transfer(engine, rid, targets),
                          engine.release)


def _device(args):  # noqa: ANN001, ANN202 - EngineArgs -> torch.device
    import torch
    return torch.device(args.resolved_device())


def check_model(args) -> None:  # noqa: ANN001 - EngineArgs
    """Before any rank starts: a model SGLang's decode pools cannot take is a ConfigError."""
    cfg = read_model_config(args.model_path)
    geometry_for(cfg, args.page_size, "float32", 4, args.attn_tp_size, ())


def prefill_rooms(engine: "Engine", batch: Sequence[Request], count_host_ops: bool,
                  force_eager: bool) -> PrefillOutput:
    """``engine.prefill`` for a batch with bootstrap rooms: after the forward, each room's first
    token and its length are handed to the control plane, which transfers once the decode is there."""
    control = engine._sglang
    if control is None:
        rid = next(r.rid for r in batch if r.bootstrap_room is not None)
        raise RequestError(f"request {rid!r}: bootstrap_room needs an engine started with "
                           f"--disaggregation-bootstrap-port (EngineArgs disaggregation_bootstrap_port)")
    rooms = [(i, r) for i, r in enumerate(batch) if r.bootstrap_room is not None]
    with engine._lock:
        params = {}
        for _, r in rooms:
            control.check(r.rid, r.bootstrap_room)
            params[r.rid] = SamplingParams.parse(r.rid, r.sampling_params)
        if len({r.bootstrap_room for _, r in rooms}) != len(rooms):
            raise RequestError("two requests of one batch carry the same bootstrap_room")
        out = engine._call_locked("prefill", (list(batch), count_host_ops, force_eager), None)
        lens = engine._call_locked("cached_lens", [r.rid for _, r in rooms], None)
        for (i, r), tokens in zip(rooms, lens):
            first = first_token(out.logits[i], params[r.rid], tokens - 1)
            control.forward_done(r.rid, r.bootstrap_room, tokens, first)
    return out


def transfer(engine: "Engine", rid: str, targets: list[Target]) -> list[str | None]:
    """Every rank writes its targets; an error (or None) per target."""
    with engine._lock:
        if not engine._sglang.live(rid):
            return ["the transfer was cancelled"] * len(targets)
        timeout = engine.args.rank_timeout_s + engine.args.disaggregation_transfer_timeout_s
        done = engine._call_locked("sglang_write", (rid, targets), timeout)
    return [done[i] if i in done else f"no rank of the engine wrote target {i} (its DP group lost {rid!r})"
            for i in range(len(targets))]

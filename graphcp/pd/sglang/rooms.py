"""A room's state on the prefill side, where its decode destinations come from, and the PUSH
sockets that answer the decode ranks."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from graphcp.pd.sglang.bootstrap import Rank
from graphcp.pd.sglang.geometry import Target
from graphcp.pd.sglang.sampling import FirstToken
from graphcp.pd.sglang.wire import Abort, Metadata, Registration

log = logging.getLogger("graphcp")


@dataclass
class Room:
    room: int
    rid: str | None = None
    tokens: int = 0
    first: FirstToken | None = None
    state: str = "waiting"  # waiting | transferring | success | failed
    reason: str | None = None
    infos: dict[Rank, dict[str, Metadata]] = field(default_factory=dict)
    dp_label: int | None = None
    acks: list[tuple[Rank, Abort]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    def status(self) -> dict:
        first = self.first
        return {
            "state": self.state,
            "reason": self.reason,
            "bootstrap_room": self.room,
            "first_token": first.token if first else None,
            "logprob": first.logprob if first else None,
            "top_logprobs": list(zip(first.top_logprobs, first.top_ids)) if first else None,
        }


def room_targets(
    room: Room,
    metas: list[tuple[Rank, Metadata]],
    registrations: dict[tuple[Rank, str], Registration | str],
    ps: int,
) -> tuple[list[Target], str | None]:
    """Each real decode destination of a room, for the rank that writes it; or why the room
    cannot be written (the decode's pool was refused, or the prompts differ)."""
    targets = []
    for (_, cp, tp, pp), meta in metas:
        if meta.dummy:
            continue
        reg = registrations.get(((room.dp_label, cp, tp, pp), meta.session))
        if not isinstance(reg, Registration):
            return (
                [],
                reg or f"decode session {meta.session} sent metadata before registering its pool",
            )
        if meta.has_state:
            return (
                [],
                "the decode asked for state pages (DSA indexer, SWA, mamba), which graphcp "
                "does not send",
            )
        pages = -(-(room.tokens - meta.decode_prefix_len) // ps)
        if meta.decode_prefix_len % ps or len(meta.pages) != pages:
            return [], (
                f"the decode expects {len(meta.pages)} pages past its cached prefix of "
                f"{meta.decode_prefix_len} tokens; graphcp holds {room.tokens} tokens of request "
                f"{room.rid!r} ({pages} pages of {ps}): the two tokenized different prompts"
            )
        targets.append(
            Target(
                cp,
                tp,
                pp,
                meta.session,
                reg.kv_ptrs,
                reg.kv_item_lens,
                reg.tp_rank,
                reg.attn_tp_size,
                meta.pages,
                meta.decode_prefix_len,
            )
        )
    return targets, None


class Outbox:
    """One PUSH socket per decode rank endpoint; a decode that is gone costs a bounded wait."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._lock = threading.Lock()

    def send(self, ip: str, port: int, frames: list[bytes]) -> None:
        with self._lock:
            sock = self._sockets.get((ip, port))
            if sock is None:
                sock = self._sockets[ip, port] = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 5000)
                sock.connect(f"tcp://{ip}:{port}")
            try:
                sock.send_multipart(frames)
            except zmq.ZMQError as e:
                log.warning("graphcp: could not reach decode %s:%s (%s)", ip, port, e)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._sockets.clear()

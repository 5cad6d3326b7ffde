"""The SGLang-facing side of a graphcp prefill worker, in the engine's process.

It runs the bootstrap HTTP server and one ZMQ PULL endpoint per logical SGLang prefill rank
(dp, cp, tp, pp), all in this process: a decode PUSHes its registration, per-room metadata and
ABORT there. The KV itself moves rank to decode: when a room has both its forward (``forward_done``)
and the metadata of every endpoint the decode will contact, the worker thread hands the targets to
``transfer`` (the engine's ranks write them from their pools over Mooncake), then sends each real
endpoint's aux row (AUX_DATA over ZMQ) and its Success, or Failed with the reason, to each decode
rank, and releases the request's pages. An ABORT marks the room failed; its ABORT_ACK goes out from
the endpoint that got it once no write to the room is in flight.

Which endpoints a decode contacts: every attention-TP rank whatever the decode's TP (SGLang maps
each decode rank to one or more of them), every pipeline stage, all CP ranks when the layers are
split over them (registered as ``enable_dsa_cache_layer_split``) or the pages are (KV sharding,
registered as ``enable_kv_cache_sharding``: each CP rank writes the pages it owns) else CP rank 0
only, and the DP rank ``room % dp_size`` (``follow_bootstrap_room``). That DP rank is a label: the
DP group that holds the request writes it. Every contacted endpoint sends the aux row and its
Success, as SGLang's sharded prefill does: the decode counts one response per CP rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

import zmq

from graphcp.errors import RequestError
from graphcp.pd.sglang.bootstrap import BootstrapServer, Rank
from graphcp.pd.sglang.geometry import Geometry, Target
from graphcp.pd.sglang.rooms import Outbox, Room, room_targets
from graphcp.pd.sglang.sampling import AUX_BUFFERS, FirstToken, aux_rows
from graphcp.pd.sglang.wire import (
    Abort,
    Metadata,
    Registration,
    WireError,
    ack_frames,
    aux_frames,
    parse,
    status_frames,
)

log = logging.getLogger("graphcp")
WAIT_TIMEOUT_S = 300.0  # a room still missing its forward or its metadata then fails (SGLang's)
HISTORY = 4096  # concluded transfers whose status stays queryable


class PrefillControl:
    """``transfer(rid, targets)`` runs the writes on the ranks and returns an error per target
    index (None: written); ``release(rid)`` frees the request's pages."""

    def __init__(
        self,
        geo: Geometry,
        dp_size: int,
        cp_size: int,
        layer_split: bool,
        kv_sharding: bool,
        host: str,
        port: int,
        transfer: Callable[[str, list[Target]], list],
        release: Callable[[str], None],
    ) -> None:
        self.geo, self.dp_size, self.cp_size, self.host = geo, dp_size, cp_size, host
        self.pp_size = len(geo.stages)
        self.all_cp_ranks = layer_split or kv_sharding  # every CP rank holds part of the KV
        self.transfer, self.release = transfer, release
        self.rooms: dict[int, Room] = {}
        self.by_rid: dict[str, int] = {}
        self.history: OrderedDict[str, dict] = OrderedDict()
        self.registrations: dict[tuple[Rank, str], Registration | str] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._ctx = zmq.Context()
        self._outbox = Outbox(self._ctx)
        self._pull: dict[zmq.Socket, Rank] = {}
        endpoints = {}
        for rank in self._ranks():
            sock = self._ctx.socket(zmq.PULL)
            endpoints[rank] = (host, sock.bind_to_random_port(f"tcp://{host}"))
            self._pull[sock] = rank
        info = {
            "attn_tp_size": geo.attn_tp_size,
            "attn_cp_size": cp_size,
            "dp_size": dp_size,
            "pp_size": self.pp_size,
            "page_size": geo.page_size,
            "kv_cache_dtype": None,
            "follow_bootstrap_room": True,
            "enable_dsa_cache_layer_split": layer_split,
            "enable_kv_cache_sharding": kv_sharding,
            "decode_allocation_policy": "early",
        }
        try:
            self.bootstrap = BootstrapServer(port, info, endpoints)
        except BaseException:
            self._close_sockets()
            raise
        self._threads = [
            threading.Thread(target=self._receive, name="graphcp-pd-recv", daemon=True),
            threading.Thread(target=self._work, name="graphcp-pd-work", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _ranks(self) -> list[Rank]:
        return [
            (d, c, t, p)
            for d in range(self.dp_size)
            for c in range(self.cp_size)
            for t in range(self.geo.attn_tp_size)
            for p in range(self.pp_size)
        ]

    def unique_rank(self, rank: Rank) -> int:
        """SGLang's prefill_unique_rank: the decode counts Success from distinct ones."""
        _, cp, tp, pp = rank
        return tp * self.pp_size * self.cp_size + pp * self.cp_size + cp

    # -- the engine's side -----------------------------------------------------------------------
    def check(self, rid: str, room: object) -> None:
        if isinstance(room, bool) or not isinstance(room, int) or not 0 < room < 1 << 64:
            raise RequestError(
                f"request {rid!r}: bootstrap_room must be an integer in [1, 2**64), got "
                f"{room!r} (SGLang's decode never accepts room 0)"
            )
        with self._cond:
            other = self.rooms.get(room)
            if other is not None and other.rid not in (None, rid):
                raise RequestError(
                    f"request {rid!r}: bootstrap_room {room} is in use by request {other.rid!r}"
                )
            if rid in self.by_rid and self.by_rid[rid] != room:
                raise RequestError(
                    f"request {rid!r} already waits on bootstrap_room {self.by_rid[rid]}"
                )

    def forward_done(self, rid: str, room: int, tokens: int, first: FirstToken) -> None:
        """``rid`` (``tokens`` long) is prefilled: its transfer runs once the decode is there."""
        with self._cond:
            entry = self.rooms.setdefault(room, Room(room))
            entry.rid, entry.tokens, entry.first = rid, tokens, first
            entry.since = time.monotonic()
            self.by_rid[rid] = room
            self.history.pop(rid, None)
            self._cond.notify_all()

    def status(self, rid: str) -> dict:
        with self._cond:
            if rid in self.by_rid:
                return self.rooms[self.by_rid[rid]].status()
            if rid in self.history:
                return dict(self.history[rid])
        raise RequestError(
            f"request {rid!r} has no SGLang transfer: prefill it with a bootstrap_room"
        )

    def live(self, rid: str) -> bool:
        """The room of ``rid`` may still be written (checked under the engine's lock)."""
        with self._cond:
            room = self.rooms.get(self.by_rid.get(rid, -1))
            return room is not None and room.state == "transferring"

    def released(self, rid: str) -> None:
        """The caller released ``rid`` before its transfer concluded: the decode is told."""
        with self._cond:
            room = self.rooms.get(self.by_rid.get(rid, -1))
            if room is None:
                return
            self._fail(room, "the request was released before its KV transfer completed")
            self._finish(room)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            # a worker that shuts the engine down closes this from its own thread
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self.bootstrap.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._outbox.close()
        for sock in self._pull:
            sock.close(linger=0)
        self._ctx.term()

    # -- decode -> prefill -----------------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        for sock in self._pull:
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(200):
                frames = sock.recv_multipart()
                try:
                    self._handle(self._pull[sock], parse(frames))
                except WireError as e:
                    log.warning(
                        "graphcp: dropped a message on %s that is not SGLang's: %s",
                        self._pull[sock],
                        e,
                    )

    def _handle(self, rank: Rank, msg: Registration | Metadata | Abort) -> None:
        with self._cond:
            if isinstance(msg, Registration):
                reason = self.geo.check(msg, rank[3]) or self._check_aux(msg)
                if reason:
                    log.warning(
                        "graphcp: refusing KV transfers to decode %s: %s", msg.session, reason
                    )
                self.registrations[rank, msg.session] = reason or msg
                return
            room = self.rooms.setdefault(msg.room, Room(msg.room))
            if isinstance(msg, Abort):
                room.acks.append((rank, msg))
                if room.state in ("waiting", "transferring"):
                    self._fail(room, "aborted by the decode", notify=False)
            else:
                room.dp_label = rank[0] if room.dp_label is None else room.dp_label
                room.infos.setdefault(rank, {})[msg.session] = msg
                if room.state == "failed":
                    self._send_status(room, [(rank, msg)])
            self._cond.notify_all()

    def _check_aux(self, reg: Registration) -> str | None:
        if len(reg.aux_ptrs) in (
            AUX_BUFFERS,
            AUX_BUFFERS + 1,
        ):  # + SGLang's optional KV checksum row
            return None
        return (
            f"the decode registered {len(reg.aux_ptrs)} metadata buffers; graphcp writes SGLang's "
            f"{AUX_BUFFERS} (turn off SGLANG_ENABLE_DISAGG_SAMPLING_MASK on the decode)"
        )

    # -- the worker ------------------------------------------------------------------------------
    def _expected(self, room: Room) -> list[Rank]:
        cps = range(self.cp_size) if self.all_cp_ranks else range(1)
        return [
            (room.dp_label, c, t, p)
            for c in cps
            for t in range(self.geo.attn_tp_size)
            for p in range(self.pp_size)
        ]

    def _ready(self, room: Room) -> bool:
        if room.state != "waiting" or room.rid is None or room.dp_label is None:
            return False
        for rank in self._expected(room):
            metas = room.infos.get(rank)
            if not metas or len(metas) < next(iter(metas.values())).required_dst_info_num:
                return False
        return True

    def _work(self) -> None:
        while True:
            done: list[str | None] = []
            with self._cond:
                if self._stop:
                    return
                now = time.monotonic()
                for room in list(self.rooms.values()):
                    if room.state == "waiting" and now - room.since > WAIT_TIMEOUT_S:
                        missing = (
                            "its prefill request" if room.rid is None else "the decode's metadata"
                        )
                        self._fail(room, f"{missing} did not arrive within {WAIT_TIMEOUT_S:.0f} s")
                    if room.state != "transferring":
                        self._send_acks(room)
                    if room.state == "failed" and (
                        room.rid is not None or now - room.since > WAIT_TIMEOUT_S
                    ):
                        done.append(
                            self._finish(room)
                        )  # (an aborted room no prefill came for: forgotten)
                ready = next((r for r in self.rooms.values() if self._ready(r)), None)
                if ready is not None:
                    ready.state = "transferring"
                elif not done:
                    self._cond.wait(1.0)
            self._release(done)
            if ready is not None:
                self._run(ready)

    def _run(self, room: Room) -> None:
        metas = [(rank, m) for rank in self._expected(room) for m in room.infos[rank].values()]
        targets, reason = room_targets(room, metas, self.registrations, self.geo.page_size)
        if reason is None:
            try:
                errors = self.transfer(room.rid, targets)
            except Exception as e:
                errors = [f"{type(e).__name__}: {e}"] * len(targets)
            reason = next((e for e in errors if e), None)
        with self._cond:
            if room.state == "transferring":
                if reason is None:
                    for rank, meta in metas:
                        if not meta.dummy:
                            self._send(
                                meta,
                                *(
                                    aux_frames(room.room, i, meta.aux_index, row)
                                    for i, row in enumerate(aux_rows(room.first, room.room))
                                ),
                            )
                    room.state = "success"
                    self._send_status(room, metas)
                else:
                    self._fail(room, reason)
            self._send_acks(room)
            rid = self._finish(room)
        self._release([rid])

    # -- prefill -> decode (called with the lock held) -------------------------------------------
    def _fail(self, room: Room, reason: str, notify: bool = True) -> None:
        """Failed (the decode is told, with the reason, unless it aborted the room itself)."""
        if room.state in ("success", "failed"):
            return
        room.state, room.reason, room.since = "failed", reason, time.monotonic()
        if notify:
            self._send_status(
                room, [(rank, m) for rank, ms in room.infos.items() for m in ms.values()]
            )

    def _finish(self, room: Room) -> str | None:
        """Forget a concluded room but its status; the rid whose pages are to be released."""
        self.rooms.pop(room.room, None)
        if room.rid is None:
            return None
        self.by_rid.pop(room.rid, None)
        self.history[room.rid] = room.status()
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)
        return room.rid

    def _release(self, rids: list[str | None]) -> None:
        """Outside the lock: the engine's lock is taken inside (and the engine takes ours)."""
        for rid in rids:
            if rid is None:
                continue
            try:
                self.release(rid)
            except Exception as e:
                log.debug("graphcp: release of %r after its transfer: %s", rid, e)

    def _send_status(self, room: Room, metas: list[tuple[Rank, Metadata]]) -> None:
        ok = room.state == "success"
        for rank, meta in metas:
            if not meta.dummy:
                self._send(meta, status_frames(room.room, ok, self.unique_rank(rank), room.reason))

    def _send_acks(self, room: Room) -> None:
        while room.acks:
            rank, abort = room.acks.pop()
            if abort.decode_ip is not None and abort.generation is not None:
                self._outbox.send(
                    abort.decode_ip,
                    abort.decode_port,
                    ack_frames(room.room, self.unique_rank(rank), abort.generation),
                )

    def _send(self, meta: Metadata, *messages: list[bytes]) -> None:
        for frames in messages:
            self._outbox.send(meta.decode_ip, meta.decode_port, frames)

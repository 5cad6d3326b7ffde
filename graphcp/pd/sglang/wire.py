"""SGLang's PD control messages (mooncake backend, SGLang 0.5.23) as ZMQ multipart frames.

A decode rank PUSHes to each prefill rank's PULL endpoint: its KV-args registration (once per
session), the transfer metadata of each request ("room"), and ABORT. The prefill answers on the
decode rank's own PULL endpoint: the aux (metadata) row as AUX_DATA, the transfer status, and
ABORT_ACK. Integers travel as ASCII unless noted; pointers as little-endian u64. The wire is
SGLang-internal and changes between versions: ``SGLANG_VERSION`` is the one this speaks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

SGLANG_VERSION = "0.5.23"
SUCCESS, FAILED = 4, 0  # SGLang's KVPoll values the decode counts
ABORT, ABORT_ACK, AUX_DATA = b"ABORT", b"ABORT_ACK", b"AUX_DATA"


class WireError(ValueError):
    """A message that is not SGLang 0.5.23's (a different version, or garbage)."""


@dataclass(frozen=True)
class Registration:
    """A decode rank's KV memory: where each pool entry (MHA: K of every layer, then V; MLA: one
    per layer) and each aux buffer starts, and the bytes of one page of each entry."""

    decode_ip: str
    decode_port: int
    session: str  # the decode's Mooncake session, "ip:rpc_port"
    kv_ptrs: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    state_ptrs: tuple[tuple[int, ...], ...]
    tp_rank: int
    attn_tp_size: int
    kv_item_lens: tuple[int, ...]
    kv_layer_ids: tuple[int, ...]
    dcp_size: int


@dataclass(frozen=True)
class Metadata:
    """One decode rank's destination for a room: its pages for the prompt's tokens past
    ``decode_prefix_len``, its aux row; a dummy (no pages, no aux index) receives nothing."""

    room: int
    decode_ip: str
    decode_port: int
    session: str
    pages: np.ndarray | None  # int32 decode page ids; None for a dummy target
    aux_index: int | None
    has_state: bool  # state pages (DSA indexer, SWA, mamba) were asked for
    required_dst_info_num: int
    decode_prefix_len: int

    @property
    def dummy(self) -> bool:
        return self.pages is None


@dataclass(frozen=True)
class Abort:
    room: int
    decode_ip: str | None
    decode_port: int | None
    generation: int | None


def _int(frame: bytes, what: str) -> int:
    try:
        return int(frame.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"{what}: {frame[:32]!r} is not an ASCII integer") from e


def _u64s(frame: bytes) -> tuple[int, ...]:
    if len(frame) % 8:
        raise WireError(f"a u64 list of {len(frame)} bytes")
    return struct.unpack(f"<{len(frame) // 8}Q", frame)


def _int_lists(frame: bytes, fmt: str) -> tuple[tuple[int, ...], ...]:
    """SGLang's ``pack_int_lists``: u32 count, count x u32 byte lengths, then the lists."""
    if not frame:
        return ()
    (count,) = struct.unpack("<I", frame[:4])
    lengths = struct.unpack(f"<{count}I", frame[4 : 4 + 4 * count])
    out, offset, width = [], 4 + 4 * count, struct.calcsize(fmt)
    for n in lengths:
        out.append(struct.unpack(f"<{n // width}{fmt}", frame[offset : offset + n]))
        offset += n
    return tuple(out)


def parse(frames: list[bytes]) -> Registration | Metadata | Abort:
    """One decode -> prefill message; WireError for anything else (BOOTSTRAP is never sent to a
    prefill that registers decode_allocation_policy "early", as graphcp does)."""
    if not frames:
        raise WireError("an empty message")
    if frames[0] == ABORT:
        if len(frames) < 2:
            raise WireError("ABORT without a room")
        ip = frames[2].decode("ascii") if len(frames) >= 4 else None
        port = _int(frames[3], "ABORT port") if len(frames) >= 4 else None
        generation = _int(frames[4], "ABORT generation") if len(frames) >= 5 else None
        return Abort(_int(frames[1], "ABORT room"), ip, port, generation)
    if len(frames) < 9:
        raise WireError(
            f"a message of {len(frames)} frames (SGLang {SGLANG_VERSION} sends 20 or 10)"
        )
    ip, port, session = (
        frames[1].decode("ascii"),
        _int(frames[2], "port"),
        frames[3].decode("ascii"),
    )
    if frames[0] == b"None":
        if len(frames) < 20:
            raise WireError(
                f"a registration of {len(frames)} frames; SGLang {SGLANG_VERSION} sends 20"
            )
        layer_ids = struct.unpack(f"<{len(frames[12]) // 4}I", frames[12]) if frames[12] else ()
        return Registration(
            ip,
            port,
            session,
            _u64s(frames[4]),
            _u64s(frames[5]),
            _int_lists(frames[6], "Q"),
            _int(frames[7], "tp rank"),
            _int(frames[8], "attention TP size"),
            _u64s(frames[19]),
            layer_ids,
            _int(frames[16], "dcp size") if frames[16] else 1,
        )
    room = _int(frames[0], "room")
    dummy = frames[4] == b"" and frames[5] == b""
    pages = None if dummy else np.frombuffer(frames[4], dtype=np.int32)
    aux = None if dummy else _int(frames[5], "aux index")
    prefix = _int(frames[8], "decode prefix length") if frames[8] else 0
    return Metadata(
        room,
        ip,
        port,
        session,
        pages,
        aux,
        bool(frames[6]) and not dummy,
        _int(frames[7], "required_dst_info_num"),
        prefix,
    )


def status_frames(room: int, ok: bool, unique_rank: int, reason: str | None = None) -> list[bytes]:
    """Success or Failed from one prefill rank; the decode records a Failed's reason frame."""
    frames = [
        str(room).encode(),
        str(SUCCESS if ok else FAILED).encode(),
        str(unique_rank).encode(),
    ]
    if not ok and reason:
        frames.append(reason.encode("utf-8"))
    return frames


def aux_frames(room: int, buffer_index: int, aux_index: int, data: bytes) -> list[bytes]:
    return [
        AUX_DATA,
        str(room).encode(),
        str(buffer_index).encode(),
        str(aux_index).encode(),
        struct.pack(">I", len(data)),
        data,
    ]


def ack_frames(room: int, unique_rank: int, generation: int) -> list[bytes]:
    return [ABORT_ACK, str(room).encode(), str(unique_rank).encode(), str(generation).encode()]

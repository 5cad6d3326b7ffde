"""KVReceiver: the decode side's receiving end, as a decode worker would run it.

Receive space: ``max_requests`` slots of ``max_tokens`` tokens each (``layout.SlotLayout``), in one
shared-memory buffer. A child process owns the Mooncake engine and registers the buffer with it, so the
senders write into another process exactly as into a decode worker; this process maps the same pages to
read what arrived. ``destination(rid)`` reserves a slot for ``rid`` (the same slot again when asked again,
e.g. after a later chunk) and clears its header; ``free(rid)`` gives it back.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time

import torch

from graphcp.attention.kinds import cache_parts, layer_kinds
from graphcp.checkpoint.config import read_model_config
from graphcp.distributed.procs import child_env
from graphcp.errors import ConfigError, RequestError, TransferError
from graphcp.pd.layout import DTYPES, destination_dict, layout_for
from graphcp.pd.mooncake import READY, transfer_engine_class


class KVReceiver:
    """``with KVReceiver(model_path, max_tokens=4096) as rx: engine.transfer_kv(rid, rx.destination(rid));
    rx.kv(rid)``."""

    def __init__(self, model_path: str, max_tokens: int = 4096, max_requests: int = 4, dtype: str = "float32",
                 protocol: str = "tcp", host: str = "127.0.0.1", start_timeout_s: float = 60.0) -> None:
        for name, value in (("max_tokens", max_tokens), ("max_requests", max_requests)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVReceiver {name} must be an integer >= 1, got {value!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"KVReceiver dtype {dtype!r} is not one of: {', '.join(DTYPES)}")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"KVReceiver protocol {protocol!r} is not one of: tcp, rdma")
        transfer_engine_class()                                  # a clear error here, not in the child
        cfg = read_model_config(model_path)
        self.layout = layout_for(cfg, max_tokens, dtype)
        layers = range(cfg.num_hidden_layers)       # rows become engine.kv_cache's format by kind
        self.model_config, self.kinds = cfg, layer_kinds(cfg, layers)
        self.parts = cache_parts(cfg, layers, 1)
        self.protocol, self.max_requests = protocol, max_requests
        self._slots: dict[str, int] = {}
        self._proc = None
        nbytes = self.layout.slot_bytes * max_requests
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="graphcp-kv-", dir=shm)
        try:
            os.ftruncate(fd, nbytes)
            os.close(fd)
            self._buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            cmd = [sys.executable, "-m", "graphcp.pd.receive_process", path, str(nbytes), protocol, host]
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(),
                                          text=True)
            port, self._remote_base = self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            os.unlink(path)                   # both processes hold their mappings; nothing left on disk
        self.session = f"{host}:{port}"

    def _wait_ready(self, timeout_s: float) -> tuple[int, int]:
        """The child's handshake port and the buffer's address in the child (where senders write)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._proc.stdout], [], [], 0.5)
            line = self._proc.stdout.readline() if ready else ""
            if line.startswith(READY):
                _, port, base = line.split()
                return int(port), int(base)
            if self._proc.poll() is not None:
                raise TransferError(f"the KV receiver process exited with code {self._proc.returncode} at start")
        raise TransferError(f"the KV receiver process did not start within {timeout_s:.0f} s")

    # -- receive space ---------------------------------------------------------------------------
    def destination(self, rid: str) -> dict:
        """Where ``engine.transfer_kv(rid, ...)`` writes: a JSON-able dict (session, layout, addresses)."""
        self._check_open()
        slot = self._slots.get(rid)
        if slot is None:
            used = set(self._slots.values())
            free = [s for s in range(self.max_requests) if s not in used]
            if not free:
                raise RequestError(f"request {rid!r}: all {self.max_requests} receive slots are taken; free() a "
                                   f"finished request or raise KVReceiver max_requests")
            slot = self._slots[rid] = free[0]
        self._header(slot).zero_()
        addr = self._remote_base + slot * self.layout.slot_bytes
        return destination_dict(rid, self.session, self.protocol, self.layout, addr)

    def kv(self, rid: str) -> list[tuple]:
        """The received cache in ``engine.kv_cache`` format (each layer's kind's export): per layer
        (k, v) [num_kv_heads, len, head_dim] (dense), (kv_latent, k_rope, index_k or None)
        [len, dim] (DSA), or DeepSeek V4's five parts (README); fp32."""
        self._check_open()
        if rid not in self._slots:
            raise RequestError(f"request {rid!r}: no destination was reserved for it on this receiver")
        slot = self._slots[rid]
        lens = self._header(slot)
        n = int(lens.max())
        if n == 0 or bool((lens != n).any()):
            missing = [(int(layer), int(head)) for layer, head in (lens != n).nonzero().tolist()][:4]
            raise TransferError(f"request {rid!r}: KV incomplete on the receiver ((layer, head) "
                                f"{missing or 'all'} without {n or 'any'} tokens)")
        lay = self.layout
        data = slot * lay.slot_bytes + lay.header_bytes
        out = []
        for layer, widths in enumerate(lay.parts):
            parts = []
            for part, width in enumerate(widths):
                start = data + lay.part_bases[layer][part]
                rows = self._buffer[start:start + n * width * lay.element_size].view(DTYPES[lay.dtype])
                parts.append(rows.view((n,) + self.parts[layer][part].shape).clone())
            out.append(self.kinds[layer].export(self.model_config, tuple(parts)))
        return out

    def free(self, rid: str) -> None:
        if self._slots.pop(rid, None) is None:
            raise RequestError(f"request {rid!r}: no destination was reserved for it on this receiver")

    def _header(self, slot: int) -> torch.Tensor:
        lay = self.layout
        start = slot * lay.slot_bytes
        return self._buffer[start:start + lay.num_layers * lay.num_kv_heads * 8].view(torch.int64).view(
            lay.num_layers, lay.num_kv_heads)

    # -- lifetime --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._proc is None

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError("the KV receiver is closed")

    def close(self) -> None:
        """Stop the receiving process (its Mooncake engine goes with it); later writes to it fail."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()                # the child exits when its stdin closes
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        self._slots.clear()

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.close()


"""The bootstrap HTTP server an SGLang decode asks where a prefill's ranks listen.

``GET /route`` with every rank -1 answers the prefill's parallel layout (the decode builds its
``PrefillServerInfo`` from it: only the keys it knows); with a (dp, cp, tp, pp) rank it answers
that rank's ZMQ endpoint. ``GET /health`` is the decode's heartbeat. ``POST /register_dp_rank`` and
``POST /query_dp_ranks`` serve DP routing when the room does not choose the DP rank (graphcp
registers follow_bootstrap_room, so they only echo what was registered).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from graphcp.errors import ConfigError

Rank = tuple[int, int, int, int]  # (dp, cp, tp, pp)


def local_ip() -> str:
    """The address decode workers reach this engine on: SGLang's own ``SGLANG_HOST_IP`` when set,
    else the interface of the default route (127.0.0.1 on a machine without one)."""
    if os.environ.get("SGLANG_HOST_IP"):
        return os.environ["SGLANG_HOST_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class BootstrapServer:
    """Serves ``info`` and ``endpoints`` ({rank: (ip, port)}) on ``port`` (all interfaces)."""

    def __init__(self, port: int, info: dict, endpoints: dict[Rank, tuple[str, int]]) -> None:
        self.info, self.endpoints = info, endpoints
        self.room_dp: dict[int, int] = {}
        handler = type("Handler", (_Handler,), {"server_state": self})
        try:
            self.httpd = ThreadingHTTPServer(("", port), handler)
        except OSError as e:
            raise ConfigError(f"--disaggregation-bootstrap-port {port}: cannot listen ({e})") from e
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="graphcp-bootstrap", daemon=True
        )
        self.thread.start()

    def route(self, query: dict[str, list[str]]) -> tuple[int, object]:
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        try:
            rank = tuple(int(query[k][0]) for k in keys)
        except (KeyError, ValueError, IndexError):
            return 400, "Missing inputs for bootstrap server."
        if rank == (-1, -1, -1, -1):
            return 200, self.info
        if rank not in self.endpoints:
            return 404, f"Bootstrap info not found for dp, cp, tp, pp = {rank}"
        ip, port = self.endpoints[rank]
        return 200, {"rank_ip": ip, "rank_port": port}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_state: BootstrapServer

    def log_message(self, *args: object) -> None:  # the decode polls /health every few seconds
        pass

    def _reply(self, code: int, body: object) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(code)
        self.send_header(
            "Content-Type", "application/json" if not isinstance(body, str) else "text/plain"
        )
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/health":
            self._reply(200, "OK")
        elif url.path == "/route":
            self._reply(*self.server_state.route(parse_qs(url.query)))
        else:
            self._reply(404, f"no route {url.path}")

    def do_POST(self) -> None:
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            state = self.server_state
            if self.path == "/register_dp_rank":
                state.room_dp[int(body["bootstrap_room"])] = int(body["dp_rank"])
                self._reply(200, "OK")
            elif self.path == "/query_dp_ranks":
                rooms = [int(r) for r in body["bootstrap_rooms"]]
                self._reply(200, {str(r): state.room_dp[r] for r in rooms if r in state.room_dp})
            else:
                self._reply(404, f"no route {self.path}")
        except (ValueError, KeyError, TypeError) as e:
            self._reply(400, f"bad request: {e}")

"""Process helpers shared by the engine and the tools: ports and the environment of a spawned rank."""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This environment plus ``extra``, with PYTHONPATH set so a child imports this graphcp, installed or not."""
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # above graphcp/
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}

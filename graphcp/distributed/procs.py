"""Process helpers shared by the engine and the tools: ports, the environment of a spawned rank, memory."""
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


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: a rank started by fork + exec
    inherits the parent's resident size at the fork as its ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (this one by default) from /proc; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0

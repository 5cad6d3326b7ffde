"""The Mooncake Transfer Engine, started the one way graphcp uses it: P2P handshake, no metadata server."""
from __future__ import annotations

import os

from graphcp.errors import ConfigError

READY = "graphcp-kv-receiver"      # the line a receiver process prints once its engine listens

SETUP_HINT = ("install it with: pip install 'graphcp[pd]' (mooncake-transfer-engine-non-cuda on CPU), after "
              "the system libraries it links: apt-get install -y libibverbs1 librdmacm1 libnuma1 (as root; "
              "otherwise ask an administrator or use a conda env providing rdma-core and numactl)")


def transfer_engine_class():
    """``mooncake.engine.TransferEngine``, or a ConfigError saying how to install it."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")   # Mooncake logs every connection at INFO; read at import
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ConfigError(f"--disaggregation-transfer-backend mooncake: cannot import mooncake ({e}); "
                          f"{SETUP_HINT}") from e
    return TransferEngine


def start_engine(protocol: str, host: str = "127.0.0.1", timeout_s: float | None = None):
    """A Mooncake engine listening on ``host``. ``timeout_s`` bounds a TCP transfer that stops making
    progress (a receiver that hangs), so a write fails instead of waiting forever."""
    if timeout_s is not None:
        seconds = str(max(1, round(timeout_s)))
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = seconds
        os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = seconds
    engine = transfer_engine_class()()
    code = engine.initialize(host, "P2PHANDSHAKE", protocol, "")
    if code != 0:
        raise ConfigError(f"--disaggregation-transfer-protocol {protocol}: Mooncake could not start on {host} "
                          f"(code {code})")
    return engine


def session_of(engine, host: str = "127.0.0.1") -> str:
    """The address peers write to: host and the engine's handshake port."""
    return f"{host}:{engine.get_rpc_port()}"

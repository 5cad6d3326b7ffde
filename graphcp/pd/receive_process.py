"""The KV receiver's process: owns a Mooncake engine with the shared receive buffer registered, as a
decode worker would; lives until its parent closes its stdin (or dies)."""
from __future__ import annotations

import sys

import torch

from graphcp.pd.mooncake import READY, session_of, start_engine


def main() -> None:
    """The receiving process: ``python -m graphcp.pd.receive_process SHM_PATH NBYTES PROTOCOL HOST``."""
    path, nbytes, protocol, host = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    engine = start_engine(protocol, host)
    if engine.register_memory(buffer.data_ptr(), nbytes) != 0:
        raise SystemExit("graphcp KV receiver: Mooncake could not register the receive buffer")
    print(READY, session_of(engine, host).rsplit(":", 1)[1], buffer.data_ptr(), flush=True)
    sys.stdin.read()                          # until the KVReceiver closes it (or its process dies)


if __name__ == "__main__":
    main()

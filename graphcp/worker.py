"""One rank's process: join the group, build the ModelRunner, then serve commands from the engine."""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphcp.commands import execute
from graphcp.config import EngineArgs
from graphcp.errors import FAULT, ConfigError, wire_kind

if TYPE_CHECKING:
    from graphcp.runner import ModelRunner


def rank_device(args: EngineArgs, rank: int) -> torch.device:
    """This host's GPUs in turn by local rank (torchrun's LOCAL_RANK on multi-node runs; the global rank
    when the engine spawned every rank on this host)."""
    if args.resolved_device() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def process_group_backend(args: EngineArgs) -> str:
    """NCCL when every rank of this host has its own GPU; gloo on CPU or when ranks share one GPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    if args.resolved_device() == "cuda" and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def init_group(args: EngineArgs, rank: int, world: int, init_method: str) -> None:
    device = rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(args), init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.rank_timeout_s))


def worker_main(rank: int, world: int, args: EngineArgs, init_method: str, conn: Connection, parent_pid: int) -> None:
    from graphcp.runner import ModelRunner
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_group(args, rank, world, init_method)
        runner = ModelRunner(args, rank, rank_device(args, rank), capture_progress=rank == 0)
    except Exception as e:
        conn.send((wire_kind(e), str(e) if isinstance(e, ConfigError) else _describe(e)))
        return
    conn.send(("ready", runner.stats()))
    try:
        _serve(runner, rank, conn, parent_pid)
    finally:
        runner.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(runner: "ModelRunner", rank: int, conn: Connection, parent_pid: int) -> None:
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:      # the engine died: do not linger as an orphan
                return
            continue
        try:
            cmd, payload = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            conn.send(("ok", None))
            if dist.is_initialized():
                dist.barrier()      # every rank stops: let peers finish their transfers before gloo is torn down
            return
        try:
            conn.send(("ok", execute(runner, cmd, payload, over_ipc=True)))
        except Exception as e:
            kind = wire_kind(e)
            conn.send((kind, str(e) if kind != FAULT else _describe(e)))


def main() -> None:
    """Entry of a rank process started by the Engine: ``python -m graphcp.worker SOCKET_PATH RANK``."""
    from multiprocessing.connection import Client
    address, rank = sys.argv[1], int(sys.argv[2])
    authkey = bytes.fromhex(os.environ.pop("GRAPHCP_AUTHKEY"))
    # torch shares tensors between processes through multiprocessing's resource sharer, which
    # authenticates with the process authkey: use the engine's.
    multiprocessing.current_process().authkey = authkey
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(("hello", rank))
    _, (world, args, init_method, parent_pid) = conn.recv()
    worker_main(rank, world, args, init_method, conn, parent_pid)
    # Everything is closed: skip the interpreter's teardown (about a second of module and torch
    # finalizers per rank), as multiprocessing's own children do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e)[-6:])}"


if __name__ == "__main__":
    main()

"""Engine: the serving loop's handle. Starts (or, under torchrun, joins) the ranks and sends them batches."""
from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from multiprocessing.connection import wait as connection_wait
from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphcp.batch import PrefillOutput, Request
from graphcp.commands import execute, merge
from graphcp.config import EngineArgs
from graphcp.distributed.procs import child_env, free_port
from graphcp.errors import DEAD, WIRE_KINDS, ConfigError, EngineDeadError, RequestError, TransferError
from graphcp.profiling import rss_bytes

log = logging.getLogger("graphcp")


class _Proc:
    """The bits of a worker process the engine needs, over subprocess.Popen."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


class Engine:
    """``with Engine(args) as engine: engine.prefill([...])``. One process per rank; rank 0 answers."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self._lock = threading.RLock()      # one call at a time: ranks answer in order over their sockets
        self._runner = None
        self._workers: list[tuple[_Proc, Any]] = []
        self._dead: str | None = None
        self._spmd = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        self._owns_group = False            # torchrun: this engine started the process group, so it ends it
        self._sglang = None                 # SGLang PD control plane (--disaggregation-bootstrap-port)
        if not log.handlers and not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        if args.world_size > 1:                 # model-dependent flags, before any rank process starts
            from graphcp.checkpoint.config import check_model_flags
            check_model_flags(args)
        if args.disaggregation_bootstrap_port is not None:    # a model SGLang cannot take: before any rank
            from graphcp.pd.sglang.serving import check_model
            check_model(args)
        if args.attention_kernel == "triton" and args.resolved_device() == "cpu":
            from graphcp.kernels.registry import use_triton_interpreter
            use_triton_interpreter()            # before triton is imported here or in a rank process
        if self._spmd:
            self._join_torchrun()
        elif args.world_size == 1:
            from graphcp.runner import ModelRunner
            self._runner = ModelRunner(args, capture_progress=True)
            self._start_stats = self._runner.stats()
        else:
            self._spawn()
        if args.world_size > 1 and (not self._spmd or int(os.environ["RANK"]) == 0):
            from graphcp.distributed.topology import rank_map
            log.info(rank_map(args))
        if self._start_stats.get("eager_reason"):
            log.info("graphcp: prefill runs eagerly: %s", self._start_stats["eager_reason"])
        if args.disaggregation_bootstrap_port is not None:
            from graphcp.pd.sglang.serving import start_control
            try:
                self._sglang = start_control(args, self._spmd, self._lock, self._call_locked, self.release)
            except BaseException:
                self.close()
                raise

    # -- start-up --------------------------------------------------------------------------------
    def _join_torchrun(self) -> None:
        from graphcp.runner import ModelRunner
        from graphcp.worker import init_group, rank_device
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != self.args.world_size:
            raise ConfigError(f"torchrun started {world} processes but --tp x --pp is {self.args.world_size}; "
                              f"change --nproc-per-node or --tp")
        if not dist.is_initialized():
            init_group(self.args, rank, world, "env://")
            self._owns_group = True
        self._runner = ModelRunner(self.args, rank, rank_device(self.args, rank), capture_progress=rank == 0)
        self._start_stats = self._runner.stats()

    def _spawn(self) -> None:
        """One fresh interpreter per rank (``python -m graphcp.worker``), so the caller's script is never
        re-imported; each connects back over an authenticated Unix socket (no Nagle delays on replies)."""
        world = self.args.world_size
        authkey = bytes(multiprocessing.current_process().authkey)
        init = f"tcp://127.0.0.1:{free_port()}"
        with Listener(family="AF_UNIX", authkey=authkey) as listener:
            env = child_env(GRAPHCP_AUTHKEY=authkey.hex())
            procs = [subprocess.Popen([sys.executable, "-m", "graphcp.worker", listener.address, str(rank)], env=env)
                     for rank in range(world)]
            conns: dict[int, Any] = {}
            listener._listener._socket.settimeout(120.0)  # a rank that cannot start must not hang us
            try:
                while len(conns) < world:
                    conn = listener.accept()
                    _, rank = conn.recv()
                    conns[rank] = conn
            except (OSError, EOFError) as e:
                for p in procs:
                    p.kill()
                raise EngineDeadError(f"graphcp ranks failed to start: {e}") from e
        self._workers = [(_Proc(procs[r]), conns[r]) for r in range(world)]
        for _, conn in self._workers:
            conn.send(("init", (world, self.args, init, os.getpid())))
        try:
            replies = self._collect(timeout=max(600.0, self.args.rank_timeout_s))
        except BaseException:
            self.close()
            raise
        self._start_stats = replies[0]

    # -- commands --------------------------------------------------------------------------------
    def _collect(self, timeout: float) -> list[Any]:
        """One reply per rank; a dead or silent rank makes the engine unusable and shuts it down."""
        deadline = time.monotonic() + timeout
        replies: list[Any] = [None] * len(self._workers)
        pending = {conn: rank for rank, (_, conn) in enumerate(self._workers)}
        errors: list[tuple[str, str]] = []
        while pending and not any(k == DEAD for k, _ in errors):
            ready = connection_wait(list(pending), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = DEAD, f"rank {rank} closed its connection"
                if kind in ("ok", "ready"):
                    replies[rank] = payload
                else:
                    errors.append((kind, payload))
            for conn, rank in list(pending.items()):
                proc = self._workers[rank][0]
                if not proc.is_alive() and not conn.poll():
                    pending.pop(conn)
                    errors.append((DEAD, f"rank {rank} exited with code {proc.exitcode}"))
            if pending and time.monotonic() > deadline:
                errors.append((DEAD, f"ranks {sorted(pending.values())} did not answer within {timeout:.0f} s"))
        if errors:
            kinds = {k for k, _ in errors}
            request, transfer, config = (WIRE_KINDS[c] for c in (RequestError, TransferError, ConfigError))
            if kinds == {request}:
                raise RequestError(errors[0][1])
            if kinds <= {request, transfer}:      # PD: a failed transfer; the engine keeps serving
                raise TransferError(next(p for k, p in errors if k == transfer))
            if kinds == {config}:
                self.close()
                raise ConfigError(errors[0][1])
            self._dead = "; ".join(p.splitlines()[0] for _, p in errors)
            self.close(graceful=False)
            raise EngineDeadError(f"graphcp engine is unusable and was shut down: {self._dead}\n{errors[0][1]}")
        return replies

    def _call(self, cmd: str, payload: Any = None, timeout: float | None = None) -> Any:
        with self._lock:
            return self._call_locked(cmd, payload, timeout)

    def _call_locked(self, cmd: str, payload: Any, timeout: float | None) -> Any:
        if self._dead:
            raise EngineDeadError(f"graphcp engine is unusable: {self._dead}")
        if self._runner is not None:
            return self._local(cmd, payload)
        if not self._workers:
            raise EngineDeadError("graphcp engine is closed")
        for _, conn in self._workers:
            conn.send((cmd, payload))
        return merge(cmd, self._collect(timeout or self.args.rank_timeout_s))

    def _local(self, cmd: str, payload: Any) -> Any:
        return merge(cmd, self._everyone(execute(self._runner, cmd, payload)))

    def _everyone(self, item: Any) -> list[Any]:
        """Under torchrun, every rank's item (so every rank returns the same merged answer)."""
        if not (self._spmd and self.args.world_size > 1):
            return [item]
        items: list[Any] = [None] * self.args.world_size
        dist.all_gather_object(items, item)
        return items

    # -- public API ------------------------------------------------------------------------------
    def prefill(self, batch: Sequence[Request], count_host_ops: bool = False,
                force_eager: bool = False) -> PrefillOutput:
        """Prefill a batch. ``force_eager`` skips the graphs for this batch (benchmarks compare both);
        ``count_host_ops`` fills ``PrefillOutput.host_ops`` with the ops launched outside captured segments."""
        batch = list(batch) if isinstance(batch, (list, tuple)) else batch
        if isinstance(batch, list) and any(getattr(r, "bootstrap_room", None) is not None for r in batch):
            from graphcp.pd.sglang.serving import prefill_rooms
            return prefill_rooms(self._sglang, self._lock, self._call_locked, batch, count_host_ops, force_eager)
        return self._call("prefill", (batch, count_host_ops, force_eager))

    def kv_cache(self, rid: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._call("kv_cache", rid)

    def release(self, rid: str) -> None:
        with self._lock:
            if self._sglang is not None:      # an SGLang transfer still to come fails, the decode is told
                self._sglang.released(rid)
            self._call_locked("release", rid, None)

    def transfer_status(self, rid: str) -> dict:
        """SGLang PD: the state of ``rid``'s transfer ("waiting" for the decode's metadata,
        "transferring", "success", "failed" with a "reason"), its bootstrap_room, and the first token
        with its logprob and the top-128 (logprob, token id) pairs. The pages are released when it
        concludes."""
        if self._sglang is None:
            raise ConfigError("transfer_status needs an engine started with --disaggregation-bootstrap-port")
        return self._sglang.status(rid)

    def transfer_kv(self, rid: str, destination: dict) -> dict:
        """Send ``rid``'s whole cache to a decode worker's ``KVReceiver.destination(rid)`` over Mooncake;
        returns when it has arrived ({"bytes", "seconds", "ranks"}). Raises TransferError naming the request
        on failure or timeout; the KV stays cached until ``release``."""
        if self.args.disaggregation_mode != "prefill":
            raise ConfigError("transfer_kv needs a prefill worker: start the engine with --disaggregation-mode "
                              "prefill (EngineArgs disaggregation_mode='prefill')")
        timeout = self.args.rank_timeout_s + self.args.disaggregation_transfer_timeout_s
        return self._call("transfer_kv", (rid, destination), timeout=timeout)

    def stats(self) -> dict:
        return self._call("stats")

    def collective_counts(self) -> dict:
        """Collectives rank 0 has issued so far (all-gathers of K/V, last-token all-reduces)."""
        return self._call("counters")

    def rank_memory(self) -> list[int]:
        """Resident memory of each rank process in bytes (this process when the rank runs in-process)."""
        pids = [proc.popen.pid for proc, _ in self._workers] or [os.getpid()]
        return [rss_bytes(pid) for pid in pids]

    def close(self, graceful: bool = True) -> None:
        """Stop every rank; none is left behind. Not graceful after a fault: a stuck rank is not waited on.
        Waits for a call in flight on another thread (bounded by --rank-timeout)."""
        control, self._sglang = getattr(self, "_sglang", None), None
        if control is not None:             # before the lock: its worker may be waiting for it
            control.close()
        with self._lock:
            self._close(graceful)

    def _close(self, graceful: bool) -> None:
        for proc, conn in self._workers:
            try:
                if proc.is_alive() and graceful:
                    conn.send(("stop", None))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + (10 if graceful else 0)
        for proc, conn in self._workers:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            conn.close()
        self._workers = []
        if self._runner is not None and self._owns_group and dist.is_initialized():
            # Every rank closes; the barrier lets each finish its last transfers before gloo is torn down
            # (tearing it down with a peer mid-transfer can abort the process at exit).
            if graceful:
                dist.barrier()
            dist.destroy_process_group()
            self._owns_group = False
        if self._runner is not None:
            self._runner.close()            # graphs, pool and weights freed now, not at a later collection
        self._runner = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None) and hasattr(self, "_lock"):
            self.close()


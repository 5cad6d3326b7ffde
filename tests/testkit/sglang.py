"""SGLang's side of the PD tests: a process running the decode harness (``scripts/
sglang_decode_harness.py``, built from SGLang 0.5.23's own decode classes) or SGLang's own prefill,
spoken to in JSON lines. torchvision is stubbed on that process's path only."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time

from graphcp.distributed.procs import free_port
from testkit.paths import SCRIPTS

HARNESS = os.path.join(SCRIPTS, "sglang_decode_harness.py")
STUBS = os.path.join(SCRIPTS, "sglang_stubs")


class Harness:
    """An SGLang process (the decode harness, or SGLang's own prefill): JSON lines in and out."""

    def __init__(self, decodes: dict[str, str], *flags: str) -> None:
        self.port = free_port()
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in (STUBS, os.environ.get("PYTHONPATH")) if p),
            SGLANG_HOST_IP="127.0.0.1",
            MOONCAKE_PROTOCOL="tcp",
            MC_LOG_LEVEL="ERROR",
            TRITON_INTERPRET="1",
            TORCHDYNAMO_DISABLE="1",
        )
        self.log = tempfile.NamedTemporaryFile(
            prefix="sglang-harness-", suffix=".log", delete=False
        )
        specs = [f"--decode={name}={spec}" for name, spec in decodes.items()]
        self.proc = subprocess.Popen(
            [sys.executable, HARNESS, *specs, "--port", str(self.port), *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.ready = False

    def reply(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("{"):
                return json.loads(line)
            if self.proc.poll() is not None:
                break
        with open(self.log.name) as f:
            tail = f.read()[-3000:]
        raise AssertionError(f"SGLang harness gave no answer (exit {self.proc.poll()}):\n{tail}")

    def send(self, **cmd: object) -> None:
        if not self.ready:
            assert self.reply().get("ready")
            self.ready = True
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd: object) -> dict:
        self.send(**cmd)
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        os.unlink(self.log.name)

"""torchrun --nproc-per-node 2 with an SPMD script: each process is one rank of a real gloo group."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch
from testkit.hf_reference import rel_err
from testkit.paths import SCRIPTS


def test_torchrun_two_ranks(checkpoint, oracle, tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(SCRIPTS, "spmd_prefill.py")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                           script, checkpoint, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["logits"] == r1["logits"]                           # every rank returns the same output
    assert r0["mode"] == "graph" and r0["per_rank_tokens"] == [31, 30] and r0["kv_len"] == 37
    assert r0["stats"]["world_size"] == 2
    for i, ids in enumerate([list(range(3, 40)), [(7 * i) % 200 for i in range(1, 25)]]):
        ref, _ = oracle(checkpoint, ids)
        assert rel_err(torch.tensor(r0["logits"][i]), ref) <= 1e-4

"""The SGLang PD rank mappings ``test_sglang_pd.py`` does not run (each costs two more SGLang
processes or a 4-rank engine), checked against the same decode harness: graphcp attention TP 1 into
an SGLang decode at TP 2 (dense head slices, MLA replicas), DP 2 (the room's DP label differs from
the group holding the request), PP 2, DP 2 x PP 2, and CP 2 zigzag without LayerSplit (CP rank 0
writes every layer). Each case: the decode's pages equal ``engine.kv_cache`` bitwise, nothing
outside them changes, the aux row is the room's, and every page is free afterwards.

``python tests/scripts/sglang_rank_matrix.py [CASE ...]`` (about 3 minutes on 2 cores for all).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

# a script run from the command line: the tests' shared package is on its path as under pytest
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch
from testkit.hf_reference import make_checkpoint
from testkit.mla_checkpoint import DEEPSEEK_V3, write_release
from testkit.parity import random_ids
from testkit.sglang import Harness

from graphcp import Engine, EngineArgs, Request
from graphcp.distributed.procs import free_port

CASES = {  # name: (model, engine flags, decode TP)
    "tp1_into_decode_tp2": ("dense", {}, 2),
    "mla_into_decode_tp2": ("mla", {}, 2),
    "dp2": ("dense", dict(tp_size=2, dp_size=2), 1),
    "pp2": ("dense", dict(pp_size=2), 1),
    "dp2_pp2": ("dense", dict(tp_size=2, dp_size=2, pp_size=2), 1),
    "cp2_without_layer_split": (
        "dense",
        dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag"),
        1,
    ),
}


def check(engine: Engine, decodes: list[Harness], model: str, room: int, out: str) -> bool:
    ids = random_ids(45, 211, room)
    engine.prefill([Request("r", ids, bootstrap_room=room)])
    ours = engine.kv_cache("r")
    address = f"127.0.0.1:{engine.args.disaggregation_bootstrap_port}"
    for i, decode in enumerate(decodes):
        decode.send(op="receive", decode=model, bootstrap=address, room=room, tokens=len(ids),
                    out=f"{out}{i}.pt")
    ok = all(d.reply() == {"status": "success", "touched_outside": 0} for d in decodes)
    for i in range(len(decodes)):
        got, layers = torch.load(f"{out}{i}.pt"), len(ours)
        for layer in range(layers):
            if model == "mla":
                ok &= got["rows"][layer][:, 0].equal(torch.cat(ours[layer][:2], -1))
                continue
            k, v = ours[layer]
            heads = slice(i * k.shape[0] // len(decodes), (i + 1) * k.shape[0] // len(decodes))
            ok &= got["rows"][layer].transpose(0, 1).equal(k[heads])
            ok &= got["rows"][layers + layer].transpose(0, 1).equal(v[heads])
        ok &= got["aux"]["room"] == room
    deadline = time.monotonic() + 10
    while engine.stats()["kv_tokens_free"] != engine.stats()["kv_tokens_total"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return ok and engine.transfer_status("r")["state"] == "success"


def main() -> int:
    work = tempfile.mkdtemp(prefix="sglang-rank-matrix-")
    dense = make_checkpoint(os.path.join(work, "qwen3"), "qwen3", num_hidden_layers=4)
    _, twin = write_release(os.path.join(work, "mla"), DEEPSEEK_V3, seed=41, fp8=False,
                            num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16,
                            num_nextn_predict_layers=0)
    paths = {"dense": dense, "mla": os.path.join(work, "mla", "release")}
    specs = {"dense": f"{dense}:float32", "mla": f"{twin}:float32"}
    decodes = {1: [Harness(specs)],
               2: [Harness(specs, "--tp-size", "2", "--tp-rank", str(r)) for r in range(2)]}
    failed = []
    try:
        for room, name in enumerate(sys.argv[1:] or CASES, start=9001):
            model, flags, decode_tp = CASES[name]
            engine = Engine(EngineArgs(model_path=paths[model], disaggregation_mode="prefill",
                                       disaggregation_bootstrap_port=free_port(),
                                       max_total_tokens=2048, disable_cuda_graph=True, **flags))
            try:
                ok = check(engine, decodes[decode_tp], model, room, os.path.join(work, name))
            finally:
                engine.close()
            print(f"{name}: {'ok' if ok else 'FAILED'}", flush=True)
            failed += [] if ok else [name]
    finally:
        for group in decodes.values():
            for decode in group:
                decode.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Adaptive CP's cost model, measured at engine start on this model, device and CP group.

Three eager forwards (run unsharded, so each rank computes them whole) give the fixed, per-token and
per-attention-pair costs; timed all-gathers of one layer's K/V rows give the all-gather cost per token.
Every rank measures the same batches (their collectives match) and the whole world averages the
results, so every rank of every pipeline stage and DP group places batches alike.
"""
from __future__ import annotations

import time

import torch

from graphcp.cp.adaptive import CostModel
from graphcp.cp.strategy import unsharded
from graphcp.dist.comm import all_gather_into, all_reduce
from graphcp.forward_batch import ForwardBatch
from graphcp.graph.buffers import Descriptors

# (requests, new tokens each): tokens and attention pairs vary independently across the three.
_PROBES = ((1, 16), (8, 32), (1, 256))


def calibrate(runner, reps: int = 3) -> CostModel:  # noqa: ANN001 - a ModelRunner before capture
    times = [_median([_forward_seconds(runner, n_req, n) for _ in range(reps)]) for n_req, n in _PROBES]
    rows = torch.stack([torch.tensor([1.0, n_req * n, n_req * n * (n + 1) / 2]) for n_req, n in _PROBES])
    fixed, per_token, per_pair = torch.linalg.solve(rows.double(), torch.tensor(times).double()).tolist()
    per_gather = _gather_seconds_per_token(runner, 256, reps)
    values = torch.tensor([max(per_token, 1e-9), max(per_pair, 1e-12), per_gather, max(fixed, 0.0)],
                          dtype=torch.float64, device=runner.device)
    all_reduce(values, None)                        # one cost model for every rank
    per_token, per_pair, per_gather, fixed = (values / runner.args.world_size).tolist()
    return CostModel(per_token, per_pair, per_gather, fixed)


def _forward_seconds(runner, n_req: int, n: int) -> float:  # noqa: ANN001
    """One eager forward of ``n_req`` requests of ``n`` tokens; every page is the dummy page."""
    ext, prefix = [n] * n_req, [0] * n_req
    desc = Descriptors.allocate(n_req, -(-n // runner.args.page_size), n_req * n)   # page 0: the dummy page
    vocab = runner.model_config.vocab_size
    ids = torch.randint(0, vocab, (n_req * n,), generator=torch.Generator().manual_seed(n))
    desc.fill(ext, prefix, [[] for _ in ext], list(ids.split(n)))
    strategy = unsharded()
    batch = ForwardBatch(desc, strategy, n_req * n, strategy.host_maxima(ext, prefix, 0),
                         aux_out=runner._aux_buffer(n_req * n))
    _sync(runner.device)
    start = time.perf_counter()
    runner.forward(batch)
    _sync(runner.device)
    return time.perf_counter() - start


def _gather_seconds_per_token(runner, tokens: int, reps: int) -> float:  # noqa: ANN001
    """All-gather of one layer's K and V rows over the CP group, per token, for every layer."""
    cfg, comm = runner.model_config, runner.comm
    width = 2 * cfg.num_key_value_heads // runner.args.attn_tp_size * cfg.head_dim
    rows = torch.zeros(tokens, width, dtype=runner.dtype, device=runner.device)
    out = rows.new_empty((comm.size * tokens, width))
    seconds = []
    for _ in range(reps):
        _sync(runner.device)
        start = time.perf_counter()
        all_gather_into(out, rows, comm.group)
        _sync(runner.device)
        seconds.append(time.perf_counter() - start)
    return _median(seconds) * len(runner.layers) / tokens


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

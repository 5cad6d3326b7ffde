"""Adaptive CP's cost model, measured at engine start on this model, device and CP group.

Three eager forwards (run unsharded, so each rank computes them whole) give the fixed, per-token and
per-attention-pair costs; timed all-gathers of one layer's K/V rows give the all-gather cost per token.
Every rank measures the same batches (their collectives match) and the whole world averages the
results, so every rank of every pipeline stage and DP group places batches alike. The runner gives the
timed functions; nothing here reaches into it.
"""
from __future__ import annotations

from typing import Callable

import torch

from graphcp.cp.adaptive import CostModel

# (requests, new tokens each): tokens and attention pairs vary independently across the three.
_PROBES = ((1, 16), (8, 32), (1, 256))
_GATHER_TOKENS = 256


def calibrate(time_forward: Callable[[list[int]], float], time_gather: Callable[[int], float],
              average: Callable[[torch.Tensor], torch.Tensor], reps: int = 3) -> CostModel:
    """``time_forward(extend_lens)``: seconds of one eager forward of fresh requests; ``time_gather(n)``:
    seconds of every layer's K/V all-gather of ``n`` rows; ``average``: the mean over the world."""
    times = [_median([time_forward([n] * n_req) for _ in range(reps)]) for n_req, n in _PROBES]
    rows = torch.stack([torch.tensor([1.0, n_req * n, n_req * n * (n + 1) / 2]) for n_req, n in _PROBES])
    fixed, per_token, per_pair = torch.linalg.solve(rows.double(), torch.tensor(times).double()).tolist()
    per_gather = _median([time_gather(_GATHER_TOKENS) for _ in range(reps)]) / _GATHER_TOKENS
    values = torch.tensor([max(per_token, 1e-9), max(per_pair, 1e-12), per_gather, max(fixed, 0.0)],
                          dtype=torch.float64)
    per_token, per_pair, per_gather, fixed = average(values).tolist()      # one cost model for every rank
    return CostModel(per_token, per_pair, per_gather, fixed)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]

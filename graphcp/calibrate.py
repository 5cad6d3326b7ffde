"""Adaptive CP's calibration at engine start: the placement weights and the split threshold,
measured on this model, device and CP group.

Placement weights: eager forwards run unsharded (each rank computes them whole) on a ladder of
sizes that grows until each term shows above the forward's fixed cost (or a time budget ends it):
per rung, a batch of short requests (tokens, few attention pairs) and one request of the same
tokens (the pairs). A non-negative least squares of relative errors over every probe gives the
fixed, per-token and per-pair costs; timed all-gathers of every layer's cache rows give the
all-gather cost per token.

Threshold: the decision itself is timed. A batch of short requests runs whole and split (the same
rows and pairs on every rank): the difference is what a split costs beyond its work
(``per_split``). A lone request runs whole and split on a ladder of lengths; the threshold is where
the modelled gain of splitting it first exceeds ``per_split``, kept within what those timings
allow. A fit the probes do not support is re-timed, then replaced by two-point estimates; a term
below resolution is said to be; every fallback is logged.

Every rank times the same probes (their collectives match) and the world averages each rung before
anyone decides, so every rank of every pipeline stage and DP group fits and places alike. The
runner gives the timed functions; nothing here reaches into it.
"""
from __future__ import annotations

import itertools
import logging
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from graphcp.cp.adaptive import AdaptiveZigzagStrategy, CostModel
from graphcp.kv.cache import LayerParts

log = logging.getLogger("graphcp")

# (new tokens per request, placement) -> seconds of one eager forward of fresh requests; placement:
# "unsharded" (every rank runs all of it), "whole" (each request whole on one CP rank) or "split".
TimeForward = Callable[[list[int], str], float]
Average = Callable[[torch.Tensor], torch.Tensor]

SHORT = 16            # tokens per request of a rung's batch probe: tokens without many pairs
FIRST_RUNG = 256      # tokens of the first rung
GROWTH = 4            # each rung this many times the tokens of the one before (few rungs)
MAX_PROBE = 4096      # no probe beyond this many tokens (the engine is sized for its batches)
PROBE_BUDGET = 0.25   # seconds: no next rung whose forwards would take longer (a quick start)
TOKENS_SEEN = 2.0     # the token term shows once a batch takes this many times a 1-token forward
PAIRS_SEEN = 1.5      # the pair term: one request of T tokens takes this many times a batch of T
RETIME_RESIDUAL = 0.1  # rms relative error of the fit beyond which its worst probes are re-timed
MAX_RESIDUAL = 0.2    # ... and beyond which (after that) it is rejected
CLEAR = 1.15          # a placement is clearly faster when the other takes this many times as long
DECISIVE = 1.3        # ... decisively: one such rung ends the ladder, and bounds the threshold


@dataclass(frozen=True)
class Probe:
    lens: list[int]
    seconds: float

    @property
    def row(self) -> list[float]:
        """Its terms: one forward, new tokens, attention pairs."""
        return [1.0, float(sum(self.lens)), float(sum(n * (n + 1) // 2 for n in self.lens))]


@dataclass(frozen=True)
class Calibration:
    cost: CostModel
    threshold: int                       # new tokens from which a request is split
    threshold_from: str                  # how the threshold was decided
    residual: float                      # rms relative error of the fit over its probes
    crossover: tuple[tuple[int, float, float], ...]   # (new tokens, whole s, split s), lone
    fallbacks: tuple[str, ...]           # every degenerate result replaced, as a sentence
    seconds: float                       # wall time of the calibration (after the warm-up)

    def stats(self) -> dict:
        return {"threshold_from": self.threshold_from, "fit_residual": self.residual,
                "crossover": [list(row) for row in self.crossover],
                "fallbacks": list(self.fallbacks), "calibration_s": self.seconds}

    def strategy(self, cp_size: int) -> AdaptiveZigzagStrategy:
        return AdaptiveZigzagStrategy(cp_size, self.threshold, self.cost, calibration=self.stats())

    def announce(self) -> None:
        log.info("graphcp: adaptive CP: requests with >= %d new tokens are split (zigzag), shorter "
                 "ones run whole on one CP rank (threshold: %s); measured cost model: %s; fit "
                 "residual %.1f%% (calibrated in %.1f s)", self.threshold, self.threshold_from,
                 self.cost.describe(), 100 * self.residual, self.seconds)
        if self.crossover:
            log.info("graphcp: adaptive CP: lone request whole vs split: %s", ", ".join(
                f"{n}: {1e3 * w:.1f}/{1e3 * s:.1f} ms" for n, w, s in self.crossover))
        for note in self.fallbacks:
            log.warning("graphcp: adaptive CP calibration: %s", note)


class Timer:
    """Medians of repeated timings, averaged over the world: every rank then sees the same numbers.
    The reps run interleaved across the probes, so a burst of background load hits them alike."""

    def __init__(self, time_forward: TimeForward, average: Average, reps: int) -> None:
        self.time_forward, self.average, self.reps = time_forward, average, reps

    def __call__(self, *probes: tuple[list[int], str]) -> list[float]:
        samples: list[list[float]] = [[] for _ in probes]
        for _ in range(self.reps):
            for taken, (lens, placement) in zip(samples, probes):
                taken.append(self.time_forward(lens, placement))
        medians = torch.tensor([statistics.median(s) for s in samples], dtype=torch.float64)
        return self.average(medians).tolist()


def calibrate(time_forward: TimeForward, time_gather: Callable[[int], float], average: Average,
              cp_size: int, max_len: int, threshold: int | None = None,
              reps: int = 3) -> Calibration:
    """``time_gather(n)``: seconds of every layer's all-gather of ``n`` cache rows; ``average``:
    the mean over the world; ``max_len``: the longest request the engine takes; ``threshold``: the
    user's (then only the placement weights are measured)."""
    timed = ("unsharded",) if threshold else ("unsharded", "whole", "split")
    for placement in timed:                  # the first calls pay one-time costs: not timed
        time_forward([4 * cp_size], placement)
    start, notes = time.perf_counter(), []
    timer = Timer(time_forward, average, reps)
    cost, residual, top = fit_costs(timer, min(max_len, MAX_PROBE), notes)
    gathers = [time_gather(top) for _ in range(reps)]     # the top rung's rows
    gather = average(torch.tensor([statistics.median(gathers)], dtype=torch.float64)).item()
    cost = replace(cost, per_gather_token=gather / top)
    crossover: list[tuple[int, float, float]] = []
    source = "--adaptive-cp-threshold"
    if threshold is None:
        cost = replace(cost, per_split=split_overhead(timer, cp_size, max_len))
        crossover = lone_crossover(timer, cost, cp_size, min(max_len, top))
        cost, threshold, source = decide_threshold(cost, cp_size, crossover, notes)
    return Calibration(cost, threshold, source, residual, tuple(crossover), tuple(notes),
                       time.perf_counter() - start)


def fit_costs(timer: Timer, max_tokens: int, notes: list[str]) -> tuple[CostModel, float, int]:
    """The placement weights from the probe ladder (see the module doc), or a stated fallback;
    the fit's residual and the top rung's tokens."""
    probes, top = probe_ladder(timer, max_tokens)
    costs, residual = nnls_fit(probes)
    if residual > RETIME_RESIDUAL:       # a burst of load can spoil a probe: time the worst again
        errors = relative_errors(probes, costs)
        worst = [i for i, e in enumerate(errors) if abs(e) > RETIME_RESIDUAL]
        again = timer(*((probes[i].lens, "unsharded") for i in worst))
        for i, seconds in zip(worst, again):       # background load only ever slows a probe
            probes[i] = Probe(probes[i].lens, min(probes[i].seconds, seconds))
        before, (costs, residual) = residual, nnls_fit(probes)
        notes.append(f"the fit left {100 * before:.0f}% rms unexplained; {len(worst)} probes "
                     f"timed again ({100 * residual:.0f}% after)")
    fixed, per_token, per_pair = costs
    base, batch, single = probes[0], probes[-2], probes[-1]
    growth = single.seconds / batch.seconds
    reason = (f"it leaves {100 * residual:.0f}% rms of the probes unexplained"
              if residual > MAX_RESIDUAL else "its per-token cost is 0" if per_token <= 0
              else f"its per-pair cost is 0 where one {top}-token request took {growth:.2f}x a "
                   f"batch of {top} tokens" if per_pair <= 0 and growth >= PAIRS_SEEN else None)
    if reason is not None:
        fixed, per_token, per_pair = two_point(base, batch, single)
        notes.append(f"cost fit rejected ({reason}): placement weights from the {top}-token rung "
                     f"(per token {per_token * 1e6:.3g} us, per pair {per_pair * 1e9:.3g} ns)")
    if batch.seconds < TOKENS_SEEN * base.seconds:
        notes.append(f"token cost below resolution: a batch of {top} tokens took "
                     f"{batch.seconds / base.seconds:.2f}x a 1-token forward; the per-token cost "
                     f"is a rough estimate (placement balances tokens all the same)")
    if per_pair <= 0:
        notes.append(f"attention cost below resolution: one {top}-token request took "
                     f"{growth:.2f}x a batch of {top} tokens; placement weighs new tokens only")
    return CostModel(per_token, per_pair, fixed=fixed), residual, top


def probe_ladder(timer: Timer, max_tokens: int) -> tuple[list[Probe], int]:
    """A 1-token forward, then per rung (256, 1024, ... tokens) a batch of short requests and one
    request, until both terms show (or ``max_tokens``, or the next rung's forwards would exceed
    ``PROBE_BUDGET``); then two requests of half the top rung each. Returns the probes (the top
    rung's batch and single request last) and the top rung's tokens."""
    (base,) = timer(([1], "unsharded"))
    probes, tokens = [Probe([1], base)], min(FIRST_RUNG, max_tokens)
    while True:
        short = min(SHORT, tokens // 4 or 1)
        batch, single = [short] * (tokens // short), [tokens]
        seconds = timer((batch, "unsharded"), (single, "unsharded"))
        probes += [Probe(batch, seconds[0]), Probe(single, seconds[1])]
        shown = seconds[0] >= TOKENS_SEEN * base and seconds[1] >= PAIRS_SEEN * seconds[0]
        # the next rung's single request: tokens grow by GROWTH, pairs by its square
        costly = (base + (seconds[0] - base) * GROWTH
                  + max(0.0, seconds[1] - seconds[0]) * GROWTH ** 2) > PROBE_BUDGET
        if shown or costly or GROWTH * tokens > max_tokens:
            # the top rung's pairs once more, halved: one slow probe cannot set them alone
            halves = [tokens // 2, tokens - tokens // 2]
            probes.insert(-2, Probe(halves, timer((halves, "unsharded"))[0]))
            return probes, tokens
        tokens *= GROWTH


def nnls_fit(probes: list[Probe]) -> tuple[list[float], float]:
    """(fixed, per token, per pair) >= 0 minimizing the squared relative errors (a 10 ms probe
    counts as much as a 1 s one), and the rms relative error. Exact non-negative least squares for
    three terms: the best unconstrained solution over the column subsets that is non-negative."""
    seconds = torch.tensor([p.seconds for p in probes], dtype=torch.float64)
    rows = torch.tensor([p.row for p in probes], dtype=torch.float64) / seconds[:, None]
    scale = rows.norm(dim=0).clamp(min=1e-300)       # columns of equal norm: a conditioned solve
    rows, ones = rows / scale, torch.ones(len(probes), dtype=torch.float64)
    best, best_error = torch.zeros(3, dtype=torch.float64), float(len(probes))
    subsets = itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (1, 2, 3))
    for cols in subsets:
        x = torch.linalg.lstsq(rows[:, cols], ones[:, None]).solution[:, 0]
        if bool((x >= 0).all()):
            full = torch.zeros(3, dtype=torch.float64)
            full[list(cols)] = x
            error = float(((rows @ full - ones) ** 2).sum())
            if error < best_error:
                best, best_error = full, error
    return (best / scale).tolist(), (best_error / len(probes)) ** 0.5


def relative_errors(probes: list[Probe], costs: list[float]) -> list[float]:
    return [sum(c * r for c, r in zip(costs, p.row)) / p.seconds - 1 for p in probes]


def two_point(base: Probe, batch: Probe, single: Probe) -> tuple[float, float, float]:
    """(fixed, per token, per pair) from the 1-token forward and the top rung's two probes. A term
    that did not show gets its upper bound for tokens (the batch's time over its tokens), 0 for
    pairs: placement then balances tokens."""
    tokens, pairs = batch.row[1], max(1.0, single.row[2] - batch.row[2])
    per_token = (batch.seconds - base.seconds) / max(1.0, tokens - 1)
    if per_token <= 0:
        per_token = batch.seconds / tokens
    return base.seconds, per_token, max(0.0, single.seconds - batch.seconds) / pairs


def gather_widths(parts: LayerParts, dtype: torch.dtype) -> dict[int, int]:
    """{row width in ``dtype`` elements: layers}: what each layer's attention gathers per token,
    one collective of the row its kind caches (K and V; an MLA latent and its indexer keys; ...).
    A kind that caches no rows gathers none."""
    widths: dict[int, int] = {}
    for layer_parts in parts.values():
        size = sum(p.width * (p.dtype or dtype).itemsize for p in layer_parts)
        if size:
            width = -(-size // dtype.itemsize)
            widths[width] = widths.get(width, 0) + 1
    return widths


def split_overhead(timer: Timer, cp_size: int, max_len: int) -> float:
    """What splitting one request costs every rank beyond its work: 4C requests of 4C tokens run
    whole (4 on each rank) and split hold the same rows, pairs and gathers on every rank, so the
    difference is 4C splits' own cost (4C times one split's: it shows above the noise). Both are
    timed twice and the faster medians kept: a burst on one of two close timings would set it."""
    count, n = 4 * cp_size, min(4 * cp_size, max_len)
    probes = (([n] * count, "whole"), ([n] * count, "split"))
    whole, split = map(min, zip(timer(*probes), timer(*probes)))
    return max(0.0, split - whole) / count


def lone_crossover(timer: Timer, cost: CostModel, cp_size: int,
                   max_len: int) -> list[tuple[int, float, float]]:
    """(n, whole s, split s) of one request on a ladder n = 16C, 64C, ... until splitting is
    clearly faster on two rungs in a row, or decisively on one (or ``max_len``, the cost ladder's
    top rung; or the next rung's forwards would exceed ``PROBE_BUDGET`` by ``cost``)."""
    rows, n = [], 16 * cp_size
    while n <= max_len:
        whole, split = timer(([n], "whole"), ([n], "split"))
        rows.append((n, whole, split))
        clear = len(rows) >= 2 and all(w >= CLEAR * s for _, w, s in rows[-2:])
        following = AdaptiveZigzagStrategy(cp_size, GROWTH * n + 1)        # whole, GROWTH n
        if whole >= DECISIVE * split or clear or \
                cost.seconds(following, [GROWTH * n], [0]) > PROBE_BUDGET:
            break
        n *= GROWTH
    return rows


def decide_threshold(cost: CostModel, cp_size: int, crossover: list[tuple[int, float, float]],
                     notes: list[str]) -> tuple[CostModel, int, str]:
    """The threshold where the model's gain of splitting a lone request first exceeds the split's
    own cost (``per_split``), kept in the range the lone-request timings allow: above every rung
    where whole was decisively faster, at most the first rung where split was (that bound wins a
    conflict: keeping a long request whole can cost up to C times its split time, splitting a short
    one only ``per_split``). Where the timings move it, ``per_split`` follows (the model's
    crossover is then the threshold)."""
    if not crossover:       # no request of 16C tokens fits: split what can be split
        notes.append(f"no lone request of {16 * cp_size} tokens fits the context: every request "
                     f"of >= {2 * cp_size} tokens is split")
        return replace(cost, per_split=0.0), 2 * cp_size, "split everything (no room to measure)"
    limit = 2 * crossover[-1][0]
    lo, hi = 2 * cp_size, limit
    while lo < hi:                   # the gain grows with n: the first n where it exceeds per_split
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if lone_gain(cost, cp_size, mid) > cost.per_split else (mid + 1, hi)
    modelled = lo
    whole_wins = [n for n, w, s in crossover if s >= DECISIVE * w]
    split_wins = [n for n, w, s in crossover if w >= DECISIVE * s]
    threshold = min(max([modelled] + [n + 1 for n in whole_wins]), min(split_wins, default=limit))
    if threshold != modelled:
        per_split = lone_gain(cost, cp_size, threshold)
        notes.append(f"modelled threshold {modelled} is outside what the lone-request timings "
                     f"allow (whole decisively faster at {whole_wins or 'no'} tokens, split at "
                     f"{split_wins or 'no'} tokens): {threshold} instead, per split request "
                     f"{per_split * 1e3:.3g} ms")
        return replace(cost, per_split=per_split), threshold, "the lone-request timings"
    if threshold >= limit:
        notes.append(f"a lone request was never decisively faster split up to "
                     f"{crossover[-1][0]} tokens: requests of >= {limit} are split")
    return cost, threshold, "the cost model, within the lone-request timings"


def lone_gain(cost: CostModel, cp_size: int, n: int) -> float:
    """Modelled seconds a lone request of ``n`` tokens saves split rather than whole, before
    ``per_split``."""
    bare = CostModel(cost.per_token, cost.per_pair, cost.per_gather_token)
    whole = AdaptiveZigzagStrategy(cp_size, n + 1, bare)
    split = AdaptiveZigzagStrategy(cp_size, 2 * cp_size, bare)
    return bare.seconds(whole, [n], [0]) - bare.seconds(split, [n], [0])

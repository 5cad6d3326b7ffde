"""The first output token, chosen as SGLang's prefill chooses it, and the aux (metadata) row that
carries it to the decode.

SGLang's sampler (``layers/sampler.py``, 0.5.23): temperature 0 means top_k 1, and a batch of
top_k 1 is greedy (argmax, logprobs log_softmax of the raw logits). Otherwise the logits are divided
by the temperature and softmaxed; top-k / top-p / min-p zero the tail of the sorted probabilities;
the token is drawn with the Gumbel-max trick over a MurmurHash3 of (seed, position, token id), the
deterministic path SGLang takes under ``--enable-deterministic-inference`` (seed: the request's
``sampling_seed``, else 42; position: the prompt length minus one). Logprobs are log(probs) after
the temperature. The decode reads the top-``top_logprobs_num`` entries of a top-128 list, so every
row carries the top 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from graphcp.errors import RequestError

AUX_BUFFERS = 10  # MetadataBuffers.get_buf_infos() with SGLang's defaults
TOP_LOGPROBS = 128  # MetadataBuffers' max_top_logprobs_num
DEFAULT_SEED = 42  # SGLang's seed for a request without sampling_seed
_EPS = 1e-6  # SGLang's _SAMPLING_EPS
# Fields that change the first token in ways graphcp does not reproduce (refused, naming them);
# everything else in SGLang's sampling_params only shapes later tokens or the text.
_REFUSED = {
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "min_new_tokens": 0,
    "custom_params": None,
    "watermark": None,
}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    sampling_seed: int | None = None

    @classmethod
    def parse(cls, rid: str, params: dict | None) -> "SamplingParams":
        """SGLang's ``sampling_params`` dict (None values mean the default); RequestError naming
        the field for a bad value or one graphcp cannot honour for the first token."""
        params = {k: v for k, v in (params or {}).items() if v is not None}
        for key, default in _REFUSED.items():
            if key in params and params[key] not in (default, "", {}, []):
                raise RequestError(
                    f"request {rid!r}: sampling_params[{key!r}] changes the first token "
                    f"and graphcp's prefill does not apply it"
                )
        values = {
            k: params[k]
            for k in ("temperature", "top_p", "top_k", "min_p", "sampling_seed")
            if k in params
        }
        try:
            out = cls(
                **{
                    k: (int(v) if k in ("top_k", "sampling_seed") else float(v))
                    for k, v in values.items()
                }
            )
        except (TypeError, ValueError) as e:
            raise RequestError(f"request {rid!r}: sampling_params: {e}") from e
        checks = (
            ("temperature", math.isfinite(out.temperature) and out.temperature >= 0, ">= 0"),
            ("top_p", 0 < out.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= out.min_p <= 1, "in [0, 1]"),
            ("top_k", out.top_k == -1 or out.top_k >= 1, "-1 or >= 1"),
        )
        for key, ok, rule in checks:
            if not ok:
                raise RequestError(
                    f"request {rid!r}: sampling_params[{key!r}] must be {rule}, "
                    f"got {getattr(out, key)!r}"
                )
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1


@dataclass(frozen=True)
class FirstToken:
    token: int
    logprob: float
    top_ids: list[int]  # the 128 likeliest tokens, best first
    top_logprobs: list[float]


def first_token(logits: torch.Tensor, params: SamplingParams, position: int) -> FirstToken:
    """The first output token from one row of last-token logits [vocab]."""
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if params.greedy:
        token = int(torch.argmax(logits))
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        logprobs = torch.log(probs)
        if params.top_k == -1 and params.top_p >= 1.0 and params.min_p <= 0.0:
            weights, order = logprobs.double(), None  # SGLang's log in float32, then float64
        else:
            sorted_probs, order = probs.sort(descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            if params.top_k != -1:
                sorted_probs[params.top_k :] = 0.0
            sorted_probs[before > params.top_p] = 0.0
            if params.min_p > 0:
                sorted_probs[sorted_probs < sorted_probs[0] * params.min_p] = 0.0
            weights = torch.log(sorted_probs.double())
        seed = DEFAULT_SEED if params.sampling_seed is None else params.sampling_seed
        pick = gumbel_argmax(weights.numpy(), seed, position)
        token = int(order[pick]) if order is not None else pick
    top = torch.topk(logprobs, min(TOP_LOGPROBS, logprobs.numel()))
    return FirstToken(
        token, float(logprobs[token]), top.indices.tolist(), top.values.float().tolist()
    )


def _mix(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit block mix, on uint64 arrays holding 32-bit values."""
    m = np.uint64(0xFFFFFFFF)
    k = (k * np.uint64(0xCC9E2D51)) & m
    k = ((k << np.uint64(15)) | (k >> np.uint64(17))) & m
    k = (k * np.uint64(0x1B873593)) & m
    h = h ^ k
    h = ((h << np.uint64(13)) | (h >> np.uint64(19))) & m
    return (h * np.uint64(5) + np.uint64(0xE6546B64)) & m


def murmur_hash(seed: int, position: int, columns: np.ndarray) -> np.ndarray:
    """SGLang's ``murmur_hash32``: blocks seed low, seed high, position, column; length 16."""
    m = np.uint64(0xFFFFFFFF)
    seed &= (1 << 64) - 1
    h = np.zeros(1, dtype=np.uint64)
    for block in (seed & 0xFFFFFFFF, seed >> 32, position & 0xFFFFFFFF):
        h = _mix(h, np.array([block], dtype=np.uint64))
    h = _mix(np.broadcast_to(h, columns.shape), columns.astype(np.uint64) & m) ^ np.uint64(16)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & m
    return h ^ (h >> np.uint64(16))


def gumbel_argmax(logprobs: np.ndarray, seed: int, position: int) -> int:
    """``multinomial_with_seed`` for one row: argmax of logprobs plus Gumbel noise from the hash."""
    uniform = murmur_hash(seed, position, np.arange(logprobs.size)).astype(np.float64) / 0xFFFFFFFF
    with np.errstate(divide="ignore"):
        noise = np.clip(np.log(uniform), np.finfo(np.float64).min, -(2.0**-32))
    noise = -np.log(-noise)
    return int(np.argmax(noise + logprobs.astype(np.float64)))


def aux_rows(first: FirstToken, room: int) -> list[bytes]:
    """One row of each of SGLang's MetadataBuffers, in ``get_buf_infos`` order: output_ids,
    cached_tokens (graphcp has no prefix cache: 0), the token's logprob and id, the top-128 logprobs
    and ids, topk_p / topk_index / hidden_states (speculative decoding only: zeros), bootstrap_room.
    (The DSA seed row comes only with DSA models, which this path refuses.)"""

    def row(width: int, dtype: type, head: list | None = None) -> bytes:
        values = np.zeros(width, dtype=dtype)
        if head:
            values[: len(head)] = head
        return values.tobytes()

    rows = [
        row(16, np.int32, [first.token]),
        row(16, np.int32),
        row(16, np.float32, [first.logprob]),
        row(16, np.int32, [first.token]),
        row(TOP_LOGPROBS, np.float32, first.top_logprobs),
        row(TOP_LOGPROBS, np.int32, first.top_ids),
        row(16, np.float32),
        row(16, np.int64),
        row(16, np.float32),
        row(8, np.uint64, [room]),
    ]
    assert len(rows) == AUX_BUFFERS
    return rows

"""RoPE as transformers 5 computes it (``modeling_rope_utils.py``): a config.json's rope parameters
in either spelling, standardized as HF standardizes them, then each rope type's inverse frequencies
and attention factor (HF multiplies cos and sin by it). The llama family and the DSA models share
it: HF's DeepSeek V3.2 and GLM-5 rotary modules call the same functions, YaRN included.

``dynamic`` and ``longrope`` are the two types whose HF frequencies depend on the forward call:
``dynamic`` rescales once a call passes ``max_position_embeddings`` and ``longrope`` switches every
position to ``long_factor`` once a call passes ``original_max_position_embeddings``, so a request's
result would depend on how it is chunked and batched. Below those lengths both are fixed tables,
and graphcp serves them there only: the context limit is ``max_position_embeddings`` for
``dynamic``, and ``longrope`` is refused when ``max_position_embeddings`` passes the original one.
"""
from __future__ import annotations

import math

import torch

from graphcp.errors import ConfigError

DEFAULT_THETA = 10000.0
_ORIGINAL = "original_max_position_embeddings"
# The keys HF requires per rope type (after standardization, which supplies rope_theta and the
# original context); a missing one is a KeyError in transformers and a ConfigError here.
REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
            "yarn": ("factor", _ORIGINAL), "longrope": ("short_factor", "long_factor", _ORIGINAL),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", _ORIGINAL),
            "proportional": ()}
_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", _ORIGINAL)
_FALSY_IS_DEFAULT = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")   # HF reads ``x or d``


def read_rope(raw: dict, rope_dim: int, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, the standardized parameters, None for the default type) of a config.json.

    As transformers reads it: a non-empty legacy ``rope_scaling`` replaces ``rope_parameters``
    whole; ``rope_theta`` inside the parameters wins over the top-level one (default 10000); a
    top-level ``partial_rotary_factor`` joins them; ``type`` spells ``rope_type``; for llama3, yarn
    and longrope a top-level ``original_max_position_embeddings`` wins, else the parameters' own,
    else ``max_position_embeddings``."""
    source = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(raw.get(source) or {}, dict):
        raise ConfigError(f"--model-path: {source} must be a mapping, got {raw.get(source)!r}")
    params = dict(raw.get(source) or {})
    if any(key in (raw.get("layer_types") or ()) for key in params):
        raise ConfigError(f"--model-path: per-layer {source} (keyed by layer_types) are not "
                          "supported: give one set of rope parameters")
    params.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    rope_type = params.setdefault("rope_type", params.get("type", "default"))
    if rope_type not in REQUIRED:
        raise ConfigError(f"--model-path: {source} rope_type {rope_type!r} is not supported "
                          f"({', '.join(REQUIRED)})")
    if rope_type in ("llama3", "yarn", "longrope"):
        if _ORIGINAL in raw:
            params[_ORIGINAL] = raw[_ORIGINAL]
        params.setdefault(_ORIGINAL, max_positions)
    missing = [k for k in REQUIRED[rope_type] if k not in params]
    if missing:
        raise ConfigError(f"--model-path: {source} rope_type {rope_type!r} needs "
                          f"{', '.join(missing)}")
    theta = params["rope_theta"]
    if not isinstance(theta, (int, float)) or theta <= 1:
        raise ConfigError(f"--model-path: rope_theta={theta!r} must be a number > 1")
    _check_values(params, source, rope_dim, max_positions)
    return float(theta), None if rope_type == "default" else params


def partial_rotary(raw: dict, head_dim: int) -> tuple[int, dict]:
    """(rotary dim, the config as ``read_rope`` should then see it) of a model whose attention
    rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each head and passes the
    rest (HF's GLM-4.5 and Qwen3-Next attention): the factor is the rope parameters' own, else the
    top-level one (a family's default filled in there), else 1; it sets the rotary dim, so the
    reader does not apply it again. ``proportional`` rope keeps the whole head (HF builds its table
    over the head, the still angles included)."""
    source = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(source) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"--model-path: {source} must be a mapping, got {params!r}")
    if params.get("rope_type", params.get("type")) == "proportional":
        return head_dim, raw
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    factor = 1.0 if factor is None else factor
    numeric = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    rotary = int(head_dim * factor) if numeric and 0 < factor <= 1 else 0
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"--model-path: partial_rotary_factor={factor!r} must give an even "
                          f"rotary size in (0, head_dim={head_dim}]")
    rest = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    config = {k: v for k, v in raw.items() if k not in ("partial_rotary_factor", "rope_scaling")}
    return rotary, {**config, "rope_parameters": None, source: rest or None}


def _check_values(params: dict, source: str, rope_dim: int, max_positions: int) -> None:
    rope_type = params["rope_type"]
    for key in _POSITIVE + _FALSY_IS_DEFAULT:
        value = params.get(key)
        # yarn and longrope derive a null factor from the context lengths, as HF does
        derived = key == "factor" and rope_type in ("yarn", "longrope")
        if value is None and (key not in REQUIRED[rope_type] or derived):
            continue
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or value < 0 or (value == 0 and key in _POSITIVE):
            bound = "a positive number" if key in _POSITIVE else "a number >= 0"
            raise ConfigError(f"--model-path: {source} {key}={value!r} must be {bound}")
    fraction = params.get("partial_rotary_factor", 1.0)
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError(f"--model-path: partial_rotary_factor={fraction!r} must be in (0, 1]")
    if rope_type not in ("default", "proportional") and int(rope_dim * fraction) != rope_dim:
        # HF's default rope ignores it; every other type builds a shorter table that HF's
        # attention cannot apply to the head (a shape error in transformers).
        raise ConfigError(f"--model-path: partial_rotary_factor={fraction} with rope_type "
                          f"{rope_type!r} is not supported (the whole head is rotated)")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(params[key], list) or len(params[key]) != rope_dim // 2:
                raise ConfigError(f"--model-path: {source} {key} must list {rope_dim // 2} "
                                  f"numbers (rotary dim / 2)")
        if max_positions > params[_ORIGINAL]:
            raise ConfigError(
                f"--model-path: rope_type 'longrope' with max_position_embeddings="
                f"{max_positions} > {_ORIGINAL}={params[_ORIGINAL]} is not supported: past the "
                "original context HF switches every position of a forward call to long_factor, "
                "which depends on how a request is chunked and batched")


def rope_positions(params: dict | None, max_positions: int) -> int:
    """Positions the tables cover, the context graphcp serves: YaRN's extended context
    (``factor`` x the original, as the scaling declares) where it passes
    ``max_position_embeddings``; ``max_position_embeddings`` otherwise (for ``dynamic``, the range
    where HF's frequencies stay fixed)."""
    if params is not None and params["rope_type"] == "yarn":
        return max(max_positions, int(_yarn_factor(params, max_positions) * params[_ORIGINAL]))
    return max_positions


def inv_freq(theta: float, params: dict | None, dim: int,
             max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] fp32, attention factor), as HF's rope init functions."""
    rope_type = "default" if params is None else params["rope_type"]
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "linear":
        return 1.0 / (theta ** exponents) / params["factor"], 1.0
    if rope_type == "dynamic":
        # HF's value at sequence length max_position_embeddings: the base stays theta.
        factor = params["factor"]
        scale = (factor * max_positions / max_positions) - (factor - 1)
        base = theta * scale ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if rope_type == "llama3":
        return _llama3(1.0 / (theta ** exponents), params), 1.0
    if rope_type == "proportional":
        # The first partial_rotary_factor of the angles turn, the rest stay still (zero frequency).
        angles = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
        turning = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
        still = torch.zeros(dim // 2 - angles, dtype=torch.float32)
        return torch.cat((turning, still)) / params.get("factor", 1.0), 1.0
    if rope_type == "longrope":
        return _longrope(theta, params, exponents, max_positions)
    return _yarn(theta, params, dim, max_positions)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(params: dict, max_positions: int) -> float:
    factor = params["factor"]
    return max_positions / params[_ORIGINAL] if factor is None else float(factor)


def _yarn(theta: float, params: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Frequencies turning fewer than ``beta_slow`` times over the original context are divided
    by ``factor``, those turning more than ``beta_fast`` times kept, a linear ramp between."""
    factor, original = _yarn_factor(params, max_positions), params[_ORIGINAL]
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:    # the feature index that turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp                                   # weight of the unscaled frequency
    inv = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv, float(attention)


def _longrope(theta: float, params: dict, exponents: torch.Tensor,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """The short factors (every served position is within the original context)."""
    original = params[_ORIGINAL]
    factor = params.get("factor")
    factor = max_positions / original if factor is None else factor
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(params["short_factor"], dtype=torch.float32)
    return 1.0 / (short * theta ** exponents), float(attention)


def _llama3(inv: torch.Tensor, params: dict) -> torch.Tensor:
    """Long wavelengths divided by ``factor``, short ones kept, the band between blended."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params[_ORIGINAL]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(theta: float, params: dict | None, dim: int,
                max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, dim] fp32 on the CPU: cat(freqs, freqs) per position, times the
    attention factor, as HF's rotary forward computes them for each position."""
    inv, attention = inv_freq(theta, params, dim, max_positions)
    with torch.device("cpu"):
        pos = torch.arange(rope_positions(params, max_positions), dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention

"""Engine flags the tests share."""
from __future__ import annotations


def cp_kwargs(cp: int, strategy: str = "zigzag", **extra) -> dict:
    if cp == 1:
        return dict(extra)
    return dict(tp_size=cp, attn_cp_size=cp, enable_prefill_cp=True, cp_strategy=strategy, **extra)

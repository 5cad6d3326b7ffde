"""What the SGLang PD tests share: the module guard and the checks of a decode's pages."""
from __future__ import annotations

import importlib.util
import os
import time

import pytest

from testkit.hf_reference import rel_err
from testkit.parity import TOL


def require_sglang_pd() -> None:
    """Skip the calling test module unless Mooncake and SGLang 0.5.23 import (call at import)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # graphcp's endpoints stay on loopback
    pytest.importorskip(
        "mooncake.engine",
        reason="the Mooncake Transfer Engine is not importable: pip install "
        "'graphcp[pd]' and apt-get install libibverbs1 librdmacm1 libnuma1 (README, PD section)",
    )
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("zmq") is None:
        pytest.skip(
            "SGLang 0.5.23 is not installed (make setup installs it: README, SGLang PD section)",
            allow_module_level=True,
        )


def bootstrap_addr(engine) -> str:
    return f"127.0.0.1:{engine.args.disaggregation_bootstrap_port}"


def all_free(engine) -> None:
    """Every page is back once the transfers concluded (released right after their status)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["kv_tokens_free"] == stats["kv_tokens_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"pages leaked: {engine.stats()['kv_tokens_free']} of {engine.stats()['kv_tokens_total']}"
    )


def check_dense(got: dict, ours: list, ref: list, n: int) -> None:
    """Decode rows (K of each layer, then V) equal the engine's cache bitwise, HF's within TOL."""
    layers = len(ours)
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(ours, ref)):
        k_got, v_got = (got["rows"][i].transpose(0, 1) for i in (layer, layers + layer))
        assert k_got.shape == k.shape == (2, n, 32)
        assert k_got.equal(k) and v_got.equal(v), (
            f"layer {layer}: the decode's pages differ from graphcp's"
        )
        assert rel_err(k_got, k_ref) <= TOL and rel_err(v_got, v_ref) <= TOL

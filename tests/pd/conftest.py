"""Fixtures of the SGLang PD tests (``test_sglang_pd.py``, ``test_sglang_serve.py``): one SGLang
decode harness process for both modules (its start is most of their cost)."""
from __future__ import annotations

import pytest
from testkit.engines import cp_kwargs
from testkit.sglang import Harness

from graphcp.distributed.procs import free_port


@pytest.fixture(scope="session")
def mla_paths(ckpt_dir):
    """A DeepSeek-V3 (dense MLA, no indexer) checkpoint and HF's twin; written on first use."""
    return str(ckpt_dir / "sglang-mla" / "release"), str(ckpt_dir / "sglang-mla" / "oracle")


@pytest.fixture(scope="session")
def decode(checkpoint, mla_paths):
    """One SGLang decode process with three decode instances: the dense checkpoint in fp32, the same
    in SGLang's own dtype resolution (fp16: a geometry graphcp's fp32 pool does not match), MLA."""
    harness = Harness(
        {
            "dense": f"{checkpoint}:float32",
            "fp16": f"{checkpoint}:auto",
            "mla": f"{mla_paths[1]}:float32",
        }
    )  # the twin: no auto_map to remote code
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def cp_engine(checkpoint, engines, decode):
    """CP 2 with LayerSplit (each CP rank owns one of the two layers) x attention TP 2 (one KV
    head each)."""
    return engines.get(
        checkpoint,
        **{**cp_kwargs(2, "interleave"), "tp_size": 4},
        disaggregation_mode="prefill",
        enable_dsa_cache_layer_split=True,
        disaggregation_bootstrap_port=free_port(),
    )

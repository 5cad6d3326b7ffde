"""A model family as one record: what graphcp needs to know of it, given in one place (its folder's
``__init__.py``) and registered with one line in ``models/registry.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from graphcp.models.config import Fields, ModelConfig


def _no_tensors(cfg: ModelConfig) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Family:
    name: str
    # architecture -> the model_type transformers builds it from (AutoModelForCausalLM)
    architectures: dict[str, str]
    # (config.json with the architecture's defaults, architecture) -> ModelConfig's fields
    read_config: Callable[[Fields, str], dict]
    model: type                          # its DecoderLM (models/common/decoder.py)
    # per architecture: transformers' class defaults for fields a config.json may leave out
    hf_defaults: dict[str, dict] = field(default_factory=dict)
    # (EngineArgs, config) -> None: the flags it restricts further (its errors name the flag)
    check_flags: Callable[[Any, ModelConfig], None] | None = None
    # checkpoint tensor-name prefixes the model does not load (multi-token-prediction layers)
    unused_tensors: Callable[[ModelConfig], tuple[str, ...]] = _no_tensors
    # a checkpoint reader's names as the model's (a release with names of its own)
    rename_tensors: Callable[[Any], Any] | None = None
    # its KV is one latent row per token (SGLang reserves more for MLA graphs)
    latent_attention: bool = False

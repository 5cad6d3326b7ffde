"""Every model family graphcp serves, one line each, and how a config.json finds its family: by
``architectures``, or by ``model_type`` where the config names none."""
from __future__ import annotations

from graphcp.errors import ConfigError
from graphcp.models import deepseek, deepseek_v4, glm4_moe, gpt_oss, llama, qwen3_next
from graphcp.models.config import Fields, ModelConfig, check_sizes
from graphcp.models.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    deepseek.FAMILY,
    deepseek_v4.FAMILY,
    qwen3_next.FAMILY,
    glm4_moe.FAMILY,
    gpt_oss.FAMILY,
)
_BY_ARCH = {arch: f for f in FAMILIES for arch in f.architectures}
_ARCH_OF_TYPE = {model_type: arch for f in FAMILIES for arch, model_type in f.architectures.items()}


def family_of(cfg: ModelConfig) -> Family:
    return next(f for f in FAMILIES if f.name == cfg.family)


def model_class(cfg: ModelConfig) -> type:
    return family_of(cfg).model


def config_from_dict(raw: dict, source: str) -> ModelConfig:
    """The ModelConfig of a config.json (``source`` names it in errors): its family reads it over
    transformers' defaults for the architecture; every family gets the size checks."""
    archs = raw.get("architectures") or [_ARCH_OF_TYPE.get(raw.get("model_type", ""), "")]
    arch = archs[0] if archs else ""
    if arch not in _BY_ARCH:
        raise ConfigError(f"--model-path: architecture {arch or raw.get('model_type')!r} is not "
                          f"supported (supported: {', '.join(_BY_ARCH)})")
    # transformers builds model_type's class (AutoModelForCausalLM), whatever architectures names.
    built = _ARCH_OF_TYPE.get(raw.get("model_type", ""), arch)
    if built != arch:
        raise ConfigError(f"--model-path: {source} model_type {raw['model_type']!r} (which "
                          f"transformers builds as {built}) disagrees with architectures {archs!r}")
    family = _BY_ARCH[arch]
    fields = family.read_config(Fields({**family.hf_defaults.get(arch, {}), **raw}, source), arch)
    cfg = ModelConfig(architecture=arch, family=family.name, **fields)
    check_sizes(cfg, source)
    return cfg

"""The Qwen3-Next family: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE text models (Gated DeltaNet linear
attention with gated full attention every few layers, an optional MoE with a shared expert)."""
from graphcp.models.config import ModelConfig
from graphcp.models.family import Family
from graphcp.models.qwen3_next.config import ARCHITECTURES, HF_DEFAULTS, check_flags, read_config
from graphcp.models.qwen3_next.model import Qwen3NextForCausalLM


def _mtp(cfg: ModelConfig) -> tuple[str, ...]:
    """The releases carry an ``mtp.`` module; HF skips it."""
    return ("mtp.",)


FAMILY = Family("qwen3_next", ARCHITECTURES, read_config, Qwen3NextForCausalLM, HF_DEFAULTS,
                check_flags=check_flags, unused_tensors=_mtp)

"""The DeepSeek family: multi-head latent attention (MLA) with the DeepSeek MoE: DeepSeek-V3 / R1 and
Kimi-K2 (dense MLA), DeepSeek V3.2 and GLM-5 (MLA with the DSA lightning indexer)."""
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import ARCHITECTURES, HF_DEFAULTS, check_flags, read_config
from graphcp.models.deepseek.model import MLAForCausalLM
from graphcp.models.family import Family


def _mtp_layer(cfg: ModelConfig) -> tuple[str, ...]:
    """The releases carry a multi-token-prediction layer after the last one; HF skips it."""
    return (f"model.layers.{cfg.num_hidden_layers}.",)


FAMILY = Family("deepseek", ARCHITECTURES, read_config, MLAForCausalLM, HF_DEFAULTS,
                check_flags=check_flags, unused_tensors=_mtp_layer, latent_attention=True)

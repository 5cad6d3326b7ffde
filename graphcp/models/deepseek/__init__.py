"""The DeepSeek family: multi-head latent attention (MLA) with the DeepSeek MoE: DeepSeek-V3 / R1 and
Kimi-K2 (dense MLA), DeepSeek V3.2 and GLM-5 (MLA with the DSA lightning indexer)."""
import torch

from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.attention import Indexer
from graphcp.models.deepseek.config import ARCHITECTURES, HF_DEFAULTS, MLAConfig, check_flags, read_config
from graphcp.models.deepseek.model import MLAForCausalLM
from graphcp.models.family import Family


def _unused(cfg: ModelConfig) -> tuple[str, ...]:
    """The releases carry a multi-token-prediction layer after the last one; HF skips it. A GLM-5
    checkpoint with an indexer on every layer, served with a share schedule set in config.json
    (``index_topk_freq``: vLLM's IndexCache override), carries the shared layers' indexers: named
    exactly (their FP8 scales follow the weight's name), so any other tensor is still refused."""
    d = MLAConfig.of(cfg)
    shared = [i for i, s in enumerate(d.shared_indexer) if s]
    if not shared:
        return (f"model.layers.{cfg.num_hidden_layers}.",)
    with torch.device("meta"):
        names = list(Indexer(cfg).state_dict())
    return (f"model.layers.{cfg.num_hidden_layers}.",
            *(f"model.layers.{i}.self_attn.indexer.{n}" for i in shared for n in names))


FAMILY = Family("deepseek", ARCHITECTURES, read_config, MLAForCausalLM, HF_DEFAULTS,
                check_flags=check_flags, unused_tensors=_unused, latent_attention=True)

"""Tiny DSA checkpoints (DeepSeek V3.2, GLM-5) written by transformers, and HF as their oracle (last-token
logits and per layer the MLA latent, the RoPE part and the indexer keys)."""
from __future__ import annotations

import torch

from testkit.hf_reference import CachedHF
from testkit.mla_checkpoint import widen_init

VOCAB = 211
TOPK = 8
INTERLEAVE = dict(enable_prefill_cp=True, cp_strategy="interleave")


def make_dsa_checkpoint(path: str, arch: str, seed: int, **overrides) -> str:
    import transformers
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
                  q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16,
                  index_topk=TOPK, index_head_dim=32, index_n_heads=16, max_position_embeddings=512)
    kwargs.update(overrides)
    config = getattr(transformers, f"{arch}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.float32)
    widen_init(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


class DSAOracle(CachedHF):
    """HF in fp32: last-token logits and per layer (kv_latent, k_rope, index_k or None)."""

    def layers(self, out, model) -> list:
        return [(layer.keys[0, 0], layer.values[0, 0],
                 layer.indexer_keys[0] if layer.is_indexer_initialized else None)
                for layer in out.past_key_values.layers]

"""The config.json fields of the llama family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE), read as
transformers 5 reads them."""
from __future__ import annotations

from graphcp.models.config import Fields, base_fields, expert_count, moe_fields, rope_fields

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}
# transformers' class defaults, for the fields a config.json may leave out that graphcp reads with
# another fallback (tests/test_config_fields*.py check every field against the classes).
_QWEN = dict(max_position_embeddings=32768, sliding_window=4096)
HF_DEFAULTS = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048),
    "MistralForCausalLM": dict(max_position_embeddings=131072, sliding_window=4096,
                               num_key_value_heads=8),
    "Qwen2ForCausalLM": dict(_QWEN, max_window_layers=28, num_key_value_heads=32),
    "Qwen3ForCausalLM": dict(_QWEN, max_window_layers=28, num_key_value_heads=32, head_dim=128),
    "Qwen3MoeForCausalLM": dict(_QWEN, num_key_value_heads=4, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=768),
}
_O_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def read_config(f: Fields, arch: str) -> dict:
    """As transformers builds them: Llama and Qwen3 put attention_bias on q/k/v/o, Qwen2 always
    biases q/k/v (never o), Mistral has no biases; only Llama reads mlp_bias; Qwen3 norms q and k;
    Qwen3-MoE's expert count is ``num_local_experts`` (transformers 5) over ``num_experts``."""
    if arch == "Qwen3MoeForCausalLM":
        f = Fields(expert_count(f.raw, ("num_local_experts", "num_experts"), "num_experts"), f.source)
    fields = base_fields(f)
    attention_bias = bool(f.get("attention_bias", False))
    layers = fields["num_hidden_layers"]
    fields.update(
        qkv_bias=arch == "Qwen2ForCausalLM" or (attention_bias and arch != "MistralForCausalLM"),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        o_bias=attention_bias and arch in _O_BIAS,
        mlp_bias=bool(f.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        sliding_window=sliding_window(f.raw, arch, layers),
        attention_kinds=("gqa",) * layers,
        **rope_fields(f.raw, fields["head_dim"], fields["max_position_embeddings"]))
    if arch == "Qwen3MoeForCausalLM":
        fields.update(moe_fields(f, layers))
    return fields


def sliding_window(raw: dict, arch: str, num_layers: int) -> int | None:
    """The attention window when any layer uses one, as HF transformers reads the config: ``layer_types``
    where present; else Mistral's ``sliding_window``, or Qwen2/3's ``use_sliding_window`` for the layers
    from ``max_window_layers`` on. Llama has none."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or arch == "LlamaForCausalLM":
        return None
    if raw.get("layer_types") is not None:
        return window if "sliding_attention" in raw["layer_types"] else None
    if arch == "MistralForCausalLM":
        return window
    if raw.get("use_sliding_window") and raw.get("max_window_layers", num_layers) < num_layers:
        return window
    return None

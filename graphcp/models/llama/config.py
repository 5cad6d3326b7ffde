"""The config.json fields of the llama family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE), read as
transformers 5 reads them."""
from __future__ import annotations

from graphcp.errors import ConfigError
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
    window, sliding = sliding_layers(f.raw, arch, layers)
    fields.update(
        qkv_bias=arch == "Qwen2ForCausalLM" or (attention_bias and arch != "MistralForCausalLM"),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        o_bias=attention_bias and arch in _O_BIAS,
        mlp_bias=bool(f.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        sliding_window=window, sliding_layers=sliding,
        attention_kinds=("gqa",) * layers,
        **rope_fields(f.raw, fields["head_dim"], fields["max_position_embeddings"]))
    if arch == "Qwen3MoeForCausalLM":
        fields.update(moe_fields(f, layers))
    return fields


def sliding_layers(raw: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window W, the layers attending through it) as transformers 5 reads the config: Mistral's
    ``sliding_window`` windows every layer; Qwen2/Qwen3/Qwen3-MoE only with ``use_sliding_window``,
    Qwen3-MoE on every layer, Qwen2/Qwen3 on the ``layer_types`` marked "sliding_attention" (or,
    without them, the layers from ``max_window_layers`` on); Llama never. No sliding layer: (None, ())."""
    if arch == "LlamaForCausalLM":
        return None, ()
    window = raw.get("sliding_window")
    if arch != "MistralForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"--model-path: sliding_window={window!r} must be a positive integer or null")
    if arch in ("MistralForCausalLM", "Qwen3MoeForCausalLM"):
        layers = tuple(range(num_layers)) if window else ()
    elif raw.get("layer_types") is not None:
        layers = _typed_sliding_layers(raw["layer_types"], num_layers, window)
    else:
        first = raw.get("max_window_layers", num_layers)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ConfigError(f"--model-path: max_window_layers={first!r} must be an integer")
        layers = tuple(range(first, num_layers)) if window else ()
    return (window, layers) if layers else (None, ())


def _typed_sliding_layers(types: object, num_layers: int, window: int | None) -> tuple[int, ...]:
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
        raise ConfigError(f"--model-path: layer_types must list {num_layers} entries of {kinds}, "
                          f"got {types!r}")
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if layers and window is None:
        raise ConfigError("--model-path: layer_types marks sliding_attention layers but no window "
                          "is set (use_sliding_window with a sliding_window); transformers cannot "
                          "run this config either")
    return layers

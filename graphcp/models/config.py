"""ModelConfig: the fields graphcp reads from an HF config.json, checked before any allocation."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from graphcp.errors import ConfigError
from graphcp.models.deepseek_v4_config import (V4_ARCHITECTURES, DeepseekV4Config,
                                               v4_attention_kinds, v4_fields)
from graphcp.models.dsa_config import MLA_ARCHITECTURES, DSAConfig, dsa_fields
from graphcp.models.gguf import hf_config, is_gguf
from graphcp.models.hybrid_config import (HYBRID_ARCHITECTURES, HYBRID_DEFAULTS, HYBRID_MODEL_TYPES,
                                          HybridConfig, hybrid_fields, hybrid_kinds, hybrid_rope)
from graphcp.models.rope import DEFAULT_THETA, read_rope, rope_positions

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    **MLA_ARCHITECTURES,
    **V4_ARCHITECTURES,
    **HYBRID_ARCHITECTURES,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
                "glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                "deepseek_v4": "DeepseekV4ForCausalLM", **HYBRID_MODEL_TYPES}
# transformers' class defaults, for the fields a config.json may leave out that graphcp reads with
# another fallback (tests/test_config_fields*.py check every field against the classes).
_QWEN = dict(max_position_embeddings=32768, sliding_window=4096)
_HF_DEFAULTS = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048),
    "MistralForCausalLM": dict(max_position_embeddings=131072, sliding_window=4096,
                               num_key_value_heads=8),
    "Qwen2ForCausalLM": dict(_QWEN, max_window_layers=28, num_key_value_heads=32),
    "Qwen3ForCausalLM": dict(_QWEN, max_window_layers=28, num_key_value_heads=32, head_dim=128),
    "Qwen3MoeForCausalLM": dict(_QWEN, num_key_value_heads=4, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=768),
    "DeepseekV32ForCausalLM": dict(max_position_embeddings=163840, routed_scaling_factor=2.5,
                                   n_shared_experts=1, n_group=8, topk_group=4),
    "DeepseekV3ForCausalLM": dict(max_position_embeddings=4096, routed_scaling_factor=2.5,
                                  n_shared_experts=1, n_group=8, topk_group=4, q_lora_rank=1536),
    "GlmMoeDsaForCausalLM": dict(max_position_embeddings=202752, rms_norm_eps=1e-5,
                                 routed_scaling_factor=2.5, n_shared_experts=1, n_group=1,
                                 topk_group=1),
    "DeepseekV4ForCausalLM": {},          # its own defaults (models/deepseek_v4_config.py)
    **HYBRID_DEFAULTS,
}
# Bounds that stop a hostile config from allocating absurd memory before weights are read.
LIMITS = {"vocab_size": 1 << 20, "hidden_size": 65536, "num_hidden_layers": 512, "intermediate_size": 1 << 19,
          "num_attention_heads": 1024, "num_experts": 4096,
          "moe_intermediate_size": 1 << 19, "head_dim": 1024, "max_position_embeddings": 1 << 22}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str                  # the model class (models/families.py): llama, qwen3, hybrid, ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None    # standardized rope parameters (models/rope.py); None: default RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False         # o_proj bias (Llama and Qwen3 with attention_bias)
    mlp_bias: bool = False       # gate/up/down biases (Llama's mlp_bias)
    sliding_window: int | None = None   # set when some layer attends through a window (graphcp caps the context)
    fp8_block: tuple[int, int] | None = None   # FP8 checkpoint: weight_block_size (output rows, input columns)
    fp8_skip: tuple[str, ...] = ()              # FP8 checkpoint: modules left unquantized (modules_to_not_convert)
    fp8_scale_fmt: str = "float"                # FP8 checkpoint: "ue8m0": every block scale a power of two
    num_experts: int = 0                # MoE (Qwen3-MoE): routed experts, 0 for dense models
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False        # renormalise the top-k probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()    # layers whose FFN is the MoE block (the others are dense)
    dsa: DSAConfig | None = None        # MLA models (DSA: with the lightning indexer; models/dsa_config.py)
    hybrid: HybridConfig | None = None  # Gated DeltaNet + gated attention (models/hybrid_config.py)
    v4: DeepseekV4Config | None = None  # DeepSeek V4 (models/deepseek_v4_config.py)
    attention_kinds: tuple[str, ...] = ()   # per layer: the attention kind (graphcp/attention/kinds.py)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_positions(self) -> int:
        """The longest context the RoPE tables cover (YaRN's extended one where it is longer)."""
        return rope_positions(self.rope_scaling, self.max_position_embeddings)


def read_model_config(model_path: str) -> ModelConfig:
    """From config.json, or from a GGUF file's metadata mapped to the same fields (one validation)."""
    if is_gguf(model_path):
        return _from_raw(hf_config(model_path), "GGUF metadata")
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model-path: cannot read {path}: {e}") from e
    return _from_raw(raw, "config.json")


def _from_raw(raw: dict, source: str) -> ModelConfig:
    archs = raw.get("architectures") or [_MODEL_TYPES.get(raw.get("model_type", ""), "")]
    arch = archs[0] if archs else ""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"--model-path: architecture {arch or raw.get('model_type')!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    family = ARCHITECTURES[arch]
    raw = {**_HF_DEFAULTS[arch], **_expert_count(raw, arch)}
    if arch == "Qwen3_5MoeForCausalLM":     # every layer is MoE: HF's text model never reads
        raw["intermediate_size"] = raw.get("moe_intermediate_size")     # intermediate_size
    # transformers builds model_type's class (AutoModelForCausalLM), whatever architectures names.
    built = _MODEL_TYPES.get(raw.get("model_type", ""), arch)
    if built != arch:
        raise ConfigError(f"--model-path: {source} model_type {raw['model_type']!r} (which "
                          f"transformers builds as {built}) disagrees with architectures {archs!r}")

    def need(key: str) -> int:
        if key not in raw or not isinstance(raw[key], int) or raw[key] < 1:
            raise ConfigError(f"--model-path: {source} field {key!r} must be a positive integer, got {raw.get(key)!r}")
        if key in LIMITS and raw[key] > LIMITS[key]:
            raise ConfigError(f"--model-path: {source} {key}={raw[key]} exceeds the limit {LIMITS[key]}")
        return raw[key]

    if arch in V4_ARCHITECTURES:       # its own rotaries, layer kinds and MoE fields
        fp8_block, fp8_skip, scale_fmt = _fp8_quantization(raw.get("quantization_config"))
        fields = v4_fields(raw, need)
        return ModelConfig(architecture=arch, family=family, fp8_block=fp8_block, fp8_skip=fp8_skip,
                           fp8_scale_fmt=scale_fmt,
                           attention_kinds=v4_attention_kinds(fields["v4"]), **fields)
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ConfigError(f"--model-path: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}")
    # DSA: RoPE covers the decoupled rope part only (HF overwrites head_dim with it)
    dsa = arch in MLA_ARCHITECTURES
    head_dim = raw.get("qk_rope_head_dim") if dsa else raw.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2 or head_dim > LIMITS["head_dim"]:
        name = "qk_rope_head_dim" if dsa else "head_dim"
        raise ConfigError(f"--model-path: {name}={head_dim!r} must be an even positive integer")
    fp8_block, fp8_skip, scale_fmt = _fp8_quantization(raw.get("quantization_config"))
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"--model-path: hidden_act {raw.get('hidden_act')!r} is not supported (silu)")
    # As transformers builds them: Llama and Qwen3 put attention_bias on q/k/v/o, Qwen2 always biases q/k/v
    # (never o), Mistral has no biases; only Llama reads mlp_bias.
    attention_bias = bool(raw.get("attention_bias", False))
    cfg = ModelConfig(
        architecture=arch, family=family, vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"), num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=DEFAULT_THETA, rope_scaling=None,         # read below, over the final head_dim
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or (attention_bias and arch != "MistralForCausalLM"),
        qk_norm=family == "qwen3",
        o_bias=attention_bias and (family == "hybrid" or arch in (
            "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
        mlp_bias=bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        sliding_window=_sliding_window(raw, arch, need("num_hidden_layers")),
        fp8_block=fp8_block, fp8_skip=fp8_skip, fp8_scale_fmt=scale_fmt,
    )
    if arch == "Qwen3_5MoeForCausalLM":       # its router always renormalises the top-k
        raw = {**raw, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch in ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM") or (
            arch == "Qwen3NextForCausalLM" and raw.get("num_experts")):
        cfg = replace(cfg, **_moe_fields(raw, cfg.num_hidden_layers, need))
    if arch in MLA_ARCHITECTURES:
        cfg = replace(cfg, **dsa_fields(raw, arch, cfg.num_hidden_layers, need))
    rope_raw, rope_dim = raw, cfg.head_dim
    if family == "hybrid":       # RoPE covers the first rotary_dim of each full-attention head
        cfg = replace(cfg, hybrid=hybrid_fields(raw, arch, cfg.num_hidden_layers, head_dim, need))
        rope_raw, rope_dim = hybrid_rope(raw), cfg.hybrid.rotary_dim
    theta, scaling = read_rope(rope_raw, rope_dim, cfg.max_position_embeddings)
    cfg = replace(cfg, rope_theta=theta, rope_scaling=scaling)
    if not 1 <= cfg.max_positions <= LIMITS["max_position_embeddings"]:
        raise ConfigError(f"--model-path: {source} gives {cfg.max_positions} positions "
                          "(max_position_embeddings and the rope scaling); the limit is "
                          f"{LIMITS['max_position_embeddings']}")
    mla_kind = "gqa" if cfg.dsa is None else "dsa" if cfg.dsa.index_topk else "mla"
    kinds = (hybrid_kinds(cfg.hybrid) if cfg.hybrid is not None else (mla_kind,) * cfg.num_hidden_layers)
    cfg = replace(cfg, attention_kinds=kinds)
    params = cfg.num_hidden_layers * (hidden * (cfg.q_size * 2 + cfg.kv_size * 2) + 3 * hidden * cfg.intermediate_size)
    params += len(cfg.moe_layers) * cfg.num_experts * 3 * hidden * cfg.moe_intermediate_size
    params += cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)
    if params > 2 * 10**12:
        raise ConfigError(f"--model-path: {source} describes {params / 1e9:.0f}B parameters, beyond any machine")
    return cfg


def _expert_count(raw: dict, arch: str) -> dict:
    """The expert count under the name graphcp reads, from the spellings transformers accepts:
    Qwen3-MoE's ``num_local_experts`` (transformers 5) over ``num_experts`` (released checkpoints);
    for DSA models ``num_experts`` over ``num_local_experts`` over ``n_routed_experts``."""
    if arch == "Qwen3MoeForCausalLM":
        names, key = ("num_local_experts", "num_experts"), "num_experts"
    elif arch in MLA_ARCHITECTURES:
        names, key = ("num_experts", "num_local_experts", "n_routed_experts"), "n_routed_experts"
    else:
        return raw
    given = [raw[n] for n in names if raw.get(n) is not None]
    return {**raw, key: given[0]} if given else raw


def _moe_fields(raw: dict, num_layers: int, need) -> dict:  # noqa: ANN001
    """Qwen3-MoE's expert fields, and its MoE layers as HF decides them: every ``decoder_sparse_step``-th
    layer that is not in ``mlp_only_layers``."""
    experts, top_k = need("num_experts"), need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds num_experts={experts}")
    step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"--model-path: decoder_sparse_step={step!r} must be a positive integer")
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"--model-path: mlp_only_layers={dense!r} must be a list of layer indices")
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=need("moe_intermediate_size"),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=layers)


def check_expert_parallel(cfg: ModelConfig, ep_size: int) -> None:
    """Experts are split evenly over the EP ranks (SGLang's rule)."""
    if cfg.moe_layers and cfg.num_experts % ep_size:
        raise ConfigError(f"--ep {ep_size} must divide the model's num_experts={cfg.num_experts}")


def _sliding_window(raw: dict, arch: str, num_layers: int) -> int | None:
    """The attention window when any layer uses one, as HF transformers reads the config: ``layer_types``
    where present; else Mistral's ``sliding_window``, or Qwen2/3's ``use_sliding_window`` for the layers
    from ``max_window_layers`` on. Llama and the hybrid models have none."""
    window = raw.get("sliding_window")
    if (not isinstance(window, int) or window <= 0 or arch == "LlamaForCausalLM"
            or arch in HYBRID_ARCHITECTURES):
        return None
    if raw.get("layer_types") is not None:
        return window if "sliding_attention" in raw["layer_types"] else None
    if arch == "MistralForCausalLM":
        return window
    if raw.get("use_sliding_window") and raw.get("max_window_layers", num_layers) < num_layers:
        return window
    return None


def _fp8_quantization(quant: object) -> tuple[tuple[int, int] | None, tuple[str, ...], str]:
    """(weight_block_size, modules left unquantized, scale_fmt) of a DeepSeek/Qwen-style FP8
    checkpoint, or (None, (), "float") without quantization. Every other method is refused: graphcp
    has no kernels for it."""
    if not quant:
        return None, (), "float"
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
    if method != "fp8" or not isinstance(quant, dict):
        raise ConfigError(f"--model-path: quantized checkpoints other than fp8 are not supported "
                          f"(quantization_config quant_method {method!r}); use the unquantized bf16/fp16 "
                          "checkpoint or its block-quantized fp8 version")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"--model-path: fp8 activation_scheme {scheme!r} is not supported (dynamic: "
                          "activations are quantized per token group at run time)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"--model-path: fp8 fmt {quant.get('fmt')!r} is not supported (e4m3)")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and 1 <= b <= 4096 for b in block)):
        raise ConfigError(f"--model-path: fp8 weight_block_size {block!r} must be two block sizes "
                          "(e.g. [128, 128]); per-tensor fp8 scales are not supported")
    skip = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"--model-path: fp8 modules_to_not_convert {skip!r} must be a list of module names")
    # ue8m0 (DeepSeek V3.1 on): scales are powers of two, stored as float32 in the released files;
    # transformers holds them as float8_e8m0fnu, exact for those values (the loader checks them).
    scale_fmt = quant.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"--model-path: fp8 scale_fmt {scale_fmt!r} is not supported (float, ue8m0)")
    return (block[0], block[1]), tuple(skip), scale_fmt

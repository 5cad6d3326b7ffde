"""ModelConfig: the fields graphcp reads from an HF config.json, checked before any allocation, and
the field readers every family shares. A family reads its own fields (``Family.read_config``);
``models/registry.py`` picks the family and runs the checks every family gets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphcp.errors import ConfigError
from graphcp.models.common.rope import read_rope, rope_positions
from graphcp.models.compressed_tensors import FORMAT as COMPRESSED_TENSORS
from graphcp.models.compressed_tensors import compressed_tensors_fields

# Bounds that stop a hostile config from allocating absurd memory before weights are read.
LIMITS = {"vocab_size": 1 << 20, "hidden_size": 65536, "num_hidden_layers": 512,
          "intermediate_size": 1 << 19, "num_attention_heads": 1024, "num_experts": 4096,
          "moe_intermediate_size": 1 << 19, "head_dim": 1024, "max_position_embeddings": 1 << 22}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str                  # the family that serves it (models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None    # standardized rope parameters (models/common/rope.py); None: default
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    o_bias: bool = False         # o_proj bias (Llama and Qwen3 with attention_bias)
    mlp_bias: bool = False       # gate/up/down biases (Llama's mlp_bias)
    sliding_window: int | None = None   # W: a sliding layer's query at p sees keys p-W < j <= p
    sliding_layers: tuple[int, ...] = ()  # the layers that attend through the window (others fully)
    fp8_block: tuple[int, int] | None = None   # FP8 checkpoint: weight_block_size (output rows, input columns)
    fp8_skip: tuple[str, ...] = ()              # FP8 checkpoint: modules left unquantized (modules_to_not_convert)
    fp8_scale_fmt: str = "float"                # FP8 checkpoint: "ue8m0": every block scale a power of two
    fp8_format: str = "fp8"     # FP8 checkpoint: "fp8" (scales ``*_scale_inv``) or "compressed-tensors"
    num_experts: int = 0                # MoE: routed experts, 0 for dense models
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False        # renormalise the top-k probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()    # layers whose FFN is the MoE block (the others are dense)
    attention_kinds: tuple[str, ...] = ()   # per layer: the attention kind (graphcp/attention/kinds.py)
    family_config: Any = None           # the family's own fields (its config.py's dataclass)

    def window(self, layer: int) -> int:
        """Layer ``layer``'s attention window W, 0 where it attends to every earlier key."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_heads_per_rank(self, attn_tp: int) -> int:
        """KV heads each attention-TP rank holds: its share, or one replicated head where attention
        TP exceeds the KV heads (each head then on attn_tp / num_key_value_heads ranks, as SGLang)."""
        return max(1, self.num_key_value_heads // attn_tp)

    def kv_replicas(self, attn_tp: int) -> int:
        """Attention-TP ranks holding each KV head (1: no replication)."""
        return max(1, attn_tp // self.num_key_value_heads)

    @property
    def max_positions(self) -> int:
        """The longest context the RoPE tables cover (YaRN's extended one where it is longer)."""
        return rope_positions(self.rope_scaling, self.max_position_embeddings)


class Fields:
    """A config.json (transformers' defaults for its architecture filled in) as a family reads it:
    ``need`` a positive integer within the limits, else a ConfigError naming the field."""

    def __init__(self, raw: dict, source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, key: str, default: object = None) -> Any:
        return self.raw.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def need(self, key: str) -> int:
        value = self.raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"--model-path: {self.source} field {key!r} must be a positive "
                              f"integer, got {value!r}")
        if key in LIMITS and value > LIMITS[key]:
            raise ConfigError(f"--model-path: {self.source} {key}={value} exceeds the limit "
                              f"{LIMITS[key]}")
        return value


def base_fields(f: Fields, head_dim_key: str = "head_dim", head_dim_fallback: bool = True) -> dict:
    """The decoder's common fields: sizes, heads (num_key_value_heads dividing the query heads), the
    head dim (``head_dim_key``, or hidden / heads where the family falls back to it), norms,
    positions, the tied embedding, and the FP8 quantization config; RoPE is read by ``rope_fields``
    over the head part that rotates."""
    hidden, heads = f.need("hidden_size"), f.need("num_attention_heads")
    kv_heads = f.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ConfigError(f"--model-path: num_key_value_heads={kv_heads!r} must divide "
                          f"num_attention_heads={heads}")
    head_dim = f.get(head_dim_key) or (hidden // heads if head_dim_fallback else None)
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2 or head_dim > LIMITS["head_dim"]:
        raise ConfigError(f"--model-path: {head_dim_key}={head_dim!r} must be an even positive integer")
    if f.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"--model-path: hidden_act {f.get('hidden_act')!r} is not supported (silu)")
    return dict(vocab_size=f.need("vocab_size"), hidden_size=hidden,
                intermediate_size=f.need("intermediate_size"),
                num_hidden_layers=f.need("num_hidden_layers"), num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim,
                rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(f.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
                **quantization_fields(f.get("quantization_config")))


def rope_fields(raw: dict, rope_dim: int, max_position_embeddings: int) -> dict:
    theta, scaling = read_rope(raw, rope_dim, max_position_embeddings)
    return dict(rope_theta=theta, rope_scaling=scaling)


def expert_count(raw: dict, names: tuple[str, ...], key: str) -> dict:
    """The expert count under ``key``, from the first of the spellings ``names`` transformers
    accepts that the config gives."""
    given = [raw[n] for n in names if raw.get(n) is not None]
    return {**raw, key: given[0]} if given else raw


def moe_fields(f: Fields, num_layers: int) -> dict:
    """Qwen-style MoE fields, and its MoE layers as HF decides them: every ``decoder_sparse_step``-th
    layer that is not in ``mlp_only_layers``."""
    experts, top_k = f.need("num_experts"), f.need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"--model-path: num_experts_per_tok={top_k} exceeds num_experts={experts}")
    step, dense = f.get("decoder_sparse_step", 1), f.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"--model-path: decoder_sparse_step={step!r} must be a positive integer")
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"--model-path: mlp_only_layers={dense!r} must be a list of layer indices")
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=f.need("moe_intermediate_size"),
                norm_topk_prob=bool(f.get("norm_topk_prob", False)), moe_layers=layers)


def check_expert_parallel(cfg: ModelConfig, ep_size: int) -> None:
    """Experts are split evenly over the EP ranks (SGLang's rule)."""
    if cfg.moe_layers and cfg.num_experts % ep_size:
        raise ConfigError(f"--ep {ep_size} must divide the model's num_experts={cfg.num_experts}")


def check_sizes(cfg: ModelConfig, source: str) -> None:
    """What every family's config must respect: positions within the limit, a plausible size."""
    if not 1 <= cfg.max_positions <= LIMITS["max_position_embeddings"]:
        raise ConfigError(f"--model-path: {source} gives {cfg.max_positions} positions "
                          "(max_position_embeddings and the rope scaling); the limit is "
                          f"{LIMITS['max_position_embeddings']}")
    hidden = cfg.hidden_size
    params = cfg.num_hidden_layers * (hidden * (cfg.q_size * 2 + cfg.kv_size * 2)
                                      + 3 * hidden * cfg.intermediate_size)
    params += len(cfg.moe_layers) * cfg.num_experts * 3 * hidden * cfg.moe_intermediate_size
    params += cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)
    if params > 2 * 10**12:
        raise ConfigError(f"--model-path: {source} describes {params / 1e9:.0f}B parameters, beyond "
                          "any machine")


def quantization_fields(quant: object) -> dict:
    """ModelConfig's FP8 fields of a ``quantization_config``: the DeepSeek/Qwen block format or a
    compressed-tensors one (``models/compressed_tensors.py``)."""
    if isinstance(quant, dict) and quant.get("quant_method") == COMPRESSED_TENSORS:
        return compressed_tensors_fields(quant)
    block, skip, scale_fmt = fp8_quantization(quant)
    return dict(fp8_block=block, fp8_skip=skip, fp8_scale_fmt=scale_fmt)


def fp8_quantization(quant: object) -> tuple[tuple[int, int] | None, tuple[str, ...], str]:
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

"""A compressed-tensors ``quantization_config`` (llm-compressor's format: GLM-4.5/4.6-FP8 and the
like) as ModelConfig's FP8 fields, where it describes weights graphcp holds in FP8: float8_e4m3fn
``Linear`` weights, symmetric, with one scale per output row (strategy ``channel``, scales [N, 1])
or per block (strategy ``block``), activations unquantized or quantized dynamically (per token or
per token group: graphcp's FP8 GEMM does that itself). A weight's scale is ``<weight>_scale`` and
multiplies it, as DeepSeek's ``_scale_inv`` does (``checkpoint/compressed_tensors.py`` reads the
names). Everything else is refused, naming the field.
"""
from __future__ import annotations

from graphcp.errors import ConfigError
from graphcp.kernels.fp8_types import WHOLE_ROW

FORMAT = "compressed-tensors"
_FIELD = "--model-path: quantization_config (compressed-tensors)"
_KNOWN = {"quant_method", "config_groups", "format", "ignore", "kv_cache_scheme",
          "quantization_status", "global_compression_ratio", "sparsity_config", "transform_config",
          "version"}
# How the scales were found (calibration), not how they are read.
_ARG_INERT = {"observer", "observer_kwargs", "actorder", "scale_dtype", "zp_dtype"}


def compressed_tensors_fields(quant: dict) -> dict:
    """ModelConfig's FP8 fields of a compressed-tensors config (ConfigError naming the field)."""
    unknown = sorted(set(quant) - _KNOWN)
    if unknown:
        raise ConfigError(f"{_FIELD} field {unknown[0]!r} is not supported")
    _expect(quant, "format", "float-quantized", "FP8 weights stored as float8_e4m3fn")
    _expect(quant, "quantization_status", "compressed", "weights stored quantized")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(key):
            raise ConfigError(f"{_FIELD} {key} {quant[key]!r} is not supported (graphcp keeps the "
                              "KV cache in the model dtype and reads dense, untransformed weights)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ConfigError(f"{_FIELD} config_groups must hold one group (graphcp reads one scheme "
                          f"for every Linear), got {groups!r}")
    (name, group), = groups.items()
    where = f"config_groups.{name}"
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise ConfigError(f"{_FIELD} {where}.targets must be ['Linear'], got "
                          f"{group.get('targets') if isinstance(group, dict) else group!r}")
    if group.get("output_activations") is not None:
        raise ConfigError(f"{_FIELD} {where}.output_activations is not supported")
    block = _weights(group.get("weights"), f"{where}.weights")
    _activations(group.get("input_activations"), f"{where}.input_activations", block)
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise ConfigError(f"{_FIELD} ignore {ignore!r} must be a list of module names or 're:' "
                          "patterns")
    return dict(fp8_block=block, fp8_skip=tuple(ignore), fp8_scale_fmt="float", fp8_format=FORMAT)


def _expect(quant: dict, key: str, value: str, why: str) -> None:
    if quant.get(key, value) != value:
        raise ConfigError(f"{_FIELD} {key} {quant[key]!r} is not supported ({value!r}: {why})")


def _float8(args: object, where: str) -> dict:
    if not isinstance(args, dict):
        raise ConfigError(f"{_FIELD} {where} must describe the FP8 scheme, got {args!r}")
    known = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure",
             "dynamic"} | _ARG_INERT
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"{_FIELD} {where}.{unknown[0]} is not supported")
    if args.get("num_bits") != 8 or args.get("type") != "float" or args.get("symmetric") is False:
        raise ConfigError(f"{_FIELD} {where} must be symmetric 8-bit float (float8_e4m3fn), got "
                          f"num_bits={args.get('num_bits')!r} type={args.get('type')!r} "
                          f"symmetric={args.get('symmetric')!r}")
    return args


def _weights(args: object, where: str) -> tuple[int, int]:
    """The scale block of the weights: (1, WHOLE_ROW) per channel, the block structure per block."""
    args = _float8(args, where)
    if args.get("dynamic", False) is not False:
        raise ConfigError(f"{_FIELD} {where}.dynamic must be false (weights carry their scales)")
    strategy = args.get("strategy")
    if strategy == "channel" and args.get("group_size") is None:
        return 1, WHOLE_ROW
    block = args.get("block_structure")
    if strategy == "block" and isinstance(block, list) and len(block) == 2 \
            and all(isinstance(b, int) and 1 <= b <= 4096 for b in block):
        return block[0], block[1]
    raise ConfigError(f"{_FIELD} {where}.strategy {strategy!r} is not supported (channel, or "
                      f"block with a block_structure of two sizes; got block_structure {block!r}, "
                      f"group_size {args.get('group_size')!r})")


def _activations(args: object, where: str, block: tuple[int, int]) -> None:
    """Unquantized, or quantized dynamically per token (per-channel weights) or per group of the
    weight's K block (block weights), as graphcp's FP8 GEMM quantizes them."""
    if args is None:
        return
    args = _float8(args, where)
    if args.get("dynamic") is not True:
        raise ConfigError(f"{_FIELD} {where}.dynamic {args.get('dynamic')!r} is not supported "
                          "(static activation scales; graphcp quantizes activations at run time)")
    strategy, group = args.get("strategy"), args.get("group_size")
    if block[1] == WHOLE_ROW and strategy == "token":
        return
    if block[1] != WHOLE_ROW and strategy == "group" and group == block[1]:
        return
    raise ConfigError(f"{_FIELD} {where}.strategy {strategy!r} (group_size {group!r}) is not "
                      "supported: per token for per-channel weights, per group of the weight "
                      "block's columns for block weights")

"""Load an HF checkpoint (config.json + safetensors, sharded or not) or a GGUF file into its family's
model. Never unpickles.

The whole checkpoint is validated (names, shapes) against the full model first; then each rank reads only
the tensors of its pipeline stage and only its tensor-parallel slice of each.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from graphcp.checkpoint import fp8, mxfp4
from graphcp.checkpoint.compressed_tensors import ScaleNamesReader
from graphcp.checkpoint.config import read_model_config
from graphcp.checkpoint.files import SafetensorsReader, weight_files
from graphcp.checkpoint.gguf import GGUFReader
from graphcp.checkpoint.meta import checkpoint_tensors, experts_modules, rank_model
from graphcp.config import is_gguf
from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.errors import ConfigError
from graphcp.kernels.fp8_types import FP8
from graphcp.models.common.decoder import DecoderLM
from graphcp.models.common.quantized import attach
from graphcp.models.compressed_tensors import FORMAT as COMPRESSED_TENSORS
from graphcp.models.config import ModelConfig
from graphcp.models.registry import family_of

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
log = logging.getLogger("graphcp")


def load_model(model_path: str, dtype: torch.dtype, device: torch.device, tp: TPInfo | None = None,
               layers: range | None = None, ffn_tp: TPInfo | None = None,
               ep: EPInfo | None = None) -> DecoderLM:
    """This rank's slice of the checkpoint, every tensor allocated once in its final dtype (FP8
    weights stay FP8 on every device) and filled one checkpoint tensor at a time: the peak is the
    resident weights plus the tensor being read. ``ep``: this rank's experts (MoE)."""
    cfg = read_model_config(model_path)
    family = family_of(cfg)
    reader = GGUFReader(model_path, cfg) if is_gguf(model_path) else SafetensorsReader(
        weight_files(model_path))
    if family.rename_tensors is not None:      # a release's own names, seen as the model's
        reader = family.rename_tensors(reader)
    if cfg.fp8_format == COMPRESSED_TENSORS:    # its scales under the block format's names
        reader = ScaleNamesReader(reader)
    names = set(reader.shapes)
    expected, quantized = checkpoint_tensors(cfg, names)
    _check_names_and_shapes(cfg, expected, reader, quantized, family.unused_tensors(cfg))
    model, shards = rank_model(cfg, dtype, quantized, tp, layers, ffn_tp, ep)
    model = _materialize(model, device)
    read = _power_of_two_scales(reader.read) if cfg.fp8_scale_fmt == "ue8m0" else reader.read
    experts = experts_modules(model)
    expert_tensors = {f"{prefix}.{n}" for prefix, m in experts for n in m.state_dict()}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in expert_tensors:
                continue
            source = model.source_name(name)
            if source in quantized and param.dtype != FP8:     # a form that needs it dequantized
                tensor = fp8.read_dequantized(read, source, shards.get(name), cfg.fp8_block)
            else:
                tensor = read(source, shards.get(name))
            param.copy_(_finite(source, tensor))
            del tensor
        for prefix, module in experts:      # each rank reads only its experts and its expert-TP slice
            module.load(prefix, names, lambda source, shard: _finite(source, read(source, shard)),
                        lambda source, index: _finite(source, reader.take(source, index)))
    if quantized:
        attach(model, cfg.fp8_block)
    model.fuse_projections()
    model.rotary.build(device)
    model.requires_grad_(False)
    model.eval()
    return model


def _materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Real tensors for the meta model's, with its layout: tensors that share a meta storage (a
    fusion group laid out back to back) share one allocation, at the same offsets; shared tensors
    stay shared. No ``to_empty``: ``empty_like`` of a meta tensor imports sympy through torch's
    reference ops, most of a second of every rank's start."""
    storages: dict[int, tuple] = {}
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def replace(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            storage = t.untyped_storage()
            if storage._cdata not in storages:       # keep the meta storage alive: ids stay unique
                flat = torch.empty(storage.nbytes() // t.element_size(), dtype=t.dtype, device=device)
                storages[storage._cdata] = (storage, flat)
            new = storages[storage._cdata][1].as_strided(t.shape, t.stride(), t.storage_offset())
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = (t, new)
        return made[id(t)][1]

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, replace(p))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, replace(b))
    return model


def _power_of_two_scales(read):
    """``read`` checking that every FP8 block scale it returns is a power of two (scale_fmt ue8m0:
    transformers stores them as float8_e8m0fnu, which holds nothing else)."""
    def checked(source: str, shard):
        tensor = read(source, shard)
        if source.endswith("_scale_inv"):
            mantissa, _ = torch.frexp(tensor.float())
            if not bool((mantissa == 0.5).all()):
                raise ConfigError(f"--model-path: tensor {source} holds a scale that is not a power of "
                                  "two, but quantization_config scale_fmt is 'ue8m0'")
        return tensor
    return checked


def _finite(source: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or a ConfigError naming it if it holds NaN or Inf (float8_e4m3fn has no Inf; its
    NaN is every exponent and mantissa bit set, checked on the bytes: no fp32 copy; an MXFP4
    scale's NaN is the byte 0xFF)."""
    if tensor.dtype == torch.uint8:
        bad = mxfp4.has_nan(source, tensor)
    elif tensor.dtype == FP8:
        bad = bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any())
    else:
        bad = tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    if bad:
        raise ConfigError(f"--model-path: tensor {source} holds NaN or Inf values")
    return tensor


def _log_skipped(names: list[str], unused: tuple[str, ...]) -> None:
    """Name what is read past, a line per skipped module, so an override that drops modules shows."""
    groups: dict[str, int] = {}
    for name in names:
        entry = next(u for u in unused if name.startswith(u))
        module = entry.rstrip(".") if entry.endswith(".") else entry.rsplit(".", 2)[0]
        groups[module] = groups.get(module, 0) + 1
    for module, count in groups.items():
        log.info("checkpoint tensors not loaded (the model does not use them): %s.* (%d)",
                 module, count)


def _check_names_and_shapes(cfg: ModelConfig, expected: dict[str, tuple],
                            reader: SafetensorsReader | GGUFReader, quantized: set[str],
                            unused: tuple[str, ...]) -> None:
    """Every tensor the model needs, none it does not, each of the right shape and dtype: before any
    allocation. Errors name the tensor as the checkpoint does (GGUF names next to HF names)."""
    label, shapes = reader.label, reader.shapes
    scales = {fp8.scale_name(n): fp8.scale_grid(expected[n], cfg.fp8_block) for n in quantized}
    expected = {**expected, **scales}
    missing = [n for n in expected if n not in shapes]
    if missing:
        hint = " (quantization_config fp8 needs one per projection weight)" if missing[0] in scales else ""
        raise ConfigError(f"--model-path: checkpoint lacks {len(missing)} tensors, e.g. "
                          f"{label(missing[0])!r}{hint}")
    # ``unused``: what the family's releases carry that HF skips too (MTP layers)
    unexpected = [n for n in shapes if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    skipped = [n for n in unexpected if n.startswith(unused or ("\0",))]
    _log_skipped(skipped, unused)
    unexpected = [n for n in unexpected if not n.startswith(unused or ("\0",))]
    if unexpected:
        raise ConfigError(f"--model-path: checkpoint has tensors this {cfg.architecture} does not use, "
                          f"e.g. {label(unexpected[0])!r}")
    scale_names = set(scales)
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ConfigError(f"--model-path: tensor {label(name)} has shape {list(shapes[name])}, "
                              f"the model config implies {list(shape)}")
        fp8.check_dtype(name, reader.dtypes[name], quantized, scale_names)
        mxfp4.check_dtype(name, reader.dtypes[name])

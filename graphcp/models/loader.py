"""Load an HF checkpoint (config.json + safetensors, sharded or not) or a GGUF file into its family's model.
Never unpickles.

The whole checkpoint is validated (names, shapes) against the full model first; then each rank reads only
the tensors of its pipeline stage and only its tensor-parallel slice of each.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn
from safetensors import safe_open

from graphcp.errors import ConfigError
from graphcp.models import fp8
from graphcp.models.config import ModelConfig, read_model_config
from graphcp.models.decoder import DecoderLM
from graphcp.models.deepseek_v4_names import RenamedReader
from graphcp.models.gguf import GGUFTensors, is_gguf
from graphcp.models.meta import checkpoint_tensors, experts_modules, rank_model
from graphcp.models.moe import EPInfo
from graphcp.models.parallel import TPInfo

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _weight_files(model_path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index when present."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = {name: os.path.join(model_path, fn) for name, fn in weight_map.items()}
        missing = sorted({p for p in files.values() if not os.path.isfile(p)})
        if missing:
            raise ConfigError(f"--model-path: shard {os.path.basename(missing[0])} named in the index is missing")
        return files
    files = {}
    for fn in sorted(os.listdir(model_path)):
        if fn.endswith(".safetensors"):
            path = os.path.join(model_path, fn)
            with safe_open(path, framework="pt") as f:
                files.update({name: path for name in f.keys()})
    return files


def load_model(model_path: str, dtype: torch.dtype, device: torch.device, tp: TPInfo | None = None,
               layers: range | None = None, ffn_tp: TPInfo | None = None,
               ep: EPInfo | None = None) -> DecoderLM:
    """This rank's slice of the checkpoint, every tensor allocated once in its final dtype (FP8
    weights stay FP8 on every device) and filled one checkpoint tensor at a time: the peak is the
    resident weights plus the tensor being read. ``ep``: this rank's experts (MoE)."""
    cfg = read_model_config(model_path)
    reader = _GGUFReader(model_path, cfg) if is_gguf(model_path) else _Reader(_weight_files(model_path))
    if cfg.v4 is not None:               # DeepSeek's tensor names, seen as transformers names
        reader = RenamedReader(reader)
    names = set(reader.shapes)
    expected, quantized = checkpoint_tensors(cfg, names)
    _check_names_and_shapes(cfg, expected, reader, quantized)
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
            if source in quantized and param.dtype != fp8.FP8:     # a form that needs it dequantized
                tensor = fp8.read_dequantized(read, source, shards.get(name), cfg.fp8_block)
            else:
                tensor = read(source, shards.get(name))
            param.copy_(_finite(source, tensor))
            del tensor
        for prefix, module in experts:      # each rank reads only its experts and its expert-TP slice
            module.load(prefix, names, lambda source, shard: _finite(source, read(source, shard)),
                        lambda source, index: _finite(source, reader.take(source, index)))
    if quantized:
        fp8.attach(model, cfg.fp8_block)
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


def _power_of_two_scales(read):  # noqa: ANN001, ANN202 - the reader's read(name, shard)
    """``read`` checking that every FP8 block scale it returns is a power of two (scale_fmt ue8m0:
    transformers stores them as float8_e8m0fnu, which holds nothing else)."""
    def checked(source: str, shard):  # noqa: ANN001, ANN202
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
    NaN is every exponent and mantissa bit set, checked on the bytes: no fp32 copy)."""
    if tensor.dtype == fp8.FP8:
        bad = bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any())
    else:
        bad = tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    if bad:
        raise ConfigError(f"--model-path: tensor {source} holds NaN or Inf values")
    return tensor


class _Reader:
    """Slices of safetensors checkpoint tensors by name (``fp8.read_dequantized`` reads a weight and its
    scales here); ``shapes`` and ``dtype`` describe the file without reading data."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.shapes, self.dtypes = {}, {}
        for path in sorted(set(files.values())):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if files.get(name) == path:
                        s = f.get_slice(name)
                        self.shapes[name], self.dtypes[name] = tuple(s.get_shape()), s.get_dtype()

    @staticmethod
    def label(name: str) -> str:
        return name

    def read(self, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
        return self.take(name, lambda s: _read(s, shard))

    def take(self, name: str, index) -> torch.Tensor:  # noqa: ANN001 - a slice index or a function of the slice
        with safe_open(self.files[name], framework="pt") as f:
            s = f.get_slice(name)
            return index(s) if callable(index) else s[index]


class _GGUFReader:
    """The same interface over a GGUF file: tensors dequantized by the gguf package, per rank slice."""

    def __init__(self, model_path: str, cfg: ModelConfig) -> None:
        self.gguf, self.head_dim = GGUFTensors(model_path, cfg.architecture), cfg.head_dim
        self.shapes = self.gguf.shapes()
        self.dtypes = dict.fromkeys(self.shapes, "F32")      # dequantized to float32
        self.label = self.gguf.label

    def read(self, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
        return self.gguf.read(name, shard, self.head_dim)

    def take(self, name: str, index) -> torch.Tensor:  # noqa: ANN001
        raise ConfigError(f"--model-path: GGUF tensor {self.label(name)} cannot be read by index")


def _read(tensor_slice, shard: tuple[int, int, int] | None) -> torch.Tensor:  # noqa: ANN001
    if shard is None:
        return tensor_slice[:]
    dim, start, end = shard
    return tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]


def _check_names_and_shapes(cfg: ModelConfig, expected: dict[str, tuple], reader: _Reader | _GGUFReader,
                            quantized: set[str]) -> None:
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
    # DSA checkpoints carry a multi-token-prediction layer after the last one, Qwen3-Next and Qwen3.5
    # an ``mtp.`` module; HF skips both.
    mtp = (f"model.layers.{cfg.num_hidden_layers}." if cfg.dsa is not None
           else "mtp." if cfg.hybrid is not None else None)
    unexpected = [n for n in shapes if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (cfg.tie_word_embeddings and n == "lm_head.weight")
                  and not (mtp and n.startswith(mtp))]
    if unexpected:
        raise ConfigError(f"--model-path: checkpoint has tensors this {cfg.architecture} does not use, "
                          f"e.g. {label(unexpected[0])!r}")
    scale_names = set(scales)
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ConfigError(f"--model-path: tensor {label(name)} has shape {list(shapes[name])}, "
                              f"the model config implies {list(shape)}")
        fp8.check_dtype(name, reader.dtypes[name], quantized, scale_names)

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
from graphcp.models.families import model_class
from graphcp.models.gguf import GGUFTensors, is_gguf
from graphcp.models.moe import EPInfo, Experts
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
               layers: range | None = None, ffn_tp: TPInfo | None = None, ep: EPInfo | None = None,
               keep_fp8: bool | None = None) -> DecoderLM:
    """``ep``: this rank's experts (MoE). ``keep_fp8`` (FP8 checkpoints): hold FP8 weights for the
    block-scaled GEMM instead of dequantizing them at load; None = where that GEMM runs."""
    cfg = read_model_config(model_path)
    reader = _GGUFReader(model_path, cfg) if is_gguf(model_path) else _Reader(_weight_files(model_path))
    if cfg.v4 is not None:               # DeepSeek's tensor names, seen as transformers names
        reader = RenamedReader(reader)
    names = set(reader.shapes)
    family = model_class(cfg)
    with torch.device("meta"):
        full = family(cfg)
        model = family(cfg, tp, layers, ffn_tp, ep)
    quantized = set(fp8.quantized_names(full, cfg))
    expected = {n: tuple(p.shape) for n, p in full.state_dict().items()}
    for prefix, experts in _experts(full):      # fused expert parameters load from per-expert or fused tensors
        del expected[f"{prefix}.gate_up_proj"], expected[f"{prefix}.down_proj"]
        tensors = experts.checkpoint_tensors(prefix, names, cfg.hidden_size)
        expected.update(tensors)
        quantized.update(fp8.quantized_expert_names(prefix, tensors, cfg))
    _check_names_and_shapes(cfg, expected, reader, quantized)
    model = _materialize(model, device).to(dtype)
    for module in model.modules():        # routers and the like that HF keeps in fp32
        if getattr(module, "keep_fp32", False):
            module.float()
        for name in getattr(module, "fp32_tensors", ()):     # single parameters or buffers
            getattr(module, name).data = getattr(module, name).data.float()
    # A row-split layer's bias is whole on every rank (added once after the sum); other biases split with rows.
    shards = {f"{name}.{p}": mod.shard for name, mod in model.named_modules() if hasattr(mod, "shard")
              for p in ("weight", "bias")
              if getattr(mod, p, None) is not None and not (p == "bias" and mod.shard[0] == 1)}
    if keep_fp8 is None:
        keep_fp8 = cfg.fp8_block is not None and fp8.gemm_available(device, cfg.fp8_block)
    # MLA's absorbed form needs kv_b_proj dequantized; V4's grouped o_a_proj is a batched GEMM
    keep_fp8 = keep_fp8 and cfg.dsa is None and cfg.v4 is None
    if quantized and keep_fp8:
        shards.update(fp8.hold_fp8(model, quantized, cfg.fp8_block))

    read = _power_of_two_scales(reader.read) if cfg.fp8_scale_fmt == "ue8m0" else reader.read

    def read_expert(source: str, shard: tuple[int, int, int]) -> torch.Tensor:
        """FP8 experts are dequantized at load on every device (no FP8 grouped GEMM yet)."""
        if source in quantized:
            return _finite(source, fp8.read_dequantized(read, source, shard, cfg.fp8_block))
        return _finite(source, read(source, shard))

    expert_params = {f"{prefix}.{p}" for prefix, _ in _experts(model) for p in ("gate_up_proj", "down_proj")}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in expert_params:
                continue
            source = model.source_name(name)
            if source in quantized and not keep_fp8:
                tensor = fp8.read_dequantized(read, source, shards.get(name), cfg.fp8_block)
            else:
                tensor = read(source, shards.get(name))
            param.copy_(_finite(source, tensor))

        for prefix, experts in _experts(model):   # each rank reads only its experts and its expert-TP slice
            experts.load(prefix, names, read_expert,
                         lambda source, index: _finite(source, reader.take(source, index)))
    if quantized and keep_fp8:
        fp8.attach(model, cfg.fp8_block)
    model.fuse_projections()
    model.rotary.build(device)
    model.requires_grad_(False)
    model.eval()
    return model


def _experts(model: DecoderLM) -> list[tuple[str, Experts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]


def _materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``to_empty`` without its meta-tensor path (``empty_like`` of a meta tensor imports sympy
    through torch's reference ops: most of a second of every rank's start). Shared tensors stay
    shared (keyed by the original, kept alive so its id is not reused)."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def replace(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
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
    values = tensor.float() if tensor.dtype == fp8.FP8 else tensor
    if tensor.is_floating_point() and not torch.isfinite(values).all():
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

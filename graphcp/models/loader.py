"""Load an HF checkpoint (config.json + safetensors, sharded or not) or a GGUF file into a CausalLM.
Never unpickles.

The whole checkpoint is validated (names, shapes) against the full model first; then each rank reads only
the tensors of its pipeline stage and only its tensor-parallel slice of each.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from safetensors import safe_open

from graphcp.errors import ConfigError
from graphcp.models.config import ModelConfig, read_model_config
from graphcp.models.gguf import GGUFTensors, is_gguf
from graphcp.models.llama import CausalLM
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
               layers: range | None = None, ffn_tp: TPInfo | None = None) -> CausalLM:
    cfg = read_model_config(model_path)
    if is_gguf(model_path):
        gguf = GGUFTensors(model_path, cfg.architecture)
        shapes, label = gguf.shapes(), gguf.label
    else:
        files = _weight_files(model_path)
        shapes, label = _safetensors_shapes(files), str
    with torch.device("meta"):
        full = CausalLM(cfg)
        model = CausalLM(cfg, tp, layers, ffn_tp)
    _check_names_and_shapes(cfg, {n: tuple(p.shape) for n, p in full.state_dict().items()}, shapes, label)
    model = model.to_empty(device=device).to(dtype)
    params = model.state_dict()
    # A row-split layer's bias is whole on every rank (added once after the sum); other biases split with rows.
    shards = {f"{name}.{p}": mod.shard for name, mod in model.named_modules() if hasattr(mod, "shard")
              for p in ("weight", "bias")
              if getattr(mod, p, None) is not None and not (p == "bias" and mod.shard[0] == 1)}
    with torch.no_grad():
        for name, param in params.items():
            source = model.source_name(name)
            if is_gguf(model_path):
                tensor = gguf.read(source, shards.get(name), cfg.head_dim)
            else:
                with safe_open(files[source], framework="pt") as f:
                    tensor = _read(f.get_slice(source), shards.get(name))
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ConfigError(f"--model-path: tensor {source} holds NaN or Inf values")
            param.copy_(tensor)
    model.fuse_projections()
    model.rotary.build(device)
    model.requires_grad_(False)
    model.eval()
    return model


def _read(tensor_slice, shard: tuple[int, int, int] | None) -> torch.Tensor:  # noqa: ANN001
    if shard is None:
        return tensor_slice[:]
    dim, start, end = shard
    return tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]


def _safetensors_shapes(files: dict[str, str]) -> dict[str, tuple]:
    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys() if files.get(name) == path})
    return shapes


def _check_names_and_shapes(cfg: ModelConfig, expected: dict[str, tuple], shapes: dict[str, tuple],
                            label: Callable[[str], str]) -> None:
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise ConfigError(f"--model-path: checkpoint lacks {len(missing)} tensors, e.g. {label(missing[0])!r}")
    unexpected = [n for n in shapes if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unexpected:
        raise ConfigError(f"--model-path: checkpoint has tensors this {cfg.architecture} does not use, "
                          f"e.g. {label(unexpected[0])!r}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ConfigError(f"--model-path: tensor {label(name)} has shape {list(shapes[name])}, "
                              f"the model config implies {list(shape)}")

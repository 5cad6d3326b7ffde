"""Safetensors checkpoints as a reader: tensor names to files (the index where there is one), shapes
and dtypes without reading data, and a rank's slice of a tensor read on its own. Never unpickles."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from graphcp.distributed.shards import Pieces
from graphcp.errors import ConfigError


def weight_files(model_path: str) -> dict[str, str]:
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


class SafetensorsReader:
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

    def read(self, name: str, shard: tuple[int, int, int] | Pieces | None) -> torch.Tensor:
        return self.take(name, lambda s: read_slice(s, shard))

    def take(self, name: str, index) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt") as f:
            s = f.get_slice(name)
            return index(s) if callable(index) else s[index]


def read_slice(tensor_slice, shard: tuple[int, int, int] | Pieces | None) -> torch.Tensor:
    if shard is None:
        return tensor_slice[:]
    if isinstance(shard, Pieces):       # row ranges, each read on its own
        return torch.cat([tensor_slice[start:end] for start, end in shard.ranges])
    dim, start, end = shard
    return tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]

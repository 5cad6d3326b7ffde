"""GGUF checkpoints (llama.cpp's single-file format), read with the format's own ``gguf`` package.

Metadata becomes the same HF-style config dict that config.json gives, so one validation path serves
both; tensors keep their GGUF bytes until a rank asks for its slice. Quant blocks run along a row,
so a row range is dequantized alone; a column range dequantizes whole rows first."""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

from graphcp.config import check_gguf_file
from graphcp.errors import ConfigError
from graphcp.models.config import ModelConfig

# general.architecture -> the HF class whose layers the GGUF holds.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_REQUIRED = object()


def reader(model_path: str):
    """The parsed file, once per process (parsing a tokenizer's metadata takes seconds)."""
    check_gguf_file(model_path)
    stat = os.stat(model_path)
    return _open(os.path.abspath(model_path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int):
    from gguf import GGMLQuantizationType, GGUFReader

    class _Reader(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for info in fields:  # name the tensor before gguf's bare enum error
                name, raw_type = (
                    bytes(info.parts[1]).decode("utf-8", "replace"),
                    int(info.parts[4][0]),
                )
                try:
                    GGMLQuantizationType(raw_type)
                except ValueError:
                    raise ConfigError(
                        f"--model-path {path!r}: tensor {name} has unknown GGUF tensor type "
                        f"{raw_type}"
                    ) from None
            super()._build_tensors(start_offs, fields)

    try:
        return _Reader(path)
    except ConfigError:
        raise
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as e:
        raise ConfigError(f"--model-path {path!r}: truncated or corrupt GGUF file ({e})") from e


def field(r, key: str, default: object = _REQUIRED):
    """A metadata value (scalar, string or list), or a ConfigError naming the missing key."""
    f = r.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise ConfigError(f"--model-path: GGUF metadata lacks the key {key!r}")
        return default
    return f.contents()


def hf_config(model_path: str) -> dict:
    """GGUF metadata as the config.json fields graphcp reads (as transformers maps them)."""
    r = reader(model_path)
    arch = field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"--model-path: GGUF general.architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name for t in r.tensors}
    heads = field(r, f"{arch}.attention.head_count")
    kv_heads = field(r, f"{arch}.attention.head_count_kv", default=heads)
    if isinstance(kv_heads, list) or isinstance(heads, list):
        raise ConfigError(
            f"--model-path: GGUF {arch}.attention.head_count_kv varies per layer; not supported"
        )
    hidden = field(r, f"{arch}.embedding_length")
    head_dim = field(r, f"{arch}.attention.key_length", default=0) or (
        field(r, f"{arch}.rope.dimension_count", default=0) if arch == "llama" else 0
    )
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConfigError("--model-path: GGUF file lacks the tensor 'token_embd.weight'")
    raw = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": field(r, f"{arch}.vocab_size", default=int(embd.shape[-1])),
        "hidden_size": hidden,
        "intermediate_size": field(r, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(r, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or (hidden // heads if isinstance(hidden, int) and heads else None),
        "rms_norm_eps": float(field(r, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(r, f"{arch}.rope.freq_base", default=10000.0)),
        "max_position_embeddings": field(r, f"{arch}.context_length", default=4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_gate.bias" in names,
    }
    scaling = field(r, f"{arch}.rope.scaling.type", default="none")
    if scaling == "linear":
        raw["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(field(r, f"{arch}.rope.scaling.factor")),
        }
    elif scaling != "none":
        raise ConfigError(
            f"--model-path: GGUF {arch}.rope.scaling.type {scaling!r} is not supported (linear)"
        )
    return raw


def hf_name(gguf_name: str) -> str:
    """The HF parameter a GGUF tensor holds; an unknown name is returned as is (the loader reports
    it)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def gguf_name(name: str) -> str:
    """The GGUF tensor that holds an HF parameter, for messages a GGUF user can act on."""
    top = {hf: g for g, hf in _TOP_NAMES.items()}
    if name in top:
        return top[name]
    for g, hf in _LAYER_NAMES.items():
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and ".".join(parts[3:-1]) == hf:
            return f"blk.{parts[2]}.{g}.{parts[-1]}"
    return name


class GGUFTensors:
    """HF-named view of a GGUF file's tensors: shapes, and dequantized (slices of) tensors on
    demand."""

    def __init__(self, model_path: str, architecture: str) -> None:
        from gguf import dequantize

        self.dequantize = dequantize
        self.tensors = {hf_name(t.name): t for t in reader(model_path).tensors}
        # llama.cpp interleaves the two rotary halves of each Llama q/k head; HF keeps them split.
        self.permuted = {
            n
            for n in self.tensors
            if architecture == "LlamaForCausalLM" and n.endswith(("q_proj.weight", "k_proj.weight"))
        }
        for name, t in self.tensors.items():
            self._probe(name, t)

    def _probe(self, name: str, t) -> None:
        """Dequantize one row now, so an unsupported type is refused before any allocation."""
        try:
            self.dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t.tensor_type)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise ConfigError(
                f"--model-path: GGUF tensor {name} has type {t.tensor_type.name}, which the gguf "
                f"package cannot dequantize ({e})"
            ) from e

    @staticmethod
    def label(name: str) -> str:
        return f"{gguf_name(name)} ({name})"

    def shapes(self) -> dict[str, tuple]:
        return {
            name: tuple(int(d) for d in reversed(t.shape.tolist()))
            for name, t in self.tensors.items()
        }

    def read(self, name: str, shard: tuple[int, int, int] | None, head_dim: int) -> torch.Tensor:
        t = self.tensors[name]
        rows = t.data
        if shard is not None and shard[0] == 0 and rows.ndim > 1:
            rows = rows[shard[1] : shard[2]]  # whole quant blocks: dequantize only these rows
            shard = None
        values = np.require(
            self.dequantize(rows, t.tensor_type), np.float32, "W"
        )  # F32 is a view of the file
        tensor = torch.from_numpy(
            values.reshape(len(rows), -1) if rows.ndim > 1 else values.reshape(-1)
        )
        if name in self.permuted:
            tensor = unpermute_heads(tensor, head_dim)
        if shard is not None:
            dim, start, end = shard
            tensor = tensor[start:end] if dim == 0 else tensor[:, start:end]
        return tensor.contiguous()


def unpermute_heads(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it interleaves the rotary halves (row 2i+j holds HF
    row j*head_dim/2 + i); whole heads are permuted independently, so any whole-head row range
    works."""
    heads = weight.shape[0] // head_dim
    return weight.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


class GGUFReader:
    """The same interface over a GGUF file: tensors dequantized by the gguf package, per rank slice."""

    def __init__(self, model_path: str, cfg: ModelConfig) -> None:
        self.gguf, self.head_dim = GGUFTensors(model_path, cfg.architecture), cfg.head_dim
        self.shapes = self.gguf.shapes()
        self.dtypes = dict.fromkeys(self.shapes, "F32")      # dequantized to float32
        self.label = self.gguf.label

    def read(self, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
        return self.gguf.read(name, shard, self.head_dim)

    def take(self, name: str, index) -> torch.Tensor:
        raise ConfigError(f"--model-path: GGUF tensor {self.label(name)} cannot be read by index")

"""The checkpoint's own tokenizer and chat template, built by transformers (GGUF file or HF dir)."""

from __future__ import annotations

import hashlib
import os
import tempfile

from graphcp.config import check_gguf_file, is_gguf
from graphcp.errors import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def tokenizer(model_path: str):
    """``AutoTokenizer`` for ``model_path``: a GGUF's embedded vocabulary, merges and chat template,
    or the tokenizer files of an HF checkpoint dir. transformers is imported only here (the engine
    needs ids only)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(
            "graphcp.tokenizer needs transformers: pip install 'graphcp[test]'"
        ) from e
    if is_gguf(model_path):
        return _from_gguf(AutoTokenizer, model_path)
    if not os.path.isdir(model_path):
        raise ConfigError(f"--model-path {model_path!r} is neither a .gguf file nor a directory")
    present = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, f))]
    if not present:     # transformers would build an empty tokenizer from config.json alone
        raise ConfigError(f"--model-path {model_path!r} has no tokenizer (none of "
                          f"{', '.join(_TOKENIZER_FILES)}); use a checkpoint with its tokenizer files, "
                          "or give token ids (Request.input_ids) instead of text")
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--model-path {model_path!r}: no tokenizer files transformers can read ({e})"
        ) from e


def _from_gguf(auto, model_path: str):
    """transformers rebuilds a GGUF tokenizer element by element (seconds to tens of seconds); the
    result is saved once in the graphcp cache, keyed by the file's path, size and mtime, and
    reloaded from there."""
    check_gguf_file(model_path)
    path = os.path.abspath(model_path)
    stat = os.stat(path)
    key = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = os.environ.get(
        "GRAPHCP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "graphcp")
    )
    cached = os.path.join(root, "tokenizers", key)
    if os.path.isdir(cached):
        return auto.from_pretrained(cached)
    directory, name = os.path.split(path)
    tok = auto.from_pretrained(directory, gguf_file=name)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(cached))
    tok.save_pretrained(staging)
    try:
        os.rename(staging, cached)  # atomic: a concurrent process sees all files or none
    except OSError:
        pass  # another process saved it first; ours is equivalent
    return tok

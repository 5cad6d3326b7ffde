"""DeepSeek V4 checkpoint names: DeepSeek's own (``layers.0.attn.wq_a.weight``, ``embed.weight``,
``layers.0.ffn.experts.3.w1.weight``), which transformers also writes back on ``save_pretrained``
(with or without the ``model.`` prefix), or transformers' module names; all map to the latter,
which graphcp's V4 model uses. The multi-token-prediction layers (``mtp.*``) are skipped, as
transformers skips them."""
from __future__ import annotations

import re

from graphcp.errors import ConfigError

_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER_PREFIXES = [   # first match wins; the rest of the name keeps its leaf renames
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"^attn\.attn_sink$", "self_attn.sinks"),
    (r"^attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^attn\.", "self_attn."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.", "mlp."),
]
_MODULES = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
            "wgate": "gate_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj", "norm": "kv_norm",
            "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def v4_model_name(name: str) -> str | None:
    """The transformers name of checkpoint tensor ``name``; None for tensors transformers skips."""
    bare = name.removeprefix("model.")
    if "mtp" in bare.split("."):
        return None
    if bare in _TOP:
        return _TOP[bare]
    match = _LAYER.match(bare)
    if match is None:
        return name if name.startswith(("model.", "lm_head.")) else f"model.{bare}"
    layer, rest = match.groups()
    for pattern, replacement in _LAYER_PREFIXES:
        renamed = re.sub(pattern, replacement, rest)
        if renamed != rest:
            rest = renamed
            break
    *modules, leaf = rest.split(".")
    leaf = "position_bias" if leaf == "ape" else leaf
    return ".".join(["model", "layers", layer, *(_MODULES.get(m, m) for m in modules), leaf])


class RenamedReader:
    """A checkpoint reader (``checkpoint.files.SafetensorsReader``) seen through ``v4_model_name``: shapes, dtypes and
    reads keyed by transformers names; ``label`` gives back the checkpoint's own name for errors."""

    def __init__(self, reader) -> None:
        self.reader, self.source = reader, {}
        for name in reader.shapes:
            target = v4_model_name(name)
            if target is None:
                continue
            if target in self.source:
                raise ConfigError(f"--model-path: tensors {self.source[target]!r} and {name!r} "
                                  f"both load {target!r}")
            self.source[target] = name
        self.shapes = {t: reader.shapes[s] for t, s in self.source.items()}
        self.dtypes = {t: reader.dtypes[s] for t, s in self.source.items()}

    def label(self, name: str) -> str:
        return self.source.get(name, name)

    def read(self, name: str, shard: tuple[int, int, int] | None):
        return self.reader.read(self.source[name], shard)

    def take(self, name: str, index):
        return self.reader.take(self.source[name], index)

"""The machinery of the config-field walks (tests/test_config_fields*.py): a table classifies every
``to_dict()`` field of some transformers config classes, plus the released config.json fields those
classes do not declare, and checks each against graphcp's reader. Each field is one of:
- read: ``alt`` gives another value (after a context patch); graphcp's ModelConfig changes, or the
  value is refused with a ConfigError naming the field. Dropped from config.json, the field reads
  as transformers' default for that class (or graphcp requires it, naming it).
- fixed: transformers runs one value; graphcp accepts it and refuses any other, naming the field.
- inert: cannot change prefill numerics (the reason is given); another value changes nothing.
A field transformers adds and nobody classified fails the table's ``check_classified``.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field

import pytest

from graphcp import ConfigError
from graphcp.models.registry import config_from_dict

DROP = "<drop>"            # in a context patch: leave the field out of config.json
# Inert in every family: what HF returns, training, generation and bookkeeping.
INERT = {
    "_name_or_path": "where the checkpoint was loaded from",
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "the storage dtype; the compute dtype is --dtype (weights are cast on load)",
    "dtype": "the storage dtype; the compute dtype is --dtype (weights are cast on load)",
    "attention_dropout": "dropout runs in training only",
    "initializer_range": "random initialization only",
    "bos_token_id": "tokenizer / generation", "eos_token_id": "tokenizer / generation",
    "pad_token_id": "the embedding's padding_idx only masks gradients",
    "chunk_size_feed_forward": "these models never chunk their feed-forward",
    "id2label": "classification heads", "label2id": "classification heads",
    "problem_type": "classification heads",
    "is_encoder_decoder": "generation utilities; these models are decoder-only either way",
    "output_attentions": "what HF returns", "output_hidden_states": "what HF returns",
    "return_dict": "what HF returns", "use_cache": "HF's decode cache; graphcp always caches",
    "pretraining_tp": "transformers 5 no longer reads it (Llama)",
    "output_router_logits": "the router's training loss", "router_aux_loss_coef": "training loss",
    "aux_loss_alpha": "training loss", "seq_aux": "training loss",
    "ep_size": "a deployment hint; graphcp's expert parallelism is --ep",
    "num_nextn_predict_layers": "the MTP draft layers are not part of the prefill forward; "
                                "their weights are skipped",
    "index_share_for_mtp_iteration": "the MTP layers' indexer",
    "auto_map": "remote-code class names; graphcp serves the architecture with its own model",
}


def hf_config(name: str, **kwargs):
    import transformers
    return getattr(transformers, name)(**kwargs)


def read(raw: dict):
    return config_from_dict(copy.deepcopy(raw), "config.json")


def patched(raw: dict, patch: dict) -> dict:
    out = {**raw, **copy.deepcopy(patch)}
    return {k: v for k, v in out.items() if v != DROP and (v is not None or k in raw)}


def perturbed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-changed"
    return {"changed": 1} if isinstance(value, dict) else 7



def model_type(architecture: str) -> str:
    """The model_type transformers gives the architecture's config class (the reference's, not ours)."""
    import transformers
    return getattr(transformers, architecture).config_class.model_type

@dataclass(frozen=True, eq=False)     # hashed by identity: the tiny configs are cached
class FieldTable:
    """Per field: inert (why), fixed (accepted, refused) or read ((context patch, another value)),
    globally or for some config classes (``*_for``; a class's own entry wins)."""
    classes: dict[str, str]                  # config class -> the architecture graphcp serves
    tiny: dict[str, dict]                    # config class -> kwargs of a tiny config
    extras: dict[str, list[str]]             # released config.json fields the class lacks
    other_arch: dict[str, str]               # another supported architecture, per class
    inert: dict[str, str]
    fixed: dict[str, tuple]
    alt: dict[str, tuple[dict, object]]
    inert_for: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    fixed_for: dict[str, dict[str, tuple]] = field(default_factory=dict)
    alt_for: dict[str, dict[str, tuple[dict, object]]] = field(default_factory=dict)

    @functools.cache
    def _tiny(self, name: str) -> dict:
        raw = hf_config(name, **self.tiny[name]).to_dict()
        raw["architectures"] = [self.classes[name]]
        return raw

    def base(self, name: str) -> dict:
        return copy.deepcopy(self._tiny(name))

    def kind(self, name: str, key: str) -> str:
        if key in self.inert_for and name in self.inert_for[key][0]:
            return "inert"
        if key in self.fixed_for and name in self.fixed_for[key]:
            return "fixed"
        if key in self.alt_for and name in self.alt_for[key]:
            return "read"
        if key in self.inert:
            return "inert"
        if key in self.fixed:
            return "fixed"
        return "read" if key in self.alt else "unclassified"

    def fields(self, name: str) -> list[str]:
        return sorted(set(self.base(name)) | set(self.extras[name]))

    def cases(self) -> list[tuple[str, str]]:
        return [(name, key) for name in self.classes for key in self.fields(name)]

    def counts(self, name: str) -> dict[str, int]:
        kinds = [self.kind(name, key) for key in self.fields(name)]
        return {kind: kinds.count(kind) for kind in ("read", "fixed", "inert")}

    def check_classified(self, name: str) -> None:
        unclassified = [f for f in self.fields(name) if self.kind(name, f) == "unclassified"]
        assert not unclassified, f"{name}: classify {unclassified} in its tests/test_config_fields*"

    def check_field(self, name: str, key: str) -> dict | None:
        """The field's check; returns the config.json graphcp read with another value of a field
        it reads or ignores (None when that value is refused or the field is fixed)."""
        kind, base = self.kind(name, key), self.base(name)
        if kind == "inert":
            changed = dict(base, **{key: perturbed(base.get(key))})
            why = self.inert_for[key][1] if key in self.inert_for else self.inert.get(key)
            assert read(changed) == read(base), f"{key} ({why}) changed the model"
            return changed
        if kind == "fixed":
            accepted, refused = (self.fixed_for[key][name] if key in self.fixed_for
                                 and name in self.fixed_for[key] else self.fixed[key])
            assert read(dict(base, **{key: accepted})) == read(base)
            with pytest.raises(ConfigError, match=key):
                read(dict(base, **{key: refused}))
            return None
        patch, alt = (self.alt_for[key][name] if key in self.alt_for and name in self.alt_for[key]
                      else self.alt[key])
        if key == "architectures":
            alt = [self.other_arch[name]]
        elif key == "model_type":
            alt = model_type(self.other_arch[name])
        elif alt == "flip":
            alt = not base[key]
        context = patched(base, patch)
        before = read(context)
        changed = dict(context, **{key: alt})
        try:
            after = read(changed)
        except ConfigError as e:
            assert key in str(e), f"{key}={alt!r} refused without naming it: {e}"
            return None
        assert after != before, f"{key}={alt!r} did not change what graphcp reads"
        return changed

    def check_dropped(self, name: str) -> None:
        """Absent from config.json, a field graphcp reads means what transformers' class default
        means, or graphcp requires it and says which. (A default that does not fit the tiny
        config, such as 128 experts for top-8 of 4, is skipped.)"""
        import transformers
        defaults = {f.name: f.default for f in dataclasses.fields(getattr(transformers, name))
                    if f.default is not dataclasses.MISSING}
        base = self.base(name)
        wrong = []
        for key in sorted(set(base) & set(defaults)):
            if self.kind(name, key) != "read" or key in ("architectures",):
                continue
            dropped = {k: v for k, v in base.items() if k != key}
            try:
                ours = read(dropped)
            except ConfigError as e:
                assert key in str(e), f"{key} dropped: {e}"
                continue
            try:
                theirs = read(dict(base, **{key: defaults[key]}))
            except ConfigError:
                continue
            if ours != theirs:
                wrong.append(key)
        assert not wrong, f"{name}: a dropped {wrong} does not read as transformers' default"

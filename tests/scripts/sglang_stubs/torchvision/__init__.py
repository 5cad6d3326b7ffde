"""An inert stand-in for torchvision, put on sys.path only in SGLang's processes (the decode
harness): SGLang 0.5.23's config modules import ``torchvision.transforms`` at import time, the only
torchvision wheels are built for CUDA torch, and the PD path never calls it. It has no dist-info,
so transformers still sees torchvision as absent."""

from __future__ import annotations

import sys
import types


class _Inert:
    """Any attribute, call or subscript gives another inert object."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __getattr__(self, name: str) -> "_Inert":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __call__(self, *args: object, **kwargs: object) -> "_Inert":
        return _Inert()

    def __getitem__(self, key: object) -> "_Inert":
        return _Inert()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


__version__ = "0.0.0"
for _name in (
    "transforms",
    "transforms.functional",
    "transforms.v2",
    "transforms.v2.functional",
    "io",
    "ops",
    "datasets",
    "models",
    "utils",
):
    sys.modules[f"{__name__}.{_name}"] = _InertModule(f"{__name__}.{_name}")
transforms = sys.modules[f"{__name__}.transforms"]
io = sys.modules[f"{__name__}.io"]
ops = sys.modules[f"{__name__}.ops"]

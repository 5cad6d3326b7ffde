"""compressed-tensors FP8 checkpoints as files (``models/compressed_tensors.py`` reads their config):
each quantized ``<module>.weight`` is float8_e4m3fn with its scale beside it as
``<module>.weight_scale`` ([N, 1] per channel, [row blocks, column blocks] per block; float32 or
the model's 16-bit dtype), and the real weight is ``fp8.float() * scale``: the arithmetic of the
DeepSeek format's ``weight_scale_inv``. The reader below shows the scales under that name, so the
loader, the FP8 checks and the model hold both formats one way."""
from __future__ import annotations

import torch

from graphcp.errors import ConfigError
from graphcp.models.common.quantized import scale_name

_SUFFIX = ".weight_scale"


class ScaleNamesReader:
    """A checkpoint reader (``checkpoint.files.SafetensorsReader``) whose ``*.weight_scale`` tensors
    read as ``*.weight_scale_inv``; ``label`` gives back the checkpoint's own name for errors."""

    def __init__(self, reader) -> None:
        self.reader, self.source = reader, {}
        for name in reader.shapes:
            target = scale_name(name.removesuffix("_scale")) if name.endswith(_SUFFIX) else name
            if target in self.source:
                raise ConfigError(f"--model-path: tensors {reader.label(self.source[target])!r} "
                                  f"and {reader.label(name)!r} both hold {target!r}'s scales")
            self.source[target] = name
        self.shapes = {t: reader.shapes[s] for t, s in self.source.items()}
        self.dtypes = {t: reader.dtypes[s] for t, s in self.source.items()}

    def label(self, name: str) -> str:
        if name not in self.source and name.endswith("_scale_inv"):     # a missing scale
            return name.removesuffix("_inv")
        return self.reader.label(self.source.get(name, name))

    def read(self, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
        return self.reader.read(self.source[name], shard)

    def take(self, name: str, index) -> torch.Tensor:
        return self.reader.take(self.source[name], index)

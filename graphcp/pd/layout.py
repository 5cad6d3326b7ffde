"""Where a request's KV lands in a receiver's buffer: the contract between KVReceiver and KVSender.

One receive slot per request: an int64 header ``[num_layers][num_kv_heads]`` (tokens written for each
layer and header column, set by each sender after its data), then per layer each of its parts as
``[max_tokens][width]`` token-major rows, a part's ``width`` being the elements of one token's row:
dense models two parts, K and V, of ``num_kv_heads * head_dim`` (one header column per KV head, so
attention-TP ranks each mark their heads); DSA models the MLA row ``[kv_latent | k_rope]`` (``head_dim``
wide, one header column) plus, on layers with their own indexer, the indexer keys. Token-major rows make
one page of the sender's pool one contiguous write when a sender holds the whole row.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property

import torch

from graphcp.attention.kinds import KINDS as LAYER_KINDS
from graphcp.attention.kinds import cache_parts, layer_kinds
from graphcp.config import TORCH_DTYPES as DTYPES
from graphcp.errors import RequestError
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import MLAConfig

KINDS = tuple(sorted({kind.pd_kind for kind in LAYER_KINDS.values()}))


@dataclass(frozen=True)
class SlotLayout:
    num_layers: int
    num_kv_heads: int                 # header columns per layer (DSA: 1, the one latent "head")
    head_dim: int                     # one column's width (DSA: kv_lora_rank + rope_dim)
    max_tokens: int
    dtype: str
    kind: str = "mha"
    kv_lora_rank: int = 0             # DSA: where the latent ends and the rope part starts in the MLA row
    parts: tuple[tuple[int, ...], ...] = ()     # per layer, each part's row width in elements

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @cached_property
    def part_bases(self) -> tuple[tuple[int, ...], ...]:
        """Byte offset in the data where each layer's part starts."""
        bases, offset = [], 0
        for widths in self.parts:
            bases.append(tuple(offset + sum(widths[:i]) * self.max_tokens * self.element_size
                               for i in range(len(widths))))
            offset += sum(widths) * self.max_tokens * self.element_size
        return tuple(bases)

    @property
    def header_bytes(self) -> int:
        return -(-self.num_layers * self.num_kv_heads * 8 // 64) * 64     # keep the data 64-byte aligned

    @property
    def data_bytes(self) -> int:
        return sum(map(sum, self.parts)) * self.max_tokens * self.element_size

    @property
    def slot_bytes(self) -> int:
        return self.header_bytes + self.data_bytes

    def row_bytes(self, layer: int, part: int) -> int:
        return self.parts[layer][part] * self.element_size

    def row_offset(self, layer: int, part: int, token: int, column: int = 0) -> int:
        """Byte offset in the data of (layer, part, token, header column)."""
        row = self.row_bytes(layer, part)
        return self.part_bases[layer][part] + token * row + column * (row // self.num_kv_heads)

    def header_offset(self, layer: int, column: int) -> int:
        return (layer * self.num_kv_heads + column) * 8


def layout_for(cfg: ModelConfig, max_tokens: int, dtype: str) -> SlotLayout:
    """The layout of a model (``graphcp.models.read_model_config``): each layer's cache parts as its kind
    names them (``attention/kinds.py``), whole (attention TP 1). The header has a column per KV head of a
    dense model (attention-TP ranks mark their heads), one for a layer kind without heads."""
    layers = range(cfg.num_hidden_layers)
    parts = cache_parts(cfg, layers, 1)
    kind = layer_kinds(cfg, layers)[0].pd_kind
    first = parts[0][0]
    heads, column = (first.shape[0], first.shape[1]) if len(first.shape) == 2 else (1, first.width)
    latent = cfg.family_config.kv_lora_rank if isinstance(cfg.family_config, MLAConfig) else 0
    return SlotLayout(cfg.num_hidden_layers, heads, column, max_tokens, dtype, kind, latent,
                      tuple(tuple(p.width for p in parts[i]) for i in layers))


def destination_dict(rid: str, session: str, protocol: str, layout: SlotLayout, slot_addr: int) -> dict:
    fields_ = asdict(layout)
    fields_["parts"] = [list(widths) for widths in layout.parts]      # JSON-able as it is
    return {"rid": rid, "session": session, "protocol": protocol, **fields_,
            "header_addr": slot_addr, "data_addr": slot_addr + layout.header_bytes}


def parse_destination(rid: str, destination: object) -> tuple[SlotLayout, dict]:
    """The layout and addresses of a destination dict; a RequestError naming the key that is wrong."""
    if not isinstance(destination, dict):
        raise RequestError(f"request {rid!r}: destination must be the dict KVReceiver.destination() returns, "
                           f"got {type(destination).__name__}")
    names = [f.name for f in fields(SlotLayout)]
    for key in ("rid", "session", "protocol", "header_addr", "data_addr", *names):
        if key not in destination:
            raise RequestError(f"request {rid!r}: destination has no {key!r} key")
    if destination["rid"] != rid:
        raise RequestError(f"request {rid!r}: destination['rid'] is {destination['rid']!r}; ask the receiver for "
                           f"destination({rid!r})")
    for key, allowed in (("dtype", DTYPES), ("kind", KINDS)):
        if destination[key] not in allowed:
            raise RequestError(f"request {rid!r}: destination[{key!r}] {destination[key]!r} is not one of "
                               f"{', '.join(allowed)}")
    for key in ("header_addr", "data_addr", "num_layers", "num_kv_heads", "head_dim", "max_tokens", "kv_lora_rank"):
        if not isinstance(destination[key], int) or destination[key] < (key != "kv_lora_rank"):
            least = "an integer >= 0" if key == "kv_lora_rank" else "a positive integer"
            raise RequestError(f"request {rid!r}: destination[{key!r}] must be {least}, got {destination[key]!r}")
    parts = destination["parts"]
    if (not isinstance(parts, (list, tuple)) or len(parts) != destination["num_layers"]
            or not all(isinstance(p, (list, tuple)) and p and all(isinstance(w, int) and w > 0 for w in p)
                       for p in parts)):
        raise RequestError(f"request {rid!r}: destination['parts'] must hold, for each of the "
                           f"{destination['num_layers']} layers, a list of positive row widths")
    values = {**{key: destination[key] for key in names}, "parts": tuple(tuple(p) for p in parts)}
    return SlotLayout(**values), destination

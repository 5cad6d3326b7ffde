"""Where a request's KV lands in a receiver's buffer: the contract between KVReceiver and KVSender.

One receive slot per request: an int64 header ``[num_layers][num_kv_heads]`` (tokens written for each
layer and head, set by each sender after its data), then the data ``[num_layers][2 (k, v)][max_tokens]
[num_kv_heads][head_dim]``. Token-major rows make one page of the sender's pool (``[page_size, heads,
head_dim]``) one contiguous write when a sender holds every head.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from graphcp.errors import RequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SlotLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int
    dtype: str

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def token_bytes(self) -> int:
        """One token's row of one layer's K (or V): every head."""
        return self.num_kv_heads * self.head_dim * self.element_size

    @property
    def header_bytes(self) -> int:
        return -(-self.num_layers * self.num_kv_heads * 8 // 64) * 64     # keep the data 64-byte aligned

    @property
    def data_bytes(self) -> int:
        return self.num_layers * 2 * self.max_tokens * self.token_bytes

    @property
    def slot_bytes(self) -> int:
        return self.header_bytes + self.data_bytes

    def row_offset(self, layer: int, kv: int, token: int, head: int = 0) -> int:
        """Byte offset in the data of (layer, k=0/v=1, token, head)."""
        row = (layer * 2 + kv) * self.max_tokens + token
        return row * self.token_bytes + head * self.head_dim * self.element_size

    def header_offset(self, layer: int, head: int) -> int:
        return (layer * self.num_kv_heads + head) * 8


def destination_dict(rid: str, session: str, protocol: str, layout: SlotLayout, slot_addr: int) -> dict:
    return {"rid": rid, "session": session, "protocol": protocol, **asdict(layout),
            "header_addr": slot_addr, "data_addr": slot_addr + layout.header_bytes}


def parse_destination(rid: str, destination: object) -> tuple[SlotLayout, dict]:
    """The layout and addresses of a destination dict; a RequestError naming the key that is wrong."""
    if not isinstance(destination, dict):
        raise RequestError(f"request {rid!r}: destination must be the dict KVReceiver.destination() returns, "
                           f"got {type(destination).__name__}")
    for key in ("rid", "session", "protocol", "dtype", "header_addr", "data_addr", "num_layers", "num_kv_heads",
                "head_dim", "max_tokens"):
        if key not in destination:
            raise RequestError(f"request {rid!r}: destination has no {key!r} key")
    if destination["rid"] != rid:
        raise RequestError(f"request {rid!r}: destination['rid'] is {destination['rid']!r}; ask the receiver for "
                           f"destination({rid!r})")
    if destination["dtype"] not in DTYPES:
        raise RequestError(f"request {rid!r}: destination['dtype'] {destination['dtype']!r} is not one of "
                           f"{', '.join(DTYPES)}")
    for key in ("header_addr", "data_addr", "num_layers", "num_kv_heads", "head_dim", "max_tokens"):
        if not isinstance(destination[key], int) or destination[key] < 1:
            raise RequestError(f"request {rid!r}: destination[{key!r}] must be a positive integer, "
                               f"got {destination[key]!r}")
    layout = SlotLayout(destination["num_layers"], destination["num_kv_heads"], destination["head_dim"],
                        destination["max_tokens"], destination["dtype"])
    return layout, destination

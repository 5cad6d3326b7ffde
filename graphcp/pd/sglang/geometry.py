"""What graphcp's KV looks like in an SGLang decode's pool, and the writes that put it there.

SGLang's decode registers one region per pool entry: MHA (``MHATokenToKVPool``) K of every layer,
then V of every layer, each ``[slots, local_kv_heads, head_dim]``; MLA (``MLATokenToKVPool``) one
entry per layer of ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``. A page of an entry is
``page_size`` token rows, so page ``p`` starts at ``ptr + p * item_len``. graphcp's pool keeps the
same token-major rows (``[slots, heads, head_dim]`` and the MLA row ``[latent | rope]``), so a page
is one write when a rank holds the decode rank's whole row, and one write per token of the heads
both hold otherwise (attention TP differs: SGLang's head-slice transfer).

``Geometry`` is computed once per engine (the driver checks registrations with it); ``rank_writes``
runs on each rank, against its own pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphcp.errors import ConfigError
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import MLAConfig
from graphcp.pd.layout import layout_for
from graphcp.pd.sglang.wire import Registration


@dataclass(frozen=True)
class Geometry:
    kind: str  # "mha" | "mla"
    num_layers: int
    stages: tuple[range, ...]  # each pipeline stage's layers
    kv_heads: int  # MHA: all KV heads (MLA: 1)
    row: int  # MHA: head_dim; MLA: kv_lora_rank + qk_rope_head_dim
    element_size: int
    dtype: str
    page_size: int
    attn_tp_size: int  # graphcp's (the prefill's)

    @property
    def entries_per_layer(self) -> int:
        return 2 if self.kind == "mha" else 1

    def decode_heads(self, dst_tp_rank: int, dst_tp: int) -> range:
        """The KV heads an SGLang rank of attention-TP size ``dst_tp`` holds (replicated when
        ``dst_tp`` exceeds the heads: consecutive ranks share one)."""
        if self.kind == "mla":
            return range(1)
        per = max(1, self.kv_heads // dst_tp)
        first = (dst_tp_rank // max(1, dst_tp // self.kv_heads)) * per
        return range(first, first + per)

    def item_len(self, dst_tp: int) -> int:
        return self.page_size * len(self.decode_heads(0, dst_tp)) * self.row * self.element_size

    def check(self, reg: Registration, stage: int) -> str | None:
        """Why a decode rank's registered pool cannot take this model's KV (None if it can); the
        reason names what differs: layers, heads, head_dim, dtype or page size."""
        if reg.dcp_size != 1:
            return (
                f"the decode runs decode context parallelism ({reg.dcp_size}); graphcp writes dcp 1"
            )
        if reg.kv_layer_ids and list(reg.kv_layer_ids) != list(range(len(reg.kv_layer_ids))):
            return "the decode registered layer ids (a draft or hybrid pool); graphcp writes none"
        if any(reg.state_ptrs):
            return (
                "the decode registered state buffers (DSA indexer keys, sliding-window or mamba "
                "state), which graphcp does not send"
            )
        per = self.entries_per_layer
        counts = {per * self.num_layers, per * len(self.stages[stage])}
        if len(reg.kv_item_lens) not in counts:
            want = " or ".join(str(c) for c in sorted(counts))
            return (
                f"layers: the decode registered {len(reg.kv_item_lens)} KV entries; graphcp's "
                f"model "
                f"({self.kind}) has {self.num_layers} layers, {want} entries"
            )
        want, heads = self.item_len(reg.attn_tp_size), len(self.decode_heads(0, reg.attn_tp_size))
        for i, got in enumerate(reg.kv_item_lens):
            if got != want:
                return (
                    f"{_what_differs(got, want, self, heads)}: the decode's page of KV entry "
                    f"{i} is {got} bytes; graphcp's is {want} = page_size {self.page_size} x "
                    f"{heads} heads "
                    f"x {self.row} (head_dim) x {self.element_size}-byte {self.dtype}"
                )
        return None


def _what_differs(got: int, want: int, geo: Geometry, heads: int) -> str:
    """The likeliest single field behind a page-size mismatch, for the error message."""
    per_element = want // geo.element_size
    if (
        got % per_element == 0
        and got // per_element in (1, 2, 4)
        and got // per_element != geo.element_size
    ):
        return f"dtype ({got // per_element}-byte elements on the decode)"
    if got % (geo.page_size * geo.row * geo.element_size) == 0 and geo.kind == "mha":
        return "heads"
    if got % (geo.page_size * heads * geo.element_size) == 0:
        return "head_dim" if geo.kind == "mha" else "kv_lora_rank + qk_rope_head_dim"
    return "page size"


def geometry_for(
    cfg: ModelConfig,
    page_size: int,
    dtype: str,
    element_size: int,
    attn_tp: int,
    stages: tuple[range, ...],
) -> Geometry:
    """The model's geometry; a ConfigError naming the field for what SGLang's decode pools do not
    take from graphcp (DSA indexer keys, DeepSeek V4, linear attention)."""
    flag = "--disaggregation-bootstrap-port"
    layout = layout_for(cfg, 1, dtype)
    if layout.kind == "dsa":
        mla = cfg.family_config
        if isinstance(mla, MLAConfig) and mla.index_topk:
            raise ConfigError(
                f"{flag}: the model's DSA indexer keys (config index_topk="
                f"{mla.index_topk}, index_head_dim={mla.index_head_dim}) would go "
                f"to SGLang's fp8 indexer pages, which graphcp does not write; serve this "
                f"model with graphcp's own KVReceiver (transfer_kv)"
            )
        return Geometry(
            "mla",
            cfg.num_hidden_layers,
            stages,
            1,
            layout.head_dim,
            element_size,
            dtype,
            page_size,
            attn_tp,
        )
    if layout.kind != "mha":
        raise ConfigError(
            f"{flag}: {cfg.architecture} caches {layout.kind!r} layers, which SGLang's "
            f"PD decode pools (MHA and MLA) do not take"
        )
    return Geometry(
        "mha",
        cfg.num_hidden_layers,
        stages,
        cfg.num_key_value_heads,
        cfg.head_dim,
        element_size,
        dtype,
        page_size,
        attn_tp,
    )


@dataclass(frozen=True)
class Target:
    """One decode rank's destination, for the prefill rank (cp, tp, pp) that writes it."""

    cp: int
    tp: int
    pp: int
    session: str
    kv_ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    dst_tp_rank: int
    dst_tp_size: int
    pages: np.ndarray  # int32 decode pages for tokens past decode_prefix_len
    prefix_len: int


def rank_writes(
    geo: Geometry,
    parts_of,
    layers: range,
    stage: range,
    my_heads: range,
    src_pages: np.ndarray,
    tokens: int,
    target: Target,
    owned: np.ndarray | None = None,
) -> tuple[list, list, list]:
    """(source, destination, length) of every write of ``layers`` to ``target``, read in place from
    this rank's pool (``parts_of(layer)``: its ``[slots, ...]`` tensors) over ``src_pages`` (the
    request's pages in this pool's numbering). Pages whose rows this rank holds whole are written
    whole (the last may carry unused slots of the request's own page); other pages token by token,
    the heads both ranks hold. ``owned`` (KV sharding: a mask over the request's pages) keeps the
    pages this rank stores; the others are another CP rank's writes."""
    ps = geo.page_size
    first, last = target.prefix_len // ps, -(-tokens // ps)
    src = np.asarray(src_pages[first:last], dtype=np.int64)
    dst = np.asarray(target.pages, dtype=np.int64)
    places = np.arange(len(src), dtype=np.int64)  # each page's place past the decode's prefix
    if owned is not None:
        keep = np.asarray(owned[first:last], dtype=bool)
        src, dst, places = src[keep], dst[keep], places[keep]
    whole_dst = len(target.kv_ptrs) == geo.entries_per_layer * geo.num_layers
    dst_heads = geo.decode_heads(target.dst_tp_rank, target.dst_tp_size)
    heads = range(max(my_heads.start, dst_heads.start), min(my_heads.stop, dst_heads.stop))
    out: tuple[list, list, list] = ([], [], [])
    if not len(src):  # a short request may have no page on this CP rank
        return out
    for layer in layers:
        index = layer if whole_dst else layer - stage.start
        per_layer = len(target.kv_ptrs) // geo.entries_per_layer
        for part, rows in enumerate(parts_of(layer)[: geo.entries_per_layer]):
            entry = part * per_layer + index
            item, ptr = target.item_lens[entry], target.kv_ptrs[entry]
            row_bytes = rows[0].numel() * rows.element_size()
            if row_bytes * ps == item:
                _page_runs(out, rows.data_ptr(), ptr, src, dst, item)
            elif len(heads):
                head_bytes = row_bytes // len(my_heads)
                _head_slices(
                    out,
                    rows.data_ptr(),
                    ptr,
                    src,
                    dst,
                    places,
                    tokens - target.prefix_len,
                    ps,
                    row_bytes,
                    item // ps,
                    (heads.start - my_heads.start) * head_bytes,
                    (heads.start - dst_heads.start) * head_bytes,
                    len(heads) * head_bytes,
                )
    return out


def _page_runs(
    out: tuple[list, list, list],
    src_base: int,
    dst_base: int,
    src: np.ndarray,
    dst: np.ndarray,
    item: int,
) -> None:
    """One write per run of pages consecutive on both sides."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    for s, d in zip(np.split(src, breaks), np.split(dst, breaks)):
        out[0].append(src_base + int(s[0]) * item)
        out[1].append(dst_base + int(d[0]) * item)
        out[2].append(item * len(s))


def _head_slices(
    out: tuple[list, list, list],
    src_base: int,
    dst_base: int,
    src: np.ndarray,
    dst: np.ndarray,
    places: np.ndarray,
    tokens: int,
    ps: int,
    src_token: int,
    dst_token: int,
    src_offset: int,
    dst_offset: int,
    length: int,
) -> None:
    """One write per token of the pages given (``places``: their places among the ``tokens`` past
    the decode's prefix): this rank's slice of the shared heads into the decode rank's row."""
    token = (places[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)
    token = token[token < tokens]
    page, slot = np.searchsorted(places, token // ps), token % ps
    out[0].extend((src_base + (src[page] * ps + slot) * src_token + src_offset).tolist())
    out[1].extend((dst_base + dst[page] * ps * dst_token + slot * dst_token + dst_offset).tolist())
    out[2].extend([length] * len(token))

"""Paged varlen attention on torch's fused CPU attention, with the contract of
``torch_paged_attention`` (the oracle).

torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) skips the masked half of
a causal square and never materialises scores, but its ``is_causal`` is top-left aligned and it
takes one query/key length per call. So a sequence's keys are split where its queries' limits start:
- keys [0, split), which every query of the block sees: one unmasked call;
- keys [split, end) along the diagonal: a causal call where the limits step by one (a plain
  sequence, a zigzag block);
and the partial results are merged exactly by their log-sum-exp. Where the limits step by c > 1
(interleave: a rank's queries are every c-th token), the keys past the first query's limit split
into c residue classes, each a causal square against the queries after the first: one causal call
with the classes as its batch. Other limits run in row blocks, the narrow diagonal part of each
with an additive mask. Sequences of one shape share
calls; rows past the last sequence are zeros. The reference kernel runs instead on CUDA, where the
torch kernel is only a fallback, and for short batches, where its one padded call costs less than a
call per shape (measured crossover: requests of about 128 tokens).

A sliding window (``window`` W) keeps each query to its last W keys: rows run in blocks, each over
the band of keys any of its rows sees (at most W + the block's limit span), with an additive mask.
Attention sinks scale each row by e^lse / (e^lse + e^sink), once, after its parts are merged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.kernels.torch_ref import per_forward, torch_paged_attention

# Rows per block for limits that neither step by one nor by one stride: the masked part is about
# rows x rows x step keys, small beside the unmasked part at long prompts.
_MASKED_BLOCK_ROWS = 128
# Batches whose longest request has at most this many keys go to the reference kernel.
_SHORT_KV = 128
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class _Block:
    """Query rows [row_start, row_end) of a group: they see keys [0, split) all, keys [split, end)
    by ``limits``; None: limits stepping by ``stride`` (1: the top-left causal square
    ``end - split == row_end - row_start``; c > 1: ``end - split == c * (rows - 1)``)."""
    row_start: int
    row_end: int
    split: int
    end: int
    limits: torch.Tensor | None
    stride: int = 1


@dataclass
class _Group:
    """Sequences of one shape: query rows [G, q_len] and KV slots [G, kv_len], each a slice where
    they are consecutive (one request on consecutive pages; requests side by side at CP 1), read
    once per layer and shared by the group's blocks. Else rows are the sequences' row ranges in
    order, and slots one slice per sequence on consecutive pages, or indices [G, kv_len]."""
    rows: list[tuple[int, int]] | slice
    slots: torch.Tensor | list[slice] | slice
    blocks: list[_Block]
    seqs: int = 1             # G


def _plan(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
          page_size: int) -> tuple[int, bool, list[_Group]]:
    """(rows in sequences, whether a sequence sees no key, the groups): layer-independent, made
    once per forward on the host, in numpy (the kernel serves CPU tensors only: read in place)."""
    cu_np, rows_np = cu_seqlens_q.numpy(), page_rows.numpy()
    used = int(cu_np[-1])
    limits = q_limits.numpy()[:used]
    # bad[i]: limit steps other than +1 up to row i; rows with none between them are plain causal.
    bad = np.concatenate([np.zeros(1, np.int64), np.cumsum(np.diff(limits) != 1)])
    starts, ends = np.minimum(cu_np[:-1], used - 1), np.maximum(cu_np[1:] - 1, 0)
    if used:
        firsts, lasts = limits[starts].tolist(), limits[ends].tolist()
        plain = (bad[ends] == bad[starts]).tolist()
    cu = cu_np.tolist()
    groups, blind, runs = [], False, []
    open_runs: dict[tuple, int] = {}        # page-table row -> its causal run
    for seq, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if end == start:
            continue
        first, last = firsts[seq], lasts[seq]
        if last <= 0:
            blind = True
        elif not plain[seq] or first < 1:
            groups.append(_strided_group(seq, start, end, q_limits[start:end], rows_np, page_size))
        else:
            # A causal sequence on a row whose run ends one key earlier continues that run: CP 1's
            # zigzag splits each request into an early and a late block of one causal sequence.
            row = tuple(rows_np[seq].tolist())
            run = open_runs.get(row)
            if run is not None and runs[run][3] + 1 == first:
                pieces = runs[run][1]
                if pieces[-1][1] == start:        # adjacent rows (CP 1): one slice, no gather
                    pieces[-1] = (pieces[-1][0], end)
                else:
                    pieces.append((start, end))
                runs[run][3] = last
            else:
                open_runs[row] = len(runs)
                runs.append([seq, [(start, end)], first, last])
    shapes: dict[tuple[int, int], list] = {}
    for seq, pieces, _, last in runs:
        shapes.setdefault((sum(b - a for a, b in pieces), last), []).append((seq, pieces))
    for (q_len, kv_len), members in shapes.items():
        rows = _rows([piece for _, pieces in members for piece in pieces])
        block = _Block(0, q_len, kv_len - q_len, kv_len, None)
        seqs = [seq for seq, _ in members]
        groups.append(_Group(rows, _slots(rows_np[seqs], kv_len, page_size), [block], len(seqs)))
    return used, blind, groups


def _strided_group(seq: int, start: int, end: int, limits: torch.Tensor, page_rows: np.ndarray,
                   page_size: int) -> _Group:
    """One sequence whose limits do not step by one: one residue block where they step by one
    stride, else row blocks whose keys from the block's first limit minus one on are masked (so
    every masked row sees at least one key)."""
    steps = limits[1:] - limits[:-1]
    first, last = limits[[0, -1]].tolist()
    if steps.numel() and first >= 1 and int(steps[0]) > 1 and bool((steps == steps[0]).all()):
        block = _Block(0, end - start, first, last, None, int(steps[0]))
        return _Group(slice(start, end), _slots(page_rows[[seq]], last, page_size), [block])
    bounds = list(range(0, end - start, _MASKED_BLOCK_ROWS)) + [end - start]
    firsts = limits[bounds[:-1]].tolist()
    lasts = limits[[b - 1 for b in bounds[1:]]].tolist()
    blocks = [_Block(a, b, max(first - 1, 0), last, limits[a:b])
              for a, b, first, last in zip(bounds[:-1], bounds[1:], firsts, lasts)]
    return _Group(slice(start, end), _slots(page_rows[[seq]], lasts[-1], page_size), blocks)


def _rows(pieces: list[tuple[int, int]]) -> list[tuple[int, int]] | slice:
    """A group's row ranges, or one slice where each starts where the one before ends."""
    if all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])):
        return slice(pieces[0][0], pieces[-1][1])
    return pieces


def _slots(page_rows: np.ndarray, kv_len: int,
           page_size: int) -> torch.Tensor | list[slice] | slice:
    """KV slots [G, kv_len]; a slice where they are consecutive (read as a view): the sequences'
    pages follow one another, and each sequence but the last fills its pages; a slice per sequence
    where each one's pages are consecutive."""
    pages = page_rows[:, :-(-kv_len // page_size)]
    firsts = pages[:, 0].tolist()
    steps = np.broadcast_to(np.arange(pages.shape[1]), pages.shape)
    if np.array_equal(pages - pages[:, :1], steps):     # each sequence's pages consecutive
        slices = [slice(p * page_size, p * page_size + kv_len) for p in firsts]
        if len(slices) == 1 or (kv_len % page_size == 0 and all(
                a.stop == b.start for a, b in zip(slices, slices[1:]))):
            return slice(slices[0].start, slices[-1].stop)
        return slices
    key_pos = np.arange(kv_len)
    return torch.from_numpy(page_rows[:, key_pos // page_size] * page_size + key_pos % page_size)


def _read(pool: torch.Tensor, slots: torch.Tensor | list[slice] | slice, seqs: int) -> torch.Tensor:
    """[G, H, kv_len, D] keys or values of a group: a view of the pool where its slots are one
    slice (the flash kernel reads the pool's [slots, H, D] as fast as a head-major copy: 0.98-1.02x
    at 2-16K keys, measured alternately), else one head-major copy."""
    if isinstance(slots, slice):
        return pool[slots].unflatten(0, (seqs, -1)).transpose(1, 2)
    if isinstance(slots, list):                     # one copy from the sequences' slices
        return torch.stack([pool[s].transpose(0, 1) for s in slots])
    # Gathered head by head by advanced indexing: one copy of the group's rows, each (sequence,
    # head) a contiguous [kv_len, D] block. (index_select on the transposed pool would first copy
    # the whole pool contiguous: 5 ms at 40K slots.)
    rows = pool.transpose(0, 1)[:, slots.reshape(-1)]                           # [H, G * kv_len, D]
    return rows.unflatten(1, slots.shape).transpose(0, 1)


def torch_sdpa_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor,
                         q_limits: torch.Tensor, page_size: int, scale: float, max_q: int,
                         max_kv: int, out: torch.Tensor, *, workspace: dict | None = None,
                         window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``torch_paged_attention``; ``max_q`` only tells an empty batch apart,
    ``max_kv`` also a short one."""
    if q.device.type != "cpu" or max_kv <= _SHORT_KV:
        return torch_paged_attention(q, k_pool, v_pool, cu_seqlens_q, page_rows, q_limits,
                                     page_size, scale, max_q, max_kv, out, workspace=workspace,
                                     window=window, sinks=sinks)
    if max_q == 0:
        return out.zero_()
    meta = (cu_seqlens_q, page_rows, q_limits)
    if window:
        return _windowed(q, k_pool, v_pool, meta, page_size, scale, out, workspace, window, sinks)
    used, blind, groups = per_forward(workspace, f"sdpa{page_size}", meta,
                                      lambda: _plan(*meta, page_size))
    (out if blind else out[used:]).zero_()
    for group in groups:
        k, v = _read(k_pool, group.slots, group.seqs), _read(v_pool, group.slots, group.seqs)
        if isinstance(group.rows, slice):                     # consecutive rows: views, no gather
            qg, og = (x[group.rows].unflatten(0, (group.seqs, -1)) for x in (q, out))
            for block in group.blocks:
                rows = slice(block.row_start, block.row_end)
                o = _attend_block(qg[:, rows].transpose(1, 2), k, v, block, scale, sinks)
                og[:, rows] = o.transpose(1, 2)
            continue
        # Several sequences (or one in pieces), causal: one block; rows gathered (copies of the
        # row ranges: faster than indexing them) and put back range by range.
        block = group.blocks[0]
        qg = torch.cat([q[a:b] for a, b in group.rows])
        qg = qg.view(group.seqs, block.row_end, *q.shape[1:])
        o = _attend_block(qg.transpose(1, 2), k, v, block, scale, sinks).transpose(1, 2)
        done = 0
        for a, b in group.rows:
            seq, row = divmod(done, block.row_end)
            out[a:b] = o[seq, row:row + b - a]
            done += b - a
    return out


@dataclass
class _Band:
    """Query rows [start, end) of one sequence and the keys any of them sees under the window:
    their slots (a slice where consecutive) and an additive mask [rows, keys]."""
    start: int
    end: int
    slots: torch.Tensor | slice
    mask: torch.Tensor


def _window_plan(cu_seqlens_q: torch.Tensor, page_rows: torch.Tensor, q_limits: torch.Tensor,
                 page_size: int, window: int, dtype: torch.dtype) -> list[_Band]:
    """Row blocks of every sequence, each with its band of keys [first limit - W, last limit):
    layer-independent, made once per forward on the host."""
    cu, table, limits = (t.numpy() for t in (cu_seqlens_q, page_rows, q_limits))
    bands = []
    for seq, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        # limits never decrease: rows that see no key (limit 0) lead; they stay zeros
        start += int(np.searchsorted(limits[start:end], 1))
        for a in range(start, end, _MASKED_BLOCK_ROWS):
            b = min(a + _MASKED_BLOCK_ROWS, end)
            lo, hi = max(int(limits[a]) - window, 0), int(limits[b - 1])
            keys = np.arange(lo, hi)
            slots = table[seq][keys // page_size] * page_size + keys % page_size
            lim = limits[a:b, None]
            seen = (keys[None, :] < lim) & (keys[None, :] >= lim - window)
            mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(torch.from_numpy(~seen),
                                                                     float("-inf"))
            step = np.diff(slots)
            read = (slice(int(slots[0]), int(slots[-1]) + 1) if (step == 1).all()
                    else torch.from_numpy(slots[None]))
            bands.append(_Band(a, b, read, mask))
    return bands


def _windowed(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: tuple,
              page_size: int, scale: float, out: torch.Tensor, workspace: dict | None,
              window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    bands = per_forward(workspace, f"sdpa{page_size}/w{window}/{q.dtype}", meta,
                        lambda: _window_plan(*meta, page_size, window, q.dtype))
    out.zero_()
    for band in bands:
        k, v = _read(k_pool, band.slots, 1), _read(v_pool, band.slots, 1)
        qb = q[band.start:band.end].transpose(0, 1)[None]                      # [1, H, rows, D]
        o, lse = _flash(qb, k, v, attn_mask=band.mask, scale=scale)
        out[band.start:band.end] = _sunk(o, lse, sinks)[0].transpose(0, 1)
    return out


def _sunk(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """o [G, H, rows, D] with its rows' log-sum-exp [G, H, rows]: each row's softmax denominator
    gains its head's sink logit e^sink (which attends nothing)."""
    if sinks is None:
        return o
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])
    return (o.float() * keep.unsqueeze(-1)).to(o.dtype)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: _Block,
                  scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    if block.stride > 1:
        return _sunk(*_attend_residues(q, k, v, block, scale), sinks)
    diagonal = slice(block.split, block.end)
    if block.limits is None:
        o, lse = _flash(q, k[:, :, diagonal], v[:, :, diagonal], is_causal=True, scale=scale)
    else:
        keys = torch.arange(block.split, block.end)
        mask = torch.zeros(block.limits.shape[0], keys.shape[0], dtype=q.dtype)
        mask.masked_fill_(keys[None, :] >= block.limits[:, None], float("-inf"))
        o, lse = _flash(q, k[:, :, diagonal], v[:, :, diagonal], attn_mask=mask, scale=scale)
    if block.split == 0:
        return _sunk(o, lse, sinks)
    prefix = slice(0, block.split)
    o_prefix, lse_prefix = _flash(q, k[:, :, prefix], v[:, :, prefix], scale=scale)
    # softmax over both parts = the parts' softmaxes weighted by exp(lse) / sum
    weight = torch.sigmoid(lse_prefix - lse).unsqueeze(-1)
    merged = torch.lerp(o.float(), o_prefix.float(), weight).to(o.dtype)
    return _sunk(merged, torch.logaddexp(lse, lse_prefix), sinks)


def _attend_residues(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: _Block,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Limits first + c * j: query j sees the keys [0, first) and, of key first + c * t + s, those
    with t < j, for every residue s; so keys past ``first`` in [c, H, rows - 1, D] (residue as the
    batch) are one causal square against queries 1.. (query 0 sees only the first part).
    Returns the output and each row's log-sum-exp."""
    o_prefix, lse_prefix = _flash(q, k[:, :, :block.split], v[:, :, :block.split], scale=scale)
    rows = q.shape[2]
    if rows == 1:
        return o_prefix, lse_prefix
    c, tail = block.stride, slice(block.split, block.end)

    def residues(x: torch.Tensor) -> torch.Tensor:                 # [c, H, rows - 1, D] views
        return x[0, :, tail].unflatten(1, (rows - 1, c)).permute(2, 0, 1, 3)

    o, lse = _flash(q[:, :, 1:].expand(c, -1, -1, -1), residues(k), residues(v), is_causal=True,
                    scale=scale)
    # the c + 1 partial softmaxes of queries 1.., weighted by exp(lse) / sum
    lses = torch.cat([lse_prefix[:, :, 1:], lse])
    weight = torch.softmax(lses, 0).unsqueeze(-1)
    parts = torch.cat([o_prefix[:, :, 1:], o]).float()
    merged = (weight * parts).sum(0, keepdim=True).to(o.dtype)
    total = torch.cat([lse_prefix[:, :, :1], torch.logsumexp(lses, 0, keepdim=True)], 2)
    return torch.cat([o_prefix[:, :, :1], merged], 2), total

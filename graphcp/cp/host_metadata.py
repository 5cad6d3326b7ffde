"""The per-forward CP metadata of ``cp/metadata.py``, computed in numpy for an eager forward whose
descriptors live on the host.

The tensor forms run inside captured graphs; outside one, on the host, each of their ~60 small ops
costs ~10 us of dispatch (about 0.9 ms per forward, measured), where numpy takes a few. Every field
equals the tensor form's, value and dtype (int64): ``tests/core/test_host_metadata.py`` holds them equal on
random batches.
"""
from __future__ import annotations

import numpy as np
import torch

from graphcp.cp.metadata import CPMetadata
from graphcp.kv.cache import DUMMY_SLOT

# Past this many runs of consecutive slots the cache write indexes the slots instead.
_MAX_RUNS = 16


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.dtype == torch.int64 else t.long().numpy()


def _slots(table: np.ndarray, req: np.ndarray, pos: np.ndarray, valid: np.ndarray,
           page_size: int) -> np.ndarray:
    slot = table[req, pos // page_size] * page_size + pos % page_size
    return np.where(valid, slot, DUMMY_SLOT)


def _runs(slots: np.ndarray, valid: np.ndarray) -> tuple[tuple[int, int, int], ...] | None:
    """(row, slot, count) of each run where both the valid rows and their slots step by one."""
    rows = np.flatnonzero(valid)
    if rows.size == 0:
        return ()
    picked = slots[rows]
    cuts = np.flatnonzero((np.diff(rows) != 1) | (np.diff(picked) != 1)) + 1
    if cuts.size >= _MAX_RUNS:
        return None
    starts = np.concatenate(([0], cuts))
    counts = np.diff(np.concatenate((starts, [rows.size])))
    return tuple(zip(rows[starts].tolist(), picked[starts].tolist(), counts.tolist()))


def _meta(**fields: np.ndarray | int) -> CPMetadata:
    fields["gather_runs"] = _runs(fields["gather_slots"], fields["gather_token_index"] >= 0)
    return CPMetadata(**{k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64))
                         if isinstance(v, np.ndarray) else v for k, v in fields.items()})


def zigzag_metadata_host(extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                         cp_size: int, rank: int, local_cap: int, page_size: int,
                         whole_on: torch.Tensor | None = None) -> CPMetadata:
    """``zigzag_metadata`` on the host (same arguments, same result). Each rank's rows are pieces:
    its 2R sequences in order, then its padding; a row's value is its piece's first value plus the
    row's place in it, so every [C, local_cap] field is one repeat over the pieces (no searches)."""
    ext, pre, table = _np(extend_lens), _np(prefix_lens), _np(page_table)
    C, R, nblk = cp_size, ext.shape[0], 2 * cp_size
    blk_id = np.arange(nblk)
    blk = ext[:, None] // nblk + (blk_id[None, :] < (ext % nblk)[:, None])              # [R, 2C]
    if whole_on is not None:
        won = _np(whole_on)
        blk = np.where((won > 0)[:, None], ext[:, None] * (blk_id[None, :] == (won - 1)[:, None]), blk)
    blk_end = np.cumsum(blk, 1)
    # [C, 2R]: rank r's sequences are block r of every request, then block 2C-1-r of every request
    ranks_blocks = np.concatenate([blk_id[:C, None], blk_id[::-1][:C, None]], 1)      # [C, 2]
    seq_q = blk.T[ranks_blocks].reshape(C, 2 * R)
    seq_end = blk_end.T[ranks_blocks].reshape(C, 2 * R)
    seq_req = np.tile(np.arange(R), 2)
    # pieces [C, 2R + 1]: the sequences, then the padding, whose rows read as request R - 1's
    lens = np.concatenate([seq_q, local_cap - seq_q.sum(1, keepdims=True)], 1)
    first_row = (np.cumsum(lens) - lens.ravel()).reshape(lens.shape)
    first_new = np.concatenate([seq_end - seq_q, np.zeros((C, 1), np.int64)], 1)
    req_p = np.append(seq_req, R - 1)
    real = np.ones(2 * R + 1, bool)
    real[-1] = False
    tok_base = np.append((np.cumsum(ext) - ext)[seq_req], 0)[None, :] + first_new - first_row
    pos_base = np.append(pre[seq_req], 0)[None, :] + first_new - first_row
    flat_lens, rows = lens.ravel(), np.arange(C * local_cap)
    valid = np.repeat(np.tile(real, C), flat_lens)
    req = np.repeat(np.tile(req_p, C), flat_lens)
    position = (np.repeat(pos_base.ravel(), flat_lens) + rows) * valid
    token_index = (np.repeat(tok_base.ravel(), flat_lens) + rows) * valid
    slot = _slots(table, req, position, valid, page_size)
    mine = slice(rank * local_cap, (rank + 1) * local_cap)
    my_q, my_lens = seq_q[rank], lens[rank]
    my_kv = seq_end[rank] + pre[seq_req]
    # query j of a sequence sees its kv_len - q_len + j + 1 keys (bottom-right causal)
    limit_base = np.append(my_kv - my_q, 0) - (first_row[rank] - first_row[rank, 0]) + 1
    q_limits = (np.repeat(limit_base, my_lens) + rows[:local_cap]) * valid[mine]
    cu_r = np.concatenate([[0], np.cumsum(my_q)])
    last_late, last_early = cu_r[R + 1:] - 1, cu_r[1:R + 1] - 1
    logit_rows = np.maximum(np.where(blk[:, nblk - 1] > 0, last_late, last_early), 0)
    owner = (ext > 0) if rank == 0 else np.zeros(R, np.int64)
    if whole_on is not None:
        last_rank = np.where(won > 0, won - 1, 0)
        owner = (ext > 0) & (last_rank == rank)
        logit_rows = np.where(won > 0, np.maximum(last_early, 0), logit_rows) * owner
    return _meta(
        cp_size=C, local_cap=local_cap, token_index=token_index[mine], positions=position[mine],
        valid=valid[mine], gather_slots=slot, cu_seqlens_q=cu_r, q_lens=my_q, kv_lens=my_kv,
        page_rows=np.tile(table, (2, 1)), q_limits=q_limits, logit_rows=logit_rows, logit_owner=owner,
        gather_token_index=np.where(valid, token_index, -1), gather_positions=position,
        gather_requests=req, block_lens=blk, early_sequences=R)


def interleave_metadata_host(extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                             cp_size: int, rank: int, local_cap: int, page_size: int) -> CPMetadata:
    """``interleave_metadata`` on the host (same arguments, same result)."""
    ext, pre, table = _np(extend_lens), _np(prefix_lens), _np(page_table)
    C, R = cp_size, ext.shape[0]
    cu_ext = np.concatenate([np.zeros(1, np.int64), np.cumsum(ext)])
    flat = np.arange(C)[:, None] + np.arange(local_cap)[None, :] * C                    # [C, B]
    valid = flat < cu_ext[-1]
    req = np.minimum(np.searchsorted(cu_ext[1:], flat, side="right"), R - 1)
    new_idx = (flat - cu_ext[req]) * valid
    position = pre[req] * valid + new_idx
    slot = _slots(table, req, position, valid, page_size)
    cu_q = np.maximum((cu_ext - rank + C - 1) // C, 0)
    last = cu_ext[1:] - 1
    owner = (last % C == rank) & (ext > 0)
    return _meta(
        cp_size=C, local_cap=local_cap, token_index=flat[rank] * valid[rank], positions=position[rank],
        valid=valid[rank], gather_slots=slot.ravel(), cu_seqlens_q=cu_q, q_lens=np.diff(cu_q),
        kv_lens=pre + ext, page_rows=table, q_limits=(position[rank] + 1) * valid[rank],
        logit_rows=np.maximum(last // C, 0) * owner, logit_owner=owner,
        gather_token_index=np.where(valid, flat, -1).ravel(), gather_positions=position.ravel(),
        gather_requests=req.ravel(), block_lens=ext[:, None])


__all__ = ["zigzag_metadata_host", "interleave_metadata_host"]

"""Per-forward CP metadata, computed with tensor ops only so that it can run inside a captured graph.

Inputs are the raw batch descriptors (new lengths, cached-prefix lengths, page-table rows); padding
requests have length 0. Outputs are indexed by this rank's local token rows (capacity ``local_cap``) and
by the rows of the all-gathered K/V buffer (``cp_size * local_cap``, rank-major, as the collective lays
them out). No host syncs, no data-dependent shapes, no constants copied from the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from graphcp.kv.cache import DUMMY_SLOT


@dataclass
class CPMetadata:
    cp_size: int
    local_cap: int
    token_index: torch.Tensor    # [local_cap] flat index into the batch's new tokens (0 on padding rows)
    positions: torch.Tensor      # [local_cap] original positions (0 on padding rows)
    valid: torch.Tensor          # [local_cap] 1 for real tokens, 0 for padding rows
    gather_slots: torch.Tensor   # [cp_size * local_cap] KV slot of each all-gathered row (dummy for padding)
    cu_seqlens_q: torch.Tensor   # [S + 1] attention sequences over the local rows
    q_lens: torch.Tensor         # [S]
    kv_lens: torch.Tensor        # [S]
    page_rows: torch.Tensor      # [S, P] page-table row of each sequence
    q_limits: torch.Tensor       # [local_cap] keys each local query may see (bottom-right causal)
    logit_rows: torch.Tensor     # [R] local row of each request's last token
    logit_owner: torch.Tensor    # [R] 1 where this rank holds that row
    gather_token_index: torch.Tensor  # [cp_size * local_cap] new-token index of each all-gathered row, -1: padding
    gather_positions: torch.Tensor    # [cp_size * local_cap] position of each gathered row (0: pad)
    gather_requests: torch.Tensor     # [cp_size * local_cap] request (page-table row) of each one
    block_lens: torch.Tensor     # [R, blocks] each request's new tokens in the layout's blocks, in
                                 # order (zigzag: 2C, rank r holds r and 2C-1-r; interleave: one)
    early_sequences: int = 0     # zigzag: the first R sequences are the early blocks (0: no early/late split)
    state_in: torch.Tensor | None = None    # [R] per-request state slot each request reads (0: none)
    state_out: torch.Tensor | None = None   # [R] per-request state slot it writes (kv/states.py)
    # Host forms only: (gathered row, slot, count) of each run of consecutive slots over the real
    # gathered rows, so the cache write is a few slice copies; None: unknown (index the slots).
    gather_runs: tuple[tuple[int, int, int], ...] | None = None

    def to(self, device: torch.device, *extra: torch.Tensor) -> tuple["CPMetadata", list[torch.Tensor]]:
        """Every field (and ``extra`` int64 tensors) moved in one host-to-device copy: an eager forward on
        a GPU builds its metadata on the host and ships it whole, instead of ~100 small kernel launches."""
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        parts = [getattr(self, n) for n in names] + list(extra)
        assert all(t.dtype == torch.int64 for t in parts), "metadata is int64 throughout"
        flat = torch.cat([t.reshape(-1) for t in parts]).to(device)
        moved, start = [], 0
        for t in parts:
            moved.append(flat[start:start + t.numel()].view(t.shape))
            start += t.numel()
        return replace(self, **dict(zip(names, moved))), moved[len(names):]


@dataclass(frozen=True)
class LastTokens:
    """Attention for one query per request (its last new token, at row ``logit_rows``): requests
    with new tokens are one-row sequences over their whole context; padding requests are empty."""
    cu_seqlens_q: torch.Tensor   # [R + 1]
    page_rows: torch.Tensor      # [R, P]
    q_limits: torch.Tensor       # [R] every key of the request's context


def last_tokens(extend_lens: torch.Tensor, prefix_lens: torch.Tensor,
                meta: CPMetadata) -> LastTokens:
    """Tensor ops only (a graph captures them); the first R page rows of either layout are the
    requests' rows. Made where the metadata is (lengths elsewhere are moved there)."""
    device = meta.page_rows.device
    extend_lens, prefix_lens = extend_lens.to(device), prefix_lens.to(device)
    has = (extend_lens > 0).long()
    cu = torch.nn.functional.pad(torch.cumsum(has, 0), (1, 0))
    return LastTokens(cu, meta.page_rows[:extend_lens.shape[0]], (prefix_lens + extend_lens) * has)


def _exclusive_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def _slots(page_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    pages = page_table[req, torch.div(pos, page_size, rounding_mode="floor")]
    return pages * page_size + torch.remainder(pos, page_size)


def zigzag_metadata(extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                    cp_size: int, rank: int, local_cap: int, page_size: int,
                    whole_on: torch.Tensor | None = None) -> CPMetadata:
    """Zigzag: each request split in 2C blocks (early blocks take the remainder); rank r owns blocks
    r and 2C-1-r. Local order: every request's early block, then every request's late block.
    ``whole_on`` (adaptive CP): a request with value r + 1 is one early block r, whole on rank r, and the
    rank holding each request's last token owns its logit row (the strategy then reduces the rows)."""
    dev, C, R = extend_lens.device, cp_size, extend_lens.shape[0]
    nblk = 2 * C
    blk_id = torch.arange(nblk, device=dev)
    blk = extend_lens[:, None] // nblk + (blk_id[None, :] < (extend_lens % nblk)[:, None]).long()   # [R, 2C]
    if whole_on is not None:
        whole = (whole_on > 0).long()[:, None]
        blk = blk * (1 - whole) + extend_lens[:, None] * (blk_id[None, :] == (whole_on - 1)[:, None]).long()
    blk_end = torch.cumsum(blk, 1)
    blk_start = blk_end - blk
    ranks = torch.arange(C, device=dev)
    early, late = ranks, nblk - 1 - ranks
    # Sequences per rank: R early blocks then R late blocks -> [2R, C]
    seq_q = torch.cat([blk[:, early], blk[:, late]], 0)
    seq_start = torch.cat([blk_start[:, early], blk_start[:, late]], 0)
    seq_kv = torch.cat([blk_end[:, early], blk_end[:, late]], 0) + prefix_lens.repeat(2)[:, None]
    seq_req = torch.arange(R, device=dev).repeat(2)
    cu = torch.cat([torch.zeros(1, C, dtype=seq_q.dtype, device=dev), torch.cumsum(seq_q, 0)], 0).t().contiguous()
    rows = torch.arange(local_cap, device=dev).expand(C, local_cap).contiguous()       # [C, B]
    seq = torch.searchsorted(cu[:, 1:].contiguous(), rows, right=True).clamp(max=2 * R - 1)
    valid = (rows < cu[:, -1:]).long()
    offset = rows - cu.gather(1, seq)
    req = seq_req[seq]
    new_idx = (seq_start.t().gather(1, seq) + offset) * valid                          # index among new tokens
    position = prefix_lens[req] * valid + new_idx
    slot = _slots(page_table, req, position, page_size) * valid + DUMMY_SLOT * (1 - valid)
    token_index = (_exclusive_cumsum(extend_lens)[req] + new_idx) * valid
    my_q, my_kv = seq_q[:, rank], seq_kv[:, rank]
    my_seq, my_off = seq[rank], offset[rank]
    q_limits = (my_kv[my_seq] - my_q[my_seq] + my_off + 1) * valid[rank]
    cu_r = cu[rank]
    last_late = cu_r[R + 1:] - 1
    last_early = cu_r[1:R + 1] - 1
    logit_rows = torch.where(blk[:, nblk - 1] > 0, last_late, last_early).clamp(min=0)
    owner = (extend_lens > 0).long() if rank == 0 else torch.zeros_like(extend_lens)
    if whole_on is not None:    # rank 0 holds the split requests' last tokens, rank r those whole on it
        last_rank = torch.where(whole_on > 0, whole_on - 1, 0)
        owner = ((extend_lens > 0) & (last_rank == rank)).long()
        logit_rows = torch.where(whole_on > 0, last_early.clamp(min=0), logit_rows) * owner
    return CPMetadata(
        cp_size=C, local_cap=local_cap, token_index=token_index[rank], positions=position[rank],
        valid=valid[rank], gather_slots=slot.reshape(-1), cu_seqlens_q=cu_r, q_lens=my_q, kv_lens=my_kv,
        page_rows=page_table.repeat(2, 1), q_limits=q_limits, logit_rows=logit_rows, logit_owner=owner,
        gather_token_index=((token_index + 1) * valid - 1).reshape(-1),
        gather_positions=position.reshape(-1), gather_requests=req.reshape(-1), block_lens=blk,
        early_sequences=R)


def interleave_metadata(extend_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                        cp_size: int, rank: int, local_cap: int, page_size: int) -> CPMetadata:
    """Interleave: flattened new-token index t goes to rank t % C, across request boundaries. Local
    tokens of one request are contiguous, so each request is one attention sequence whose queries
    carry their own causal limits."""
    dev, C, R = extend_lens.device, cp_size, extend_lens.shape[0]
    cu_ext = torch.cat([torch.zeros(1, dtype=extend_lens.dtype, device=dev), torch.cumsum(extend_lens, 0)])
    total = cu_ext[-1:]
    ranks = torch.arange(C, device=dev)[:, None]
    flat = ranks + torch.arange(local_cap, device=dev)[None, :] * C                     # [C, B]
    valid = (flat < total).long()
    req = torch.searchsorted(cu_ext[1:].contiguous(), flat.contiguous(), right=True).clamp(max=R - 1)
    new_idx = (flat - cu_ext[req]) * valid
    position = prefix_lens[req] * valid + new_idx
    slot = _slots(page_table, req, position, page_size) * valid + DUMMY_SLOT * (1 - valid)
    # Local rows of request q on this rank: flat indices in [cu_ext[q], cu_ext[q+1]) congruent to rank.
    cu_q = torch.div(cu_ext - rank + C - 1, C, rounding_mode="floor").clamp(min=0)
    q_lens = cu_q[1:] - cu_q[:-1]
    last = cu_ext[1:] - 1
    owner = ((torch.remainder(last, C) == rank) & (extend_lens > 0)).long()
    return CPMetadata(
        cp_size=C, local_cap=local_cap, token_index=flat[rank] * valid[rank], positions=position[rank],
        valid=valid[rank], gather_slots=slot.reshape(-1), cu_seqlens_q=cu_q, q_lens=q_lens,
        kv_lens=prefix_lens + extend_lens, page_rows=page_table, q_limits=(position[rank] + 1) * valid[rank],
        logit_rows=torch.div(last, C, rounding_mode="floor").clamp(min=0) * owner, logit_owner=owner,
        gather_token_index=((flat + 1) * valid - 1).reshape(-1),
        gather_positions=position.reshape(-1), gather_requests=req.reshape(-1),
        block_lens=extend_lens[:, None])


def window_halo(meta: CPMetadata, rank: int,
                window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows a sliding-window layer all-gathers under zigzag: of each block, its last
    min(len, W - 1) tokens. A query at position p reads keys p - W < j <= p: beyond its own block,
    only the last W - 1 tokens of earlier blocks; and the next chunk reads the request's last
    W - 1 tokens, which lie in those of its last blocks. So every rank's cache gets its own rows
    plus these. (rows this rank sends [H], padded with row 0; the slot of each gathered row
    [C * H], the dummy slot for padding), H = min(local_cap, 2R(W - 1)) (static in a graph);
    None where that saves nothing, or for a layout without zigzag's blocks (interleave: every
    rank's window spans every rank)."""
    if meta.cp_size == 1 or meta.early_sequences == 0 or window <= 1:
        return None
    C, B, blk = meta.cp_size, meta.local_cap, meta.block_lens
    cap = 2 * blk.shape[0] * (window - 1)
    if cap >= B:
        return None
    ranks = torch.arange(C, device=blk.device)
    seq_q = torch.cat([blk[:, ranks], blk[:, 2 * C - 1 - ranks]], 0).t()               # [C, 2R]
    ends = torch.cumsum(seq_q, 1)                                                      # rows
    sent_ends = torch.cumsum(seq_q.clamp(max=window - 1), 1).contiguous()
    h = torch.arange(cap, device=blk.device).expand(C, cap).contiguous()
    piece = torch.searchsorted(sent_ends, h, right=True)                               # [C, H]
    valid = (piece < seq_q.shape[1]).long()
    piece = piece.clamp(max=seq_q.shape[1] - 1)
    row = (ends.gather(1, piece) - sent_ends.gather(1, piece) + h) * valid              # [C, H]
    slots = meta.gather_slots.view(C, B).gather(1, row) * valid + DUMMY_SLOT * (1 - valid)
    return row[rank], slots.reshape(-1)


@dataclass(slots=True)
class HostMaxima:
    """Host-side values of one batch on one rank (break arguments) and a per-forward kernel scratch."""
    max_q: int = 0
    max_kv: int = 0
    early_rows: int = 0     # zigzag: local rows held by early blocks (the flashattention path splits there)
    workspace: dict = field(default_factory=dict)   # per-forward values kernels share across layers

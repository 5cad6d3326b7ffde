"""The rows a sliding-window layer all-gathers under zigzag (``cp.metadata.window_halo``), against
what the window needs, worked out here token by token from the layout: every key a rank's queries
read (p - W < j <= p) is its own row or a gathered one, and so is each request's last W - 1 tokens
(what the next chunk reads from the cache); and nothing else is gathered but blocks' tails."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.cp.adaptive import AdaptiveZigzagStrategy
from graphcp.cp.metadata import window_halo, zigzag_metadata
from graphcp.kv.cache import DUMMY_SLOT

PAGE = 4


def _batch(extend: list[int], prefix: list[int], cp: int, local_cap: int, rank: int, whole_on=None):
    pages = max(-(-(e + p) // PAGE) for e, p in zip(extend, prefix))
    table = torch.arange(1, 1 + len(extend) * pages).view(len(extend), pages)
    return zigzag_metadata(torch.tensor(extend), torch.tensor(prefix), table, cp, rank, local_cap,
                           PAGE, whole_on)


@settings(max_examples=60, deadline=None)
@given(cp=st.sampled_from([2, 3, 4]), window=st.integers(2, 20),
       extend=st.lists(st.integers(8, 120), min_size=1, max_size=3),
       prefix=st.lists(st.integers(0, 40), min_size=3, max_size=3), extra=st.integers(0, 400),
       whole=st.booleans())
def test_halo_holds_every_key_the_window_reads(cp, window, extend, prefix, extra, whole):
    prefix = prefix[:len(extend)]
    placement = [cp if whole and i == 0 else 0 for i in range(len(extend))]
    whole_on = torch.tensor(placement) if whole else None   # adaptive: request 0 whole on C-1
    counts = AdaptiveZigzagStrategy(cp, 2 * cp, whole_on=placement).per_rank_tokens(extend)
    local_cap = max(counts) + extra                     # the bucket's padding
    metas = [_batch(extend, prefix, cp, local_cap, r, whole_on) for r in range(cp)]
    halos = [window_halo(m, r, window) for r, m in enumerate(metas)]
    cap = 2 * len(extend) * (window - 1)
    if cap >= local_cap:
        assert all(h is None for h in halos)            # it would save nothing: everything moves
        return
    gathered = halos[0][1]
    assert all(torch.equal(h[1], gathered) for h in halos)      # one collective: the same rows
    assert gathered.shape == (cp * cap,)
    for r, (rows, _) in enumerate(halos):                # what each rank sends is its rows' slots
        mine = metas[r].gather_slots.view(cp, local_cap)[r]
        sent = gathered.view(cp, cap)[r]
        assert torch.equal(torch.where(sent != DUMMY_SLOT, mine[rows], DUMMY_SLOT), sent)
    slot_of = {}                                        # (request, position) -> slot
    for r, m in enumerate(metas):
        for row in range(local_cap):
            if m.valid[row]:
                req = int(m.gather_requests.view(cp, local_cap)[r, row])
                slot = m.gather_slots.view(cp, local_cap)[r, row]
                slot_of[req, int(m.positions[row])] = int(slot)
    held = set(gathered.tolist()) - {DUMMY_SLOT}
    for r, m in enumerate(metas):
        own = {int(s) for s, ok in zip(m.gather_slots.view(cp, local_cap)[r], m.valid) if ok}
        cached = own | held
        for row in range(local_cap):
            if not m.valid[row]:
                continue
            req = int(m.gather_requests.view(cp, local_cap)[r, row])
            p = int(m.positions[row])
            for j in range(max(p - window + 1, prefix[req]), p + 1):   # new keys in its window
                assert slot_of[req, j] in cached, (r, req, p, j)
    for req, (e, p) in enumerate(zip(extend, prefix)):  # the next chunk's keys
        for j in range(max(p + e - window + 1, p), p + e):
            assert slot_of[req, j] in held
    # only blocks' tails: each gathered row is within W - 1 of its block's end
    assert len(held) <= sum(min(n, window - 1) for n in metas[0].block_lens.view(-1).tolist())

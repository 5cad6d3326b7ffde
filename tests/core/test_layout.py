"""build_layout: the worked examples of SPEC section 3, and the layout rules on thousands of random batches."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.cp import build_layout


def test_zigzag_one_request_cp4():
    owned = [build_layout("zigzag", 4, r, [16]).local_indices for r in range(4)]
    assert owned == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_zigzag_two_requests_with_prefix():
    layout = build_layout("zigzag", 4, 2, [9, 10], [2, 3])
    assert layout.local_indices == [3, 13, 6, 16]
    assert layout.per_rank_tokens == [6, 5, 4, 4]
    assert layout.kv_lens_early == [6, 8]
    assert layout.kv_lens_late == [9, 11]
    assert layout.q_lens_early == [1, 1] and layout.q_lens_late == [1, 1]


def test_interleave_example():
    r0 = build_layout("interleave", 4, 0, [5, 3])
    r1 = build_layout("interleave", 4, 1, [5, 3])
    assert r0.local_indices == [0, 4] and r0.kv_lens == [1, 5] and r0.requests == [0, 0]
    assert r1.local_indices == [1, 5] and r1.requests == [0, 1] and r1.kv_lens == [2, 1]


def _zigzag_blocks(n: int, c: int) -> list[int]:
    base, rem = divmod(n, 2 * c)
    return [base + (b < rem) for b in range(2 * c)]


batches = st.integers(1, 4).flatmap(lambda c: st.tuples(
    st.just(c),
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 40)), min_size=1, max_size=6)))


@settings(max_examples=800, deadline=None)
@given(batches)
def test_zigzag_rules(batch):
    c, reqs = batch
    ext, pre = [e for e, _ in reqs], [p for _, p in reqs]
    starts = [sum(ext[:q]) for q in range(len(ext))]
    owned = []
    for r in range(c):
        lay = build_layout("zigzag", c, r, ext, pre)
        expected_early, expected_late = [], []
        for q, n in enumerate(ext):
            blk = _zigzag_blocks(n, c)
            b0, b1 = sum(blk[:r]), sum(blk[:2 * c - 1 - r])
            expected_early += [starts[q] + i for i in range(b0, b0 + blk[r])]
            expected_late += [starts[q] + i for i in range(b1, b1 + blk[2 * c - 1 - r])]
            assert lay.q_lens_early[q] == blk[r] and lay.q_lens_late[q] == blk[2 * c - 1 - r]
            assert lay.kv_lens_early[q] == pre[q] + sum(blk[:r + 1])
            assert lay.kv_lens_late[q] == pre[q] + sum(blk[:2 * c - r])
        assert lay.local_indices == expected_early + expected_late     # early blocks first, request order
        assert lay.per_rank_tokens[r] == len(lay.local_indices)
        owned += lay.local_indices
    assert sorted(owned) == list(range(sum(ext)))                         # every token owned exactly once


@settings(max_examples=800, deadline=None)
@given(batches)
def test_interleave_rules(batch):
    c, reqs = batch
    ext, pre = [e for e, _ in reqs], [p for _, p in reqs]
    total = sum(ext)
    req_of = [q for q, n in enumerate(ext) for _ in range(n)]
    pos_of = [i for n in ext for i in range(n)]
    owned = []
    for r in range(c):
        lay = build_layout("interleave", c, r, ext, pre)
        assert lay.local_indices == list(range(r, total, c))
        assert lay.requests == [req_of[t] for t in lay.local_indices]
        assert lay.kv_lens == [pre[req_of[t]] + pos_of[t] + 1 for t in lay.local_indices]
        base, extra = divmod(total, c)
        assert lay.per_rank_tokens[r] == base + (r < extra) == len(lay.local_indices)
        owned += lay.local_indices
    assert sorted(owned) == list(range(total))


def test_metadata_moves_in_one_packed_copy():
    """The eager GPU path builds metadata on the host and ships it as one flat tensor: every field, shape and
    value must survive the packing (checked here with a host-to-host move)."""
    import torch

    from graphcp.cp.metadata import zigzag_metadata
    extend, prefix = torch.tensor([13, 5, 0]), torch.tensor([3, 0, 0])
    table = torch.arange(1, 13).view(3, 4)
    meta = zigzag_metadata(extend, prefix, table, 2, 1, 12, 4)
    ids = torch.arange(100, 112)
    moved, (moved_ids,) = meta.to(torch.device("cpu"), ids)
    assert torch.equal(moved_ids, ids)
    for name, value in vars(meta).items():
        got = getattr(moved, name)
        if isinstance(value, torch.Tensor):
            assert got.shape == value.shape and torch.equal(got, value), name
            assert got.data_ptr() != value.data_ptr(), f"{name} must live in the packed buffer"
        else:
            assert got == value


@settings(max_examples=300, deadline=None)
@given(batches, st.sampled_from(["zigzag", "interleave"]))
def test_build_layout_is_the_layout_the_forward_runs(batch, strategy):
    """The numpy layout users read equals the tensor metadata the engine builds in its forward."""
    import torch

    from graphcp.cp.strategy import make_strategy
    c, reqs = batch
    ext, pre = [e for e, _ in reqs], [p for _, p in reqs]
    strat = make_strategy(strategy, c)
    cap = max(strat.per_rank_tokens(ext)) or 1
    lens, prefix = torch.tensor(ext), torch.tensor(pre)
    pages = torch.zeros(len(ext), max(1, max(p + e for p, e in zip(pre, ext))), dtype=torch.long)
    for r in range(c):
        lay = build_layout(strategy, c, r, ext, pre)
        meta = strat.metadata(lens, prefix, pages, r, cap, page_size=1)
        valid = meta.valid.bool()
        assert lay.local_indices == meta.token_index[valid].tolist()
        if strategy == "zigzag":
            n = len(ext)
            assert lay.q_lens_early + lay.q_lens_late == meta.q_lens.tolist()
            assert lay.kv_lens_early + lay.kv_lens_late == meta.kv_lens.tolist()
            assert n == meta.early_sequences
        else:
            assert lay.kv_lens == meta.q_limits[valid].tolist()

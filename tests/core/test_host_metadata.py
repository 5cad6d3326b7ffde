"""The numpy metadata an eager forward builds on the host equals the tensor metadata a graph captures,
field by field (values, shapes, int64), on random batches of every strategy."""
from __future__ import annotations

from dataclasses import fields

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.cp import host_metadata
from graphcp.cp.host_metadata import interleave_metadata_host, zigzag_metadata_host
from graphcp.cp.metadata import interleave_metadata, zigzag_metadata
from graphcp.cp.strategy import make_strategy

batches = st.tuples(
    st.integers(1, 4), st.integers(1, 5), st.integers(0, 12),
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=6),
    st.integers(0, 2 ** 31))


def _inputs(c: int, reqs: list, page_size: int, seed: int):
    ext = torch.tensor([e for e, _, _ in reqs])
    pre = torch.tensor([p for _, p, _ in reqs])
    pages = -(-(ext + pre).max().item() // page_size) + 1
    table = torch.randint(1, 500, (len(reqs), pages), generator=torch.Generator().manual_seed(seed))
    whole_on = torch.tensor([w % (c + 1) for _, _, w in reqs])
    return ext, pre, table, whole_on


def _runs_write_the_real_rows(meta) -> None:
    """The host form's slot runs name exactly the real gathered rows and their slots (tensor forms
    leave them unknown); many short runs fall back to indexing."""
    real = (meta.gather_token_index >= 0).nonzero().flatten().tolist()
    if meta.gather_runs is None:
        assert len(real) > host_metadata._MAX_RUNS
        return
    rows, slots = [], []
    for row, slot, count in meta.gather_runs:
        assert count > 0
        rows += range(row, row + count)
        slots += range(slot, slot + count)
    assert rows == real and slots == meta.gather_slots[real].tolist()


def _same(host, tensor) -> None:
    assert tensor.gather_runs is None
    _runs_write_the_real_rows(host)
    for f in fields(tensor):
        if f.name == "gather_runs":
            continue
        a, b = getattr(host, f.name), getattr(tensor, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == torch.int64 and a.shape == b.shape, f.name
            assert torch.equal(a, b), f"{f.name}: {a.tolist()} != {b.tolist()}"
        else:
            assert a == b, f.name


FORMS = {"zigzag": (zigzag_metadata_host, zigzag_metadata),
         "interleave": (interleave_metadata_host, interleave_metadata)}


@settings(max_examples=800, deadline=None)     # 400 per strategy, as two tests had
@given(batches, st.sampled_from(sorted(FORMS)))
def test_host_form_equals_tensor_form(batch, name):
    c, page_size, pad, reqs, seed = batch
    ext, pre, table, whole_on = _inputs(c, reqs, page_size, seed)
    cap = max(make_strategy(name, c).per_rank_tokens(ext.tolist())) + pad or 1
    host, tensor = FORMS[name]
    for rank in range(c):
        args = (ext, pre, table, c, rank, cap, page_size)
        _same(host(*args), tensor(*args))
        if name == "zigzag":
            # adaptive CP: some requests whole on one rank (cap: every request might be whole here)
            args = (ext, pre, table, c, rank, cap + int(ext.sum()), page_size)
            _same(host(*args, whole_on), tensor(*args, whole_on))


def test_strategies_choose_the_form_by_on_host():
    """``on_host`` picks numpy; both forms give the same metadata through the strategy API."""
    ext, pre = torch.tensor([9, 0, 5]), torch.tensor([3, 0, 1])
    table = torch.arange(12).view(3, 4) + 1
    for name in ("zigzag", "interleave"):
        strat = make_strategy(name, 2)
        cap = max(strat.per_rank_tokens(ext.tolist()))
        _same(strat.metadata(ext, pre, table, 1, cap, 4, on_host=True), strat.metadata(ext, pre, table, 1, cap, 4))

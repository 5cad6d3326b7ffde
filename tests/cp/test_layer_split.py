"""LayerSplit's scratch numbering: a batch's pages renumbered 1..n (the dummy page stays 0), both ways, and
the cached-prefix slots the owners broadcast. The engine-level parity tests are in test_pd.py and
test_pd_dsa.py."""
from __future__ import annotations

import numpy as np
import torch

from graphcp.kv.layer_split import ScratchPages, _grown


def test_scratch_renumbers_the_batch_pages_and_back():
    scratch = ScratchPages(num_pages=12, page_size=4, device=torch.device("cpu"))
    rows = [np.array([9, 3]), np.array([5, 11, 7])]           # two requests' page rows, scattered
    scratch.begin(rows, prefix_lens=[5, 0])
    assert scratch.pages == 6                                  # 5 pages + the dummy page
    assert scratch.to_global.tolist() == [0, 3, 5, 7, 9, 11]
    # Request 0 has a 5-token prefix: page 9 whole, then the first slot of page 3.
    assert scratch.prefix_slots.tolist() == [36, 37, 38, 39, 12]
    slots = torch.tensor([0, 36, 39, 12, 45, 28])              # dummy slot, then pages 9, 9, 3, 11, 7
    mapped = scratch.map_slots(slots)
    assert mapped.tolist() == [0, 16, 19, 4, 21, 12]
    assert scratch.map_slots(slots) is mapped                  # the forward's tensors map once per batch
    assert scratch.unmap_slots(mapped).equal(slots)
    page_rows = torch.tensor([[9, 3, 0], [5, 11, 7]])          # a page table padded with the dummy page
    assert scratch.map_pages(page_rows).tolist() == [[4, 1, 0], [2, 5, 3]]
    # The next batch starts afresh: old pages map to the dummy page, no stale cache entries.
    scratch.begin([np.array([3])], prefix_lens=[0])
    assert scratch.pages == 2 and scratch.prefix_slots.numel() == 0
    assert scratch.map_slots(slots).tolist() == [0, 0, 3, 4, 1, 0]


def test_scratch_grows_to_the_largest_batch_only():
    t = torch.ones(8, 3)
    assert _grown(t, 8) is t
    assert _grown(t, 9).shape == (12, 3)                       # half again, not one slot at a time
    assert _grown(t, 40).shape == (40, 3)


def test_layers_split_as_evenly_as_possible_over_cp_ranks():
    """Each CP rank's persistent layers (and the layers it sends in PD): 3, 3, 2, 2, never a rank
    without layers while there are layers enough."""
    from graphcp.kv import CachePart, LayerSplitPool
    for layers, ranks, sizes in ((10, 4, [3, 3, 2, 2]), (6, 4, [2, 2, 1, 1]), (8, 4, [2] * 4),
                                 (3, 2, [2, 1]), (61, 8, [8] * 5 + [7] * 3)):
        owned = []
        parts = {i: (CachePart("k", (1, 2)),) for i in range(layers)}
        for c in range(ranks):
            own = LayerSplitPool(parts, 4, 4, torch.float32, torch.device("cpu"), None, list(range(ranks)), c)
            owned.append(own.owned)
        assert [len(r) for r in owned] == sizes
        assert [i for r in owned for i in r] == list(range(layers))          # contiguous, in order
        assert list(own.owners.values()) == [c for c, r in enumerate(owned) for _ in r]


def test_even_split_property():
    from graphcp.distributed.shards import even_split
    rng = np.random.default_rng(0)
    for _ in range(300):
        total, parts = int(rng.integers(0, 200)), int(rng.integers(1, 17))
        bounds = [even_split(total, parts, i) for i in range(parts)]
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_pipeline_stages_are_sglangs():
    """SGLang's (vLLM's get_pp_indices) placement: the remainder on the stages before the last."""
    from graphcp.distributed.shards import pipeline_stage
    for layers, stages, sizes in ((10, 4, [2, 3, 3, 2]), (6, 4, [1, 2, 2, 1]),
                                  (22, 4, [5, 6, 6, 5]), (5, 3, [2, 2, 1]), (4, 3, [1, 2, 1]),
                                  (3, 2, [2, 1]), (61, 4, [15, 15, 16, 15]), (2, 2, [1, 1]),
                                  (32, 4, [8] * 4)):
        bounds = [pipeline_stage(layers, stages, s) for s in range(stages)]
        assert [e - s for s, e in bounds] == sizes
        assert bounds[0][0] == 0 and bounds[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))

"""DeepSeek V4's query-row chunks are sized for the kernel that scores the indexer: the Triton
indexer writes only [rows, entries] scores, so it takes CHUNK_ELEMENTS // entries rows a call where
the torch form (which gathers [rows, entries, index_dim]) takes index_dim times fewer; attention
keeps its own chunks inside each step. Tiny chunks of both kinds still equal HF."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported anywhere

import pytest
from testkit.deepseek_v4_reference import A, B, V4Oracle, release_all, run_batches, v4_checkpoint

from graphcp.attention import deepseek_v4
from graphcp.attention.deepseek_v4 import CHUNK_ELEMENTS, v4_row_chunks
from graphcp.kernels import dsa_torch

# DeepSeek-V4-Flash's CSA layer at 128K tokens: window 128 + top-512 entries of head_dim 512; 32K
# entries (rate 4) scored over index_head_dim 128.
TOKENS, WINDOW, TOPK, HEAD_DIM, INDEX_DIM = 131072, 128, 512, 512, 128
ENTRIES = TOKENS // 4


def _calls(step: int, sub: int) -> int:
    """Calls of a loop over TOKENS rows in steps of ``step``, each cut into ``sub``-row calls."""
    per_step = -(-step // sub)
    return (TOKENS // step) * per_step


def test_chunks_follow_the_scoring_kernel():
    triton_dsa = pytest.importorskip("graphcp.kernels.triton_dsa")
    keys = WINDOW + TOPK
    attend = CHUNK_ELEMENTS // (keys * HEAD_DIM)
    step, score, attend_rows = v4_row_chunks(triton_dsa.row_chunk, keys, HEAD_DIM,
                                             (ENTRIES, INDEX_DIM))
    assert (score, attend_rows) == (512, attend) and step == 512
    assert score * ENTRIES <= CHUNK_ELEMENTS                  # the [rows, entries] fp32 scores
    assert _calls(step, score) == 256                         # was 32K calls a layer
    step, score, _ = v4_row_chunks(dsa_torch.row_chunk, keys, HEAD_DIM, (ENTRIES, INDEX_DIM))
    assert score == 4 and step == attend                      # the torch form's own bound
    assert score * ENTRIES * INDEX_DIM <= CHUNK_ELEMENTS
    # a layer without an indexer (HCA, sliding) steps by attention alone
    assert v4_row_chunks(triton_dsa.row_chunk, keys, HEAD_DIM, None) == (attend,) * 3


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_tiny_chunks_match_hf(engines, ckpt_dir, kernel, monkeypatch):
    """Both loops cut: the indexer a few rows a call (fewer than attention's with the torch form,
    more with Triton's), attention 7 rows a call."""
    pytest.importorskip("triton")
    from graphcp.kernels import triton_dsa
    v4 = v4_checkpoint(ckpt_dir)
    scorer = triton_dsa if kernel == "triton" else dsa_torch
    calls, score = [], scorer.indexer_scores
    monkeypatch.setattr(scorer, "indexer_scores", lambda *a: calls.append(a[0].shape[0])
                        or score(*a))
    monkeypatch.setattr(dsa_torch, "CHUNK_ELEMENTS", 50 * 16 * 3 if kernel == "torch" else 50 * 24)
    monkeypatch.setattr(deepseek_v4, "CHUNK_ELEMENTS", (16 + 6) * 32 * 7)
    engine = engines.get(v4, attention_kernel=kernel)
    worst, _ = run_batches(engine, V4Oracle(), v4, [[("a", A[:90]), ("b", B)], [("a", A[90:])]])
    print(f"{kernel} indexer, tiny chunks: worst rel err {worst:.2e}")    # run_batches checks
    # more indexer calls than forwards; the torch form's calls smaller than attention's 7 rows,
    # the Triton kernel's larger (each step cut into several attention calls)
    assert len(calls) > 4
    assert max(calls) < 7 if kernel == "torch" else max(calls) > 7
    release_all(engine, ["a", "b"])

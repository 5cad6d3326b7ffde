"""PD transfer of DSA caches: a GLM-5-like model (a "shared" layer without its own indexer cache) at
interleave CP 2 in prefill mode with LayerSplit sends per layer the MLA rows and, on indexed layers, the
indexer keys over Mooncake (tcp on 127.0.0.1); the receiver's copy equals HF's cache and the engine's own,
also after a second chunk, and a destination laid out for another model is refused naming the key. One
engine serves every test here (DSA engines are slow to start on 2 cores); LayerSplit pools send through the
same pool interface as the unsplit DSA pool (``transfer_parts`` / ``registered``)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")        # as graphcp sets it before its own import of mooncake
pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine is not importable: pip install "
                    "'graphcp[pd]' and apt-get install libibverbs1 librdmacm1 libnuma1 (README, PD section)")

from testkit.dsa_checkpoint import INTERLEAVE, VOCAB, DSAOracle, make_dsa_checkpoint
from testkit.hf_reference import rel_err
from testkit.parity import TOL, random_ids

from graphcp import Request, RequestError
from graphcp.checkpoint.config import read_model_config
from graphcp.pd import KVReceiver
from graphcp.pd.layout import layout_for

# LayerSplit at CP 2: rank 0 owns layers 0-1, rank 1 layers 2-3. Layer 2 reuses layer 1's top-k ("shared"):
# on each rank one of the two lives in the scratch numbering, so the reuse crosses numberings.
SPLIT_INDEXED = (True, True, False, True)
ROW, INDEX = 32 + 16, 32              # kv_lora_rank + qk_rope_head_dim, index_head_dim


def _dsa_bytes(tokens: int, indexed: tuple[bool, ...] = SPLIT_INDEXED) -> int:
    return tokens * (len(indexed) * ROW + sum(indexed) * INDEX) * 4          # fp32


def _transfer_and_check(engine, rx, oracle, path: str, rid: str, history: list[int],
                        indexed: tuple[bool, ...] = SPLIT_INDEXED) -> float:
    """Send ``rid`` (its destination through JSON, as a decode worker would pass it); the received cache
    equals HF's for the whole history and the engine's own bitwise. Returns the worst rel err."""
    report = engine.transfer_kv(rid, json.loads(json.dumps(rx.destination(rid))))
    assert report["bytes"] == _dsa_bytes(len(history), indexed) and report["ranks"] == 2   # each CP rank its layers
    got, ours = rx.kv(rid), engine.kv_cache(rid)
    _, ref = oracle(path, history)
    assert len(got) == len(ref) == len(ours) == len(indexed)
    worst = 0.0
    for layer, (mine, theirs, pool) in enumerate(zip(got, ref, ours)):
        assert (mine[2] is not None) == (theirs[2] is not None) == indexed[layer], f"{rid} layer {layer}"
        assert mine[0].shape == (len(history), 32) and mine[1].shape == (len(history), 16)
        for a, b, c in zip(mine, theirs, pool):
            if b is None:
                continue
            assert a.shape == b.shape and a.equal(c), f"{rid} layer {layer}: received cache differs from the pool"
            worst = max(worst, rel_err(a, b))
    assert worst <= TOL, f"{rid}: received DSA cache rel err {worst:.2e} against HF"
    return worst


@pytest.fixture(scope="module")
def glm5_split(ckpt_dir):
    path = str(ckpt_dir / "glm5-4layers")
    if not os.path.isdir(path):
        make_dsa_checkpoint(path, "GlmMoeDsa", seed=23, n_group=1, topk_group=1, num_hidden_layers=4,
                            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                            indexer_types=["full", "full", "shared", "full"])
    return path


@pytest.fixture(scope="module")
def split_engine(glm5_split, engines):
    return engines.get(glm5_split, tp_size=2, attn_cp_size=2, **INTERLEAVE, disaggregation_mode="prefill",
                       enable_dsa_cache_layer_split=True, disaggregation_transfer_timeout_s=2.0)


@pytest.fixture(scope="module")
def receiver(glm5_split):
    with KVReceiver(glm5_split, max_tokens=128, max_requests=3) as rx:
        yield rx


def test_dsa_layer_split_matches_hf_and_holds_its_layers(glm5_split, split_engine, receiver):
    """--enable-dsa-cache-layer-split: logits and the transferred caches equal HF, also for a request extended
    by a second chunk (its prefix of the other rank's layers comes by broadcast); each rank holds its own
    layers' MLA rows and indexer keys in full plus a scratch layer of the largest batch."""
    engine = split_engine
    oracle = DSAOracle()
    history: dict[str, list[int]] = {}
    worst = 0.0
    for batch in ([("a", random_ids(37, VOCAB, 5)), ("b", random_ids(24, VOCAB, 6))],
                  [("a", random_ids(21, VOCAB, 7)), ("c", random_ids(30, VOCAB, 8))]):     # a: cached prefix
        out = engine.prefill([Request(rid, ids) for rid, ids in batch])
        assert out.cp_applied
        for i, (rid, ids) in enumerate(batch):
            history[rid] = history.get(rid, []) + ids
            worst = max(worst, rel_err(out.logits[i], oracle(glm5_split, history[rid])[0]))
    assert worst <= TOL, f"logits rel err {worst:.2e} against HF"
    assert receiver.destination("a")["kind"] == "dsa" and receiver.destination("a")["kv_lora_rank"] == 32
    for rid, ids in history.items():
        worst = max(worst, _transfer_and_check(engine, receiver, oracle, glm5_split, rid, ids))
    print(f"worst rel err {worst:.2e}")
    stats = engine.stats()
    slots = stats["kv_tokens_total"] + 16                                      # + the dummy page
    unsplit = slots * _dsa_bytes(1, SPLIT_INDEXED)
    owned = [slots * _dsa_bytes(1, SPLIT_INDEXED[:2]), slots * _dsa_bytes(1, SPLIT_INDEXED[2:])]
    assert sum(owned) == unsplit                                               # every layer on one rank
    # Scratch: one MLA row and one indexer key per slot of the largest batch (a: 4 pages, c: 2, the dummy),
    # at most half again after growth.
    scratch = [held - mine for held, mine in zip(stats["kv_bytes_per_rank"], owned, strict=True)]
    assert all(0 < s <= 3 * 7 * 16 // 2 * (ROW + INDEX) * 4 for s in scratch), scratch
    ratios = [held / unsplit for held in stats["kv_bytes_per_rank"]]
    print(f"KV bytes per rank / unsplit: {ratios}")
    assert max(ratios) < 0.57 and sum(ratios) < 1.02                          # about 1/C each
    for rid in history:
        engine.release(rid)
        receiver.free(rid)
    assert engine.stats()["kv_tokens_free"] == engine.stats()["kv_tokens_total"]


def test_dsa_transfer_refuses_another_layout(split_engine, receiver, checkpoint):
    """A dense model's layout, or a DSA one whose kind or parts differ, names the differing key; nothing is
    written and the request stays cached."""
    split_engine.prefill([Request("m", random_ids(20, VOCAB, 4))])
    destination = receiver.destination("m")
    dense = asdict(layout_for(read_model_config(checkpoint), 64, "float32"))     # as a dense receiver's
    with pytest.raises(RequestError, match=r"'m': destination\['num_layers'\]"):
        split_engine.transfer_kv("m", {**destination, **dense, "parts": [list(p) for p in dense["parts"]]})
    with pytest.raises(RequestError, match=r"destination\['kind'\]"):
        split_engine.transfer_kv("m", {**destination, "kind": "mha"})
    with pytest.raises(RequestError, match=r"destination\['parts'\]"):
        split_engine.transfer_kv("m", {**destination, "parts": [[ROW, INDEX]] * 4})     # every layer indexed
    assert split_engine.kv_cache("m")[0][0].shape == (20, 32)
    receiver.free("m")
    split_engine.release("m")

"""Hybrid linear-attention models served by the engine, against HF transformers (fp32, CPU).

``Engine(EngineArgs(model_path=<Qwen3-Next or Qwen3.5>))`` at CP 1 (graph and eager), CP 2 zigzag
(graph and eager) and CP 4 (eager): a fresh batch, then a batch continuing one request (chunked
prefill) beside a fresh one, then 3 more tokens of that one (a batch CP runs unsharded). Logits at
each request's last token, then every layer of ``engine.kv_cache`` (full-attention K/V,
linear-attention conv window and delta state) equal to HF; ``release`` frees the state slots and
``stats`` counts them. At CP 1: a batch that fails mid-forward leaves the committed state, the pages
and the slots as they were, and a batch that needs more state slots than are free is a RequestError
naming the request.
"""
from __future__ import annotations

import pytest
import torch
from testkit.engines import cp_kwargs
from testkit.hybrid_reference import HybridHF, make_hybrid_checkpoint, rel_err

from graphcp import Request, RequestError
from graphcp.checkpoint.config import read_model_config
from graphcp.memory import memory_report

TOL = 1e-4
LENGTHS = {"a": 190, "b": 57, "c": 63}
# "a" is chunked 120 + 70 beside a fresh "c"; "c" then gets 3 tokens, too few for CP to split. The
# first two batches fill one graph bucket (256 tokens at CP 1, 128 per rank at CP 2) over half.
BATCHES = ([("a", 0, 120), ("b", 0, 57)], [("a", 120, 190), ("c", 0, 60)], [("c", 60, 63)])
SMALL = dict(max_batch_requests=2, max_state_requests=2)    # 2 + 2 spare state slots
# layout -> (engine flags, CP size, attention TP size, graphs)
LAYOUTS = {"cp1": (dict(SMALL, cuda_graph_buckets=[256]), 1, 1, True),
           "cp2": (cp_kwargs(2, **SMALL, cuda_graph_buckets=[128]), 2, 1, True),
           "cp4": (cp_kwargs(4, **SMALL, disable_cuda_graph=True), 4, 1, False),
           "tp2": (dict(SMALL, tp_size=2, cuda_graph_buckets=[256]), 1, 2, True),
           # a 4-rank world: attention TP 2 inside each rank of a zigzag CP group of 2
           "tp4cp2": (dict(cp_kwargs(2, **SMALL, cuda_graph_buckets=[128]), tp_size=4), 2, 2,
                      True)}
ENGINES = {layout: flags for layout, (flags, *_) in LAYOUTS.items()}
CASES = [("qwen3_5", "cp1"), ("qwen3_next", "cp1"), ("qwen3_next", "cp2"), ("qwen3_5", "cp4"),
         ("qwen3_5", "tp2"), ("qwen3_next", "tp4cp2")]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TOKENS = {rid: _tokens(n, i) for i, (rid, n) in enumerate(LENGTHS.items())}


class _Reference:
    """HF's logits and caches per (checkpoint, tokens), computed once."""

    def __init__(self) -> None:
        self.models: dict[str, HybridHF] = {}
        self.runs: dict[tuple, tuple] = {}

    def __call__(self, path: str, ids: list[int]) -> tuple:
        key = (path, tuple(ids))
        if key not in self.runs:
            self.runs[key] = self.models.setdefault(path, HybridHF(path)).run(ids)
        return self.runs[key]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_engine")
    paths = {arch: make_hybrid_checkpoint(str(root / arch), arch, seed=seed)
             for arch, seed in (("qwen3_next", 2), ("qwen3_5", 1))}
    return paths, _Reference()


def _check_caches(engine, rid: str, ref: tuple, label: str) -> float:
    caches, worst = engine.kv_cache(rid), 0.0
    assert len(caches) == len(ref[1])
    for layer, (mine, theirs) in enumerate(zip(caches, ref[1])):
        for part, (m, t) in enumerate(zip(mine, theirs)):
            assert m.shape == t.shape, (label, layer, part, m.shape, t.shape)
            err = rel_err(m, t)
            assert err <= TOL, f"{label}: layer {layer} part {part} rel err {err:.2e}"
            worst = max(worst, err)
    return worst


def _chunked_batches_equal_hf(engine, path: str, reference,
                              force_eager: bool) -> tuple[float, list]:
    """Serve BATCHES (chunked prefill); every logit row and every held request's caches equal HF.
    Returns the worst relative error and each batch's (mode, cp_applied)."""
    worst, modes = 0.0, []
    for batch in BATCHES:
        out = engine.prefill([Request(r, TOKENS[r][s:e]) for r, s, e in batch],
                             force_eager=force_eager)
        modes.append((out.mode, out.cp_applied))
        for row, (rid, _, end) in enumerate(batch):
            err = rel_err(out.logits[row], reference(path, TOKENS[rid])[0][end - 1])
            assert err <= TOL, f"{rid} at {end}: logits rel err {err:.2e} ({out.mode})"
            worst = max(worst, err)
    for rid in LENGTHS:
        worst = max(worst, _check_caches(engine, rid, reference(path, TOKENS[rid]), rid))
    return worst, modes


def _state_bytes_per_layer(path: str, attn_tp: int) -> int:
    """fp32 conv window and delta state of one linear layer, a rank's share of the heads."""
    h = read_model_config(path).family_config
    return 4 * ((h.conv_kernel - 1) * h.conv_dim + h.num_v_heads * h.head_k_dim * h.head_v_dim
                ) // attn_tp


def _serve(engine, path: str, reference, force_eager: bool, attn_tp: int) -> tuple[float, list]:
    free = engine.stats()["state_slots_free"]
    worst, modes = _chunked_batches_equal_hf(engine, path, reference, force_eager)
    stats = engine.stats()
    assert stats["state_slots_free"] == free - len(LENGTHS)
    h = read_model_config(path).family_config
    per_layer = _state_bytes_per_layer(path, attn_tp)
    assert stats["state_bytes_per_request"] == len(h.linear_layers) * per_layer
    assert stats["state_slots_total"] == 4           # --max-state-requests 2 + 2 spare
    assert stats["state_bytes"] == (4 + 1) * stats["state_bytes_per_request"]   # + the dummy slot
    assert stats["state_bytes_per_rank"] == [stats["state_bytes"]] * len(stats["kv_bytes_per_rank"])
    for rid in LENGTHS:
        engine.release(rid)
    assert engine.stats()["state_slots_free"] == free
    return worst, modes


@pytest.mark.parametrize("arch, layout", CASES, ids=[f"{a}-{layout}" for a, layout in CASES])
def test_hybrid_engine_equals_hf(hybrid, engines, arch, layout):
    """Under attention TP (tp2, tp4cp2) each rank holds its heads' states: the per-rank bytes
    ``stats`` and ``graphcp memory`` report, and ``kv_cache`` joins the heads back to HF's."""
    paths, reference = hybrid
    flags, cp, attn_tp, graphs = LAYOUTS[layout]
    engine = engines.get(paths[arch], **flags)
    for force_eager in ((False, True) if graphs else (True,)):
        worst, modes = _serve(engine, paths[arch], reference, force_eager, attn_tp)
        print(f"{arch} {layout} {'eager' if force_eager else 'graph'}: modes {modes}, "
              f"worst rel err {worst:.1e}")
        assert [mode for mode, _ in modes[:2]] == ["eager" if force_eager else "graph"] * 2
        assert [applied for _, applied in modes] == [cp > 1, cp > 1, False]
    if attn_tp > 1:
        _memory_plan_counts_rank_heads(engine, paths[arch], attn_tp)


def _memory_plan_counts_rank_heads(engine, path: str, attn_tp: int) -> None:
    """``graphcp memory`` (planned from config.json) gives every rank the state and weight bytes
    the running engine holds: 4 state slots of its heads' layers, its head and FFN slices."""
    stats = engine.stats()
    plan = memory_report(engine.args, "cpu")
    h = read_model_config(path).family_config
    slots = stats["state_slots_total"]
    assert [r.state_bytes for r in plan.ranks] == \
        [slots * len(h.linear_layers) * _state_bytes_per_layer(path, attn_tp)] * len(plan.ranks)
    assert [r.weight_bytes for r in plan.ranks] == stats["weight_bytes_per_rank"]


def test_failed_batch_leaves_state_pages_and_slots(hybrid, engines, monkeypatch):
    paths, reference = hybrid
    path = paths["qwen3_5"]
    engine = engines.get(path, **ENGINES["cp1"])
    ids = TOKENS["a"]
    engine.prefill([Request("f", ids[:40])])
    before, stats = engine.kv_cache("f"), engine.stats()
    last = engine._runner.model.model.layers["3"]      # after linear layers 0 and 2 have run

    def fault(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(last.mlp, "forward", fault)
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefill([Request("f", ids[40:100]), Request("g", ids[:30])], force_eager=True)
    monkeypatch.undo()
    after = engine.kv_cache("f")
    assert all(m.equal(t) for mine, theirs in zip(after, before) for m, t in zip(mine, theirs))
    now = engine.stats()
    for key in ("state_slots_free", "kv_tokens_free"):
        assert now[key] == stats[key], key
    with pytest.raises(RequestError, match="'g'"):
        engine.kv_cache("g")
    out = engine.prefill([Request("f", ids[40:100])])
    assert rel_err(out.logits[0], reference(path, ids[:100])[0][-1]) <= TOL
    engine.release("f")


def test_too_many_requests_is_a_request_error(hybrid, engines):
    engine = engines.get(hybrid[0]["qwen3_5"], **ENGINES["cp1"])
    total = engine.stats()["state_slots_total"]
    held = [f"h{i}" for i in range(total - 1)]          # one slot left: a batch of 2 needs 2
    for rid in held:
        engine.prefill([Request(rid, TOKENS["b"][:20])])
    stats = engine.stats()
    with pytest.raises(RequestError, match="'y'.*state slot"):
        engine.prefill([Request("x", TOKENS["b"][:20]), Request("y", TOKENS["c"])])
    now = engine.stats()
    assert (now["state_slots_free"], now["kv_tokens_free"]) == (1, stats["kv_tokens_free"])
    engine.prefill([Request("x", TOKENS["b"][:20])])      # one request fits the spare slot
    for rid in held + ["x"]:
        engine.release(rid)
    assert engine.stats()["state_slots_free"] == total


def test_pipeline_stages_and_expert_parallel_equal_hf(hybrid, engines):
    """Qwen3-Next over PP 2 x CP 2 zigzag, its MoE layers over EP 2 (all-to-all): each stage holds
    the states of its own linear layers only (layer 0 on stage 0, layers 2 and 3 on stage 1), and
    logits and every layer's caches equal HF, chunked."""
    paths, reference = hybrid
    path = paths["qwen3_next"]
    engine = engines.get(path, **cp_kwargs(2, pp_size=2, ep_size=2, moe_a2a_backend="all_to_all",
                                           **SMALL))
    worst, _ = _chunked_batches_equal_hf(engine, path, reference, force_eager=False)
    per_layer = _state_bytes_per_layer(path, 1)
    slots = 4 + 1                                     # 2 + 2 spare, and the dummy slot
    # ranks: stage 0 (CP ranks 0, 1) then stage 1 (CP ranks 2, 3)
    assert engine.stats()["state_bytes_per_rank"] == [slots * per_layer] * 2 + \
        [slots * 2 * per_layer] * 2
    for rid in LENGTHS:
        engine.release(rid)
    print(f"qwen3_next PP 2 x CP 2, EP 2: worst rel err {worst:.1e}")


def test_attention_tp_beyond_kv_heads_replicates_them(hybrid, engines, tmp_path_factory):
    """Qwen3.5 at --tp 4 over 2 KV heads (and 4 linear key heads): each full-attention KV head on
    two ranks, each rank its own linear heads; in graphs and chunked, equal to HF; kv_cache holds
    each KV head once and every linear head."""
    _, reference = hybrid
    path = make_hybrid_checkpoint(str(tmp_path_factory.mktemp("hybrid_rep") / "qwen3_5"),
                                  "qwen3_5", seed=3, linear_num_key_heads=4)
    engine = engines.get(path, **dict(SMALL, tp_size=4, cuda_graph_buckets=[256]))
    worst, modes = _serve(engine, path, reference, False, 4)
    assert [mode for mode, _ in modes[:2]] == ["graph"] * 2 and worst <= TOL

"""DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``: dense MLA, no indexer) equal HF
transformers on tiny checkpoints written as released (``tests/testkit/mla_checkpoint.py``: released
config.json shrunk, YaRN, sharded, FP8, MTP layer): last-token logits and the latent / RoPE caches
at one rank, zigzag CP 2 (graphs) and interleave CP 4, attention TP 2 (graphs), in chunked
prefill; graph equal to eager; the two attention forms equal each other."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import rel_err
from testkit.mla_checkpoint import DEEPSEEK_V3, KIMI_K2, MLAOracle, write_release
from testkit.parity import TOL, graph_and_eager, random_ids

from graphcp import ConfigError, EngineArgs, Request
from graphcp.models.deepseek.config import check_mla_flags

VOCAB = 211
FIRST = [("a", random_ids(30, VOCAB, 1)), ("b", random_ids(19, VOCAB, 2))]
SECOND = [("a", random_ids(13, VOCAB, 3)), ("c", random_ids(25, VOCAB, 4))]   # a: cached prefix
THIRD = [("a", random_ids(5, VOCAB, 5))]          # a short chunk over a long prefix: absorbed form
ONE_RANK = dict(cuda_graph_buckets=[64])          # both batches' 49 and 38 tokens; CP 2: 24 and 20
ZIGZAG = dict(enable_prefill_cp=True, cp_strategy="zigzag")


@pytest.fixture(scope="module")
def v3(ckpt_dir):
    """DeepSeek-V3 as released (FP8, YaRN factor 40, 8 groups / 4 kept, top-8, MTP layer), 2
    layers, the first dense."""
    return write_release(str(ckpt_dir / "deepseek-v3"), DEEPSEEK_V3, seed=31, num_hidden_layers=2,
                         first_k_dense_replace=1, n_routed_experts=24)


@pytest.fixture(scope="module")
def kimi(ckpt_dir):
    """Kimi-K2 as released (model_type kimi_k2, FP8, YaRN factor 32 with beta 1/1, one group)."""
    return write_release(str(ckpt_dir / "kimi-k2"), KIMI_K2, seed=32, num_hidden_layers=2,
                         n_routed_experts=16)


@pytest.fixture(scope="module")
def mla_oracle():
    return MLAOracle()


def _check(engine, oracle, twin: str, batches) -> list:
    """Run ``batches`` (rids extend their history) against HF on each whole history; the cache as
    (kv_latent, k_rope, None) per layer. Releases every rid."""
    history, worst, outs = {}, 0.0, []
    for batch in batches:
        out = engine.prefill([Request(rid, ids) for rid, ids in batch])
        outs.append(out)
        for i, (rid, ids) in enumerate(batch):
            history[rid] = history.get(rid, []) + ids
            logits, ref = oracle(twin, history[rid])
            errs = [rel_err(out.logits[i], logits)]
            ours = engine.kv_cache(rid)
            assert len(ours) == len(ref)
            for layer, ((latent, k_rope, index), (want, want_rope)) in enumerate(zip(ours, ref)):
                assert index is None and latent.shape == want.shape, f"{rid} layer {layer}"
                errs += [rel_err(latent, want), rel_err(k_rope, want_rope)]
            assert max(errs) <= TOL, f"{rid}: rel err {max(errs):.2e} ({out.mode})"
            worst = max(worst, *errs)
    for rid in history:
        engine.release(rid)
    print(f"worst rel err {worst:.2e}")
    return outs


def _graph_equals_eager(engine) -> None:
    batch = [Request("g", random_ids(29, VOCAB, 9)), Request("h", random_ids(14, VOCAB, 10))]
    graph, eager = graph_and_eager(engine, batch)
    assert graph.mode == "graph" and eager.mode == "eager", graph.eager_reason
    assert rel_err(graph.logits, eager.logits) <= 1e-6


def test_deepseek_v3_fp8_one_rank_in_graphs(engines, mla_oracle, v3):
    """FP8 loads dequantized (equal to HF on the twin); the MTP layer is skipped as HF skips it."""
    ckpt, twin = v3
    engine = engines.get(ckpt, **ONE_RANK)
    outs = _check(engine, mla_oracle, twin, [FIRST, SECOND, THIRD])
    assert [o.mode for o in outs] == ["graph", "graph", "eager"], outs[0].eager_reason
    _graph_equals_eager(engine)
    assert rel_err(mla_oracle(ckpt.replace("release", "hf-save"), FIRST[0][1])[0],
                   mla_oracle(twin, FIRST[0][1])[0]) > 1e-4     # FP8 rounding did change the model


def test_kimi_k2_cp2_zigzag_in_graphs(engines, mla_oracle, kimi):
    """Zigzag CP 2 in the breakable graph: one all-gather of MLA rows per layer, the attention a
    break taking the batch's host maxima."""
    ckpt, twin = kimi
    engine = engines.get(ckpt, tp_size=2, attn_cp_size=2, **ZIGZAG, cuda_graph_buckets=[32])
    before = engine.collective_counts()["all_gathers"]
    outs = _check(engine, mla_oracle, twin, [FIRST, SECOND, THIRD])
    assert [o.mode for o in outs[:2]] == ["graph", "graph"] and outs[0].cp_applied
    assert engine.collective_counts()["all_gathers"] - before == 2 * 3       # 2 layers, 3 batches
    _graph_equals_eager(engine)


def test_deepseek_v3_cp4_interleave(engines, mla_oracle, v3):
    ckpt, twin = v3
    engine = engines.get(ckpt, tp_size=4, attn_cp_size=4, enable_prefill_cp=True,
                         cp_strategy="interleave", disable_cuda_graph=True)
    outs = _check(engine, mla_oracle, twin, [FIRST, SECOND])
    assert outs[0].cp_applied and outs[0].per_rank_tokens == [13, 12, 12, 12]


def test_deepseek_v3_attention_tp2_in_graphs(engines, mla_oracle, v3):
    """--tp 2 without CP: heads split over the two ranks, the MLA rows the same on both."""
    ckpt, twin = v3
    engine = engines.get(ckpt, tp_size=2, **ONE_RANK)
    outs = _check(engine, mla_oracle, twin, [FIRST, SECOND])
    assert [o.mode for o in outs] == ["graph", "graph"], outs[0].eager_reason
    one = engines.get(ckpt, **ONE_RANK).stats()["weight_bytes"]
    assert max(engine.stats()["weight_bytes_per_rank"]) < 0.6 * one


def test_no_query_lora_half_split_rope_matches_hf(engines, mla_oracle, ckpt_dir):
    """HF's DeepSeek-V3 also reads q_lora_rank null (one q_proj) and rope_interleave false."""
    ckpt, twin = write_release(str(ckpt_dir / "mla-no-q-lora"), DEEPSEEK_V3, seed=33, fp8=False,
                               num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16,
                               q_lora_rank=None, rope_interleave=False, num_nextn_predict_layers=0)
    _check(engines.get(ckpt, **ONE_RANK), mla_oracle, twin, [FIRST[:1]])


def test_absorbed_and_expanded_forms_agree():
    """The kernel's two forms on scattered pages, a cached prefix and a padding row, against a
    plain per-head attention; the cost rule picks expanded for a fresh prompt, absorbed for a
    short chunk over a long prefix."""
    from graphcp.kernels.mla_torch import MLAArgs, MLADims, expanded_is_cheaper, mla_attention
    gen = torch.Generator().manual_seed(0)
    d, heads, page = MLADims(latent=32, rope=16, nope=16, value=24), 4, 4
    q_lens, kv_lens = [5, 3], [9, 3]                       # sequence 0 has a 4-token prefix
    pool = torch.randn(64, d.latent + d.rope, generator=gen)
    kv_b = torch.randn(heads * (d.nope + d.value), d.latent, generator=gen) * 0.1
    page_rows = torch.tensor([[7, 2, 12], [5, 0, 0]])
    q = torch.randn(sum(q_lens) + 1, heads, d.nope + d.rope, generator=gen)   # + a padding row
    limits = torch.tensor([5, 6, 7, 8, 9, 1, 2, 3, 0])
    cu = torch.tensor([0, 5, 8])
    outs = {}
    for form in ("expanded", "absorbed", None):
        args = MLAArgs(q, pool, kv_b, cu, page_rows, limits, torch.full((9, heads, d.value), 7.0),
                       page, 0.3, d)
        outs[form] = mla_attention(args, form=form)
    want = torch.zeros(9, heads, d.value)
    w = kv_b.view(heads, d.nope + d.value, d.latent)
    for s, (start, n) in enumerate(zip(cu.tolist(), q_lens)):
        slots = torch.tensor([page_rows[s, p // page] * page + p % page for p in range(kv_lens[s])])
        rows = pool[slots]
        k_nope = torch.einsum("kc,hnc->hkn", rows[:, :d.latent], w[:, :d.nope])
        keys = torch.cat([k_nope, rows[None, :, d.latent:].expand(heads, -1, -1)], dim=-1)
        values = torch.einsum("kc,hvc->hkv", rows[:, :d.latent], w[:, d.nope:])
        for i in range(start, start + n):
            scores = torch.einsum("hd,hkd->hk", q[i], keys[:, :limits[i]]) * 0.3
            want[i] = torch.einsum("hk,hkv->hv", scores.softmax(-1), values[:, :limits[i]])
    for form, got in outs.items():
        assert rel_err(got, want) <= 1e-5, form
    assert got[8].abs().max() == 0                                     # the padding row
    assert expanded_is_cheaper(1, 30, 30, heads, d) and not expanded_is_cheaper(1, 5, 35, heads, d)
    real = MLADims(latent=512, rope=64, nope=128, value=128)            # DeepSeek-V3's
    assert expanded_is_cheaper(1, 4096, 4096, 16, real)
    assert not expanded_is_cheaper(1, 64, 8192, 16, real)


@pytest.mark.parametrize("flags,named", [
    (dict(attention_kernel="triton"), "--attention-kernel"), (dict(tp_size=2, dp_size=2), "--dp"),
    (dict(tp_size=2, pp_size=2), "--pp"),
    (dict(tp_size=2, disaggregation_mode="prefill"), "--disaggregation-mode")])
def test_mla_flags(v3, flags, named):
    with pytest.raises(ConfigError, match=named):
        check_mla_flags(EngineArgs(model_path=v3[0], **flags))
    check_mla_flags(EngineArgs(model_path=v3[0], tp_size=4, attn_cp_size=2, **ZIGZAG))

"""The Triton gated delta rule (used on CUDA) against its torch form, in Triton's interpreter on CPU:
the chunked rule on consecutive sequences of odd lengths (an empty one, one on the chunk grid,
padding rows after), with zero and random initial states; the CP hand-off's affine form and state
correction; the start-up probe; a hybrid model whose linear layers run the Triton rule, against HF
transformers; and the zigzag CP op on the Triton forms against the same op on the torch forms."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from testkit.hybrid_reference import (
    ByKind,
    HybridHF,
    LocalFullAttention,
    StateSlots,
    make_hybrid_checkpoint,
    rel_err,
)

from graphcp.attention.linear_op import LocalLinearAttention
from graphcp.checkpoint.loader import load_model
from graphcp.forward_context import forward_context
from graphcp.kernels import delta_rule_torch as torch_form
from graphcp.kernels.registry import KernelChoices
from graphcp.kernels.resolve import probe_delta_rule
from graphcp.kernels.triton_delta_rule import triton_delta_rule, triton_state_outputs

TOL = 1e-4
LENS, PAD = [77, 0, 13, 64, 1], 5       # off the chunk grid, empty, on it, one step


def _inputs(dk: int, dv: int, heads: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(LENS) + PAD
    q, k = (torch_form.l2norm(torch.randn(rows, heads, dk, generator=gen)) for _ in range(2))
    v = torch.randn(rows, heads, dv, generator=gen)
    g = -0.3 * torch.rand(rows, heads, generator=gen)
    beta = torch.rand(rows, heads, generator=gen)
    state = torch.randn(len(LENS), heads, dk, dv, generator=gen)
    # one chunk more than needed: an unused chunk, as a graph's static bound leaves
    layout = torch_form.ChunkLayout(torch.tensor(LENS), rows, 2 + 0 + 1 + 1 + 1 + 1)
    return q, k, v, g, beta, state, layout


@pytest.mark.parametrize("dk,dv,initial", [(16, 32, "zero"), (16, 32, "random"),
                                            (32, 16, "zero"), (32, 16, "random"),
                                            (128, 128, "random")])     # the released dims
def test_rule_equals_torch_form(dk, dv, initial):
    q, k, v, g, beta, state, layout = _inputs(dk, dv)
    if initial == "zero":
        state = torch.zeros_like(state)
    o, final = triton_delta_rule(q, k, v, g, beta, state, layout)
    o_ref, final_ref = torch_form.gated_delta_rule(q, k, v, g, beta, state, layout)
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) <= TOL and rel_err(final, final_ref) <= TOL
    assert not o[sum(LENS):].any()                        # padding rows
    assert torch.equal(final[1], state[1])                # the empty sequence keeps its state


def test_strided_inputs_and_value_dtype():
    """Column slices of one buffer (as the conv output gives q, k, v) and a bf16 v and beta: the
    kernel reads the strides and converts as the torch form does."""
    q, k, v, g, beta, state, layout = _inputs(16, 16, seed=1)
    packed = torch.cat([q, k], -1)
    q_, k_ = packed[..., :16], packed[..., 16:]
    v_ = torch.cat([v, v], -1).bfloat16()[..., 16:]
    assert q_.stride(1) == k_.stride(1) == v_.stride(1) == 32
    o, final = triton_delta_rule(q_, k_, v_, g, beta.bfloat16(), state, layout)
    o_ref, final_ref = torch_form.gated_delta_rule(q, k, v_, g, beta.bfloat16(), state, layout)
    assert rel_err(o, o_ref) <= TOL and rel_err(final, final_ref) <= TOL


def test_affine_form_and_state_outputs():
    """block_transition through the Triton rule (value width dv + dk) and the Triton
    state_outputs give the torch forms' maps, and o_zero + q_eff S0 the rule's outputs from S0."""
    q, k, v, g, beta, state, layout = _inputs(16, 32, seed=2)
    got = torch_form.block_transition(q, k, v, g, beta, layout, triton_delta_rule)
    ref = torch_form.block_transition(q, k, v, g, beta, layout)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and rel_err(a, b) <= TOL
    o_zero, q_eff, trans, offset = got
    corrected = o_zero + triton_state_outputs(q_eff, state, layout)
    o, final = torch_form.gated_delta_rule(q, k, v, g, beta, state, layout)
    assert rel_err(corrected, o) <= TOL and rel_err(trans @ state + offset, final) <= TOL
    assert rel_err(triton_state_outputs(q_eff, state, layout),
                   torch_form.state_outputs(q_eff, state, layout)) <= TOL


def test_unsupported_dims_are_named():
    q, k, v, g, beta, state, layout = _inputs(16, 16)
    with pytest.raises(AssertionError, match="key head dims"):
        triton_delta_rule(q[..., :8], k[..., :8], v, g, beta, state[:, :, :8], layout)
    with pytest.raises(AssertionError, match="value widths"):
        triton_delta_rule(q, k, v[..., :8], g, beta, state[..., :8], layout)


def test_probe_accepts_the_kernels_and_refuses_other_dims(caplog):
    choices = KernelChoices()
    probe_delta_rule(choices, torch.device("cpu"), torch.float32, 16, 32)
    assert choices.get("delta_rule") is triton_delta_rule
    assert choices.get("delta_state_outputs") is triton_state_outputs
    refused = KernelChoices()
    probe_delta_rule(refused, torch.device("cpu"), torch.float32, 8, 16)
    assert refused.get("delta_rule") is None and refused.get("delta_state_outputs") is None
    assert "key head dims" in caplog.text


@torch.no_grad()
def test_hybrid_model_with_triton_rule_equals_hf(tmp_path):
    """Qwen3-Next (packed projections) with the Triton rule chosen for its linear layers: a fresh
    batch of two requests, then one of them continued from its pool state (chunked prefill) beside
    a fresh one; logits and the delta states left in the pool against HF's."""
    path = make_hybrid_checkpoint(str(tmp_path / "next"), "qwen3_next", seed=2)
    model = load_model(path, torch.float32, torch.device("cpu"))
    cfg = model.config
    linear_layers = cfg.family_config.linear_layers
    states, kv, hf = StateSlots(cfg, linear_layers), {}, HybridHF(path)
    choices, calls = KernelChoices(), []
    probe_delta_rule(choices, torch.device("cpu"), torch.float32, 16, 16)
    assert choices.get("delta_rule") is triton_delta_rule

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return triton_delta_rule(*args)

    choices.fns["delta_rule"] = counted         # the test's count of the layers it served
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, 211, (n,), generator=gen).tolist() for n in (80, 9, 5))
    cached: dict[str, int] = {}
    logits: dict[str, torch.Tensor] = {}
    for batch in ([("a", a[:70]), ("b", b)], [("a", a[70:]), ("c", c)]):
        rids, lens = [r for r, _ in batch], [len(ids) for _, ids in batch]
        ids = torch.tensor([t for _, toks in batch for t in toks])
        positions = torch.cat([torch.arange(cached.get(r, 0), cached.get(r, 0) + n)
                               for r, n in zip(rids, lens)])
        rows = torch.arange(sum(lens))
        linear = LocalLinearAttention(states.states(rids), torch.tensor(lens)[:, None], rows,
                                      torch.ones_like(rows))
        ops = ByKind(linear_layers, linear, LocalFullAttention(kv, rids, lens))
        with forward_context(ops), choices.active():
            out = model.compute_logits(model(ids, positions))
        for r, n, part in zip(rids, lens, out.split(lens)):
            cached[r] = cached.get(r, 0) + n
            logits[r] = torch.cat([logits[r], part]) if r in logits else part
    assert len(calls) == 2 * len(linear_layers)
    worst = {"logits": 0.0, "states": 0.0}
    for rid, ids in (("a", a), ("b", b), ("c", c)):
        ref_logits, ref_caches = hf.run(ids)
        worst["logits"] = max(worst["logits"], rel_err(logits[rid], ref_logits))
        mine = states.request_state(rid)
        for layer in linear_layers:
            worst["states"] = max(worst["states"], rel_err(mine[layer][1], ref_caches[layer][1]))
    print(f"Triton delta rule vs HF, worst rel err: {worst}")
    assert max(worst.values()) <= TOL, worst


@torch.no_grad()
def test_zigzag_op_with_triton_forms_equals_torch_forms(tmp_path):
    """The CP hand-off op (``linear_cp.py``) on a one-rank gloo group, with the Triton rule (its
    block maps) and the Triton state correction chosen, against the same op on the torch forms:
    a fresh batch (a request with an empty late block), then the same requests continued from
    their pool states."""
    import torch.distributed as dist

    from graphcp.attention.linear_cp import ZigzagLinearAttention
    from graphcp.distributed.comm import CPComm
    path = make_hybrid_checkpoint(str(tmp_path / "qwen3_5"), "qwen3_5", seed=1)
    model = load_model(path, torch.float32, torch.device("cpu"))
    mixer, h = model.model.layers["0"].linear_attn, model.config.family_config
    triton_forms, torch_forms = KernelChoices(), KernelChoices()
    probe_delta_rule(triton_forms, torch.device("cpu"), torch.float32, h.head_k_dim, h.head_v_dim)
    assert triton_forms.get("delta_state_outputs") is triton_state_outputs
    batches = [torch.tensor([[30, 40], [5, 0], [64, 13]]), torch.tensor([[9, 9], [20, 21], [1, 0]])]
    gen, cap = torch.Generator().manual_seed(4), 160
    inputs = [[torch.randn(cap, h.conv_dim, generator=gen),
               -0.3 * torch.rand(cap, h.num_v_heads, generator=gen),
               torch.rand(cap, h.num_v_heads, generator=gen)] for _ in batches]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for forms in (triton_forms, torch_forms):
            slots, outs = StateSlots(model.config, [0]), []
            for block_lens, rows in zip(batches, inputs):
                op = ZigzagLinearAttention(slots.states(["a", "b", "c"]), block_lens,
                                           CPComm(None, 1, 0), cap)
                with forms.active():
                    outs.append(op(0, *rows, mixer=mixer))
            results.append((outs, [slots.request_state(r)[0][1] for r in "abc"]))
    finally:
        dist.destroy_process_group()
    (got, got_states), (want, want_states) = results
    for a, b in zip(got + got_states, want + want_states):
        assert rel_err(a, b) <= TOL

"""Hybrid linear attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against HF transformers, one process.

graphcp's loader reads the HF checkpoint; the model runs with the single-rank linear-attention op
and its state pool, and a plain causal attention op for the full-attention layers. Checked: logits
at every position, the conv windows and delta-rule states left in the pool and the full-attention
K/V, for a batch of fresh requests and then a batch mixing a continued request (chunked prefill)
with a fresh one.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from testkit.fp8_checkpoint import make_fp8_checkpoint
from testkit.hybrid_reference import (
    ByKind,
    HybridHF,
    LocalFullAttention,
    StateSlots,
    graph_equals_eager,
    make_hybrid_checkpoint,
    rel_err,
)

from graphcp.attention.linear_op import LocalLinearAttention, RequestStates
from graphcp.checkpoint.config import check_model_flags, read_model_config
from graphcp.checkpoint.loader import load_model
from graphcp.config import EngineArgs
from graphcp.distributed.shards import TPInfo
from graphcp.errors import ConfigError
from graphcp.forward_context import forward_context
from graphcp.kernels.delta_rule_torch import (
    ChunkLayout,
    block_transition,
    causal_conv,
    gated_delta_rule,
    l2norm,
    state_outputs,
)
from graphcp.kernels.fp8_types import FP8

TOL = 1e-4


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid")


class Driver:
    """graphcp's model with the single-rank ops and the state pool, requests kept across calls."""

    def __init__(self, path: str) -> None:
        self.model = load_model(path, torch.float32, torch.device("cpu"))
        cfg = self.model.config
        self.states = StateSlots(cfg, cfg.family_config.linear_layers)
        self.kv: dict = {}
        self.cached: dict[str, int] = {}

    @torch.no_grad()
    def prefill(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        rids, lens = [r for r, _ in batch], [len(ids) for _, ids in batch]
        prefix = [self.cached.get(r, 0) for r in rids]
        ids = torch.tensor([t for _, toks in batch for t in toks])
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
        rows = torch.arange(sum(lens))
        linear_op = LocalLinearAttention(self.states.states(rids), torch.tensor(lens)[:, None],
                                         rows, torch.ones_like(rows))
        ops = ByKind(self.model.config.family_config.linear_layers, linear_op,
                     LocalFullAttention(self.kv, rids, lens))
        with forward_context(ops):
            logits = self.model.compute_logits(self.model(ids, positions))
        for r, n in zip(rids, lens):
            self.cached[r] = self.cached.get(r, 0) + n
        return list(logits.split(lens))

    def caches(self, rid: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, as HybridHF.run reports them."""
        linear = self.states.request_state(rid)
        return [linear[i] if i in linear else tuple(t.transpose(0, 1) for t in self.kv[(rid, i)])
                for i in range(self.model.config.num_hidden_layers)]


def _check(logits: torch.Tensor, caches: list, ref: tuple, worst: dict, label: str) -> None:
    ref_logits, ref_caches = ref
    errors = {"logits": rel_err(logits, ref_logits[-logits.shape[0]:])}
    for i, (mine, theirs) in enumerate(zip(caches, ref_caches)):
        errors[f"layer{i}"] = max(rel_err(mine[0], theirs[0]), rel_err(mine[1], theirs[1]))
    for key, err in errors.items():
        worst[key] = max(worst.get(key, 0.0), err)
        assert err <= TOL, f"{label}: {key} rel err {err:.2e}"


def test_hybrid_equals_hf_with_chunked_prefill(hybrid_dir):
    """Qwen3.5-MoE (every FFN MoE with a shared expert), from a sharded checkpoint; Qwen3-Next and
    Qwen3.5 are served by the engine in tests/models/test_hybrid_engine.py."""
    arch = "qwen3_5_moe"
    path = make_hybrid_checkpoint(str(hybrid_dir / arch), arch, seed=1, shard="60KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    hf, graphcp = HybridHF(path), Driver(path)
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, 211, (n,), generator=gen).tolist() for n in (190, 57, 3))
    worst: dict[str, float] = {}
    first = graphcp.prefill([("a", a[:130]), ("b", b)])
    ref_a = hf.run(a)
    assert rel_err(first[0], ref_a[0][:130]) <= TOL
    _check(first[1], graphcp.caches("b"), hf.run(b), worst, "b one-shot")
    # The second call continues "a" from its pool state and K/V, beside a fresh 3-token request
    # (shorter than the conv window).
    second = graphcp.prefill([("a", a[130:]), ("c", c)])
    _check(second[0], graphcp.caches("a"), ref_a, worst, "a chunked 130 + 60")
    _check(second[1], graphcp.caches("c"), hf.run(c), worst, "c fresh")
    print(f"{arch} worst rel err: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_fp8_block_quantized_hybrid_equals_hf(hybrid_dir):
    """An FP8 block-quantized Qwen3-Next (every projection, the DeltaNet ones included, in 16x16
    blocks; routers and shared-expert gates left unconverted, as released FP8 checkpoints list them)
    stays FP8 in memory (each weight dequantized per call) and equals HF on its exactly dequantized
    twin."""
    src = make_hybrid_checkpoint(str(hybrid_dir / "next_bf"), "qwen3_next", seed=3)
    skip = ("lm_head",) + tuple(f"model.layers.{i}.mlp.shared_expert_gate" for i in (1, 3))
    fp8_path, twin = make_fp8_checkpoint(src, str(hybrid_dir / "next_fp8"),
                                         str(hybrid_dir / "next_fp8_twin"), (16, 16), skip)
    ids = torch.randint(0, 211, (77,), generator=torch.Generator().manual_seed(5)).tolist()
    driver = Driver(fp8_path)
    assert driver.model.model.layers["0"].linear_attn.in_proj_qkvz.weight.dtype == torch.float8_e4m3fn
    logits = driver.prefill([("a", ids)])[0]
    ref = HybridHF(twin).run(ids)
    _check(logits, driver.caches("a"), ref, {}, "fp8")


def test_delta_rule_and_conv_equal_hf_functions():
    """The functions the layers and the CP hand-off share, against HF's torch fallbacks run on each
    sequence alone: the chunked rule on consecutive sequences of 150, 0 and 70 steps plus padding
    rows (initial states, lengths off the chunk grid, a chunk bound above the need), its affine
    form, and the conv with carried windows (a sequence shorter than the window included)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_update, torch_chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    lens, pad, h, dk, dv = [150, 0, 70], 5, 3, 16, 8
    rows = sum(lens) + pad
    q, k = torch.randn(rows, h, dk, generator=gen), torch.randn(rows, h, dk, generator=gen)
    v, s0 = torch.randn(rows, h, dv, generator=gen), torch.randn(3, h, dk, dv, generator=gen)
    g, beta = -0.3 * torch.rand(rows, h, generator=gen), torch.rand(rows, h, generator=gen)
    layout = ChunkLayout(torch.tensor(lens), rows, 7)              # 3 + 0 + 2 needed
    o, final = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta, s0, layout)
    o_zero, q_eff, trans, offset = block_transition(l2norm(q), l2norm(k), v, g, beta, layout)
    affine = o_zero + state_outputs(q_eff, s0, layout)
    assert not o[sum(lens):].any() and torch.equal(final[1], s0[1])
    start = 0
    for i, n in enumerate(lens):
        if not n:
            continue
        rows_i = slice(start, start + n)
        o_hf, final_hf = torch_chunk_gated_delta_rule(
            q[None, rows_i], k[None, rows_i], v[None, rows_i], g=g[None, rows_i],
            beta=beta[None, rows_i], initial_state=s0[i:i + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        assert rel_err(o[rows_i], o_hf[0]) <= 1e-5 and rel_err(final[i], final_hf[0]) <= 1e-5
        assert rel_err(affine[rows_i], o_hf[0]) <= 1e-5
        assert rel_err(trans[i] @ s0[i] + offset[i], final_hf[0]) <= 1e-5
        start += n

    channels, kernel, lens = 6, 4, [9, 2]
    weight = torch.randn(channels, kernel, generator=gen)
    x = torch.randn(sum(lens) + 1, channels, generator=gen)
    window = torch.randn(2, kernel - 1, channels, generator=gen)
    out, new_window = causal_conv(x, window, weight, torch.tensor(lens))
    for i, (first, n) in enumerate(((0, 9), (9, 2))):
        state = torch.cat([torch.zeros(channels, 1), window[i].t()], -1)[None]   # HF keeps K
        mine = x[None, first:first + n].transpose(1, 2)
        ref = causal_conv1d_update(mine, state, weight, None, "silu").transpose(1, 2)[0]
        assert rel_err(out[first:first + n], ref) <= 1e-6
        assert torch.equal(new_window[i], torch.cat([window[i], x[first:first + n]])[-3:])
    assert not out[-1].any()


def test_linear_op_graph_equals_eager(hybrid_dir):
    """The single-rank op captured once replays another batch (other lengths, slots, fresh flags)
    exactly as an eager call computes it."""
    path = str(hybrid_dir / "qwen3_5")
    if not os.path.isdir(path):
        make_hybrid_checkpoint(path, "qwen3_5", seed=1)
    model = load_model(path, torch.float32, torch.device("cpu"))
    h, mixer = model.config.family_config, model.model.layers["0"].linear_attn
    pool = StateSlots(model.config, [0]).pool
    gen, rows = torch.Generator().manual_seed(0), 96

    def fill(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        for t in buffers:
            t.copy_(torch.rand(t.shape, generator=gen))
        buffers[1].mul_(-0.3)                                # g: log decays are negative
        return buffers

    inputs = fill([torch.empty(rows, h.conv_dim), torch.empty(rows, h.num_v_heads),
                   torch.empty(rows, h.num_v_heads)])
    # A one-rank zigzag's rows: every request's early half, then every late half (padding last).
    block_lens, state_in, state_out = (torch.tensor([[20, 20], [15, 15], [0, 0]]),
                                       torch.tensor([0, 2, 0]), torch.tensor([1, 2, 0]))
    token_index, valid = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)

    def layout(halves: list[tuple[int, int]]) -> None:
        token_index.zero_()
        valid.zero_()
        starts, row = [sum(a + b for a, b in halves[:q]) for q in range(len(halves))], 0
        for half in (0, 1):
            for (early, late), start in zip(halves, starts):
                n, first = (early, start) if half == 0 else (late, start + early)
                token_index[row:row + n] = torch.arange(first, first + n)
                valid[row:row + n] = 1
                row += n

    def next_batch() -> None:
        fill(inputs)
        block_lens.copy_(torch.tensor([[25, 25], [10, 10], [5, 5]]))
        layout([(25, 25), (10, 10), (5, 5)])
        state_in.copy_(torch.tensor([2, 0, 3]))
        state_out.copy_(torch.tensor([3, 1, 2]))

    def make_op() -> LocalLinearAttention:
        return LocalLinearAttention(RequestStates(pool, state_in, state_out), block_lens,
                                    token_index, valid)

    layout([(20, 20), (15, 15), (0, 0)])
    tensors = [pool.part(0, "conv"), pool.part(0, "recurrent")]
    with torch.no_grad():
        err = graph_equals_eager(make_op, mixer, inputs, tensors, next_batch)
    assert err <= TOL, err


def _config(tmp_path, **changes) -> str:
    base = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 211, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"]}
    path = tmp_path / "cfg"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**base, **changes}))
    return str(path)


@pytest.mark.parametrize("changes, field", [
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ({"layer_types": None, "full_attention_interval": 0}, "full_attention_interval"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"rope_parameters": {"partial_rotary_factor": 0.01}}, "partial_rotary_factor"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
])
def test_hybrid_config_errors_name_the_field(tmp_path, changes, field):
    with pytest.raises(ConfigError, match=field):
        read_model_config(_config(tmp_path, **changes))


def test_hybrid_config_reads_the_layer_pattern(tmp_path):
    cfg = read_model_config(_config(tmp_path, layer_types=None, full_attention_interval=2,
                                    num_hidden_layers=4))
    assert cfg.family_config.linear_layers == (0, 2) and cfg.family_config.rotary_dim == 8
    assert cfg.attention_kinds == ("gated_deltanet", "gqa") * 2
    assert cfg.num_experts == 512 and cfg.moe_layers == (0, 1, 2, 3)    # transformers' default
    dense = read_model_config(_config(tmp_path, num_experts=0))
    assert dense.moe_layers == ()           # num_experts 0: every FFN dense, as HF builds it


@pytest.mark.parametrize("flags, named", [
    (dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="interleave"),
     "--cp-strategy"),
    (dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag",
          enable_adaptive_cp=True), "--enable-adaptive-cp"),
    (dict(disaggregation_mode="prefill"), "--disaggregation-mode"),
])
def test_hybrid_flags_are_checked(hybrid_dir, flags, named):
    path = str(hybrid_dir / "qwen3_5")
    if not os.path.isdir(path):
        make_hybrid_checkpoint(path, "qwen3_5", seed=1)
    # The engine's early model check, before any rank process starts.
    check_model_flags(EngineArgs(model_path=path, tp_size=2, attn_cp_size=2,
                                 enable_prefill_cp=True, cp_strategy="zigzag"))   # accepted
    with pytest.raises(ConfigError, match=named):
        check_model_flags(EngineArgs(model_path=path, **flags))


def test_attention_tp_needs_whole_key_heads(tmp_path):
    """A rank holds whole linear key heads: an attention TP size that does not divide
    linear_num_key_heads is a ConfigError naming --tp and the field, with or without CP."""
    under_cp = dict(attn_cp_size=2, enable_prefill_cp=True, cp_strategy="zigzag")
    check_model_flags(EngineArgs(model_path=_config(tmp_path), tp_size=4, **under_cp),
                      weights=False)                                    # 2 key heads over TP 2
    path = _config(tmp_path, linear_num_key_heads=1, linear_num_value_heads=2)
    for flags in (dict(tp_size=2), dict(tp_size=4, **under_cp)):
        with pytest.raises(ConfigError, match=r"--tp \d: attention TP size 2 .*"
                                              r"linear_num_key_heads=1"):
            check_model_flags(EngineArgs(model_path=path, **flags), weights=False)


def _rank_rows(cfg, rank: int, tp: int) -> dict[str, tuple[int, list[int]]]:
    """Per tensor of one linear and one full-attention layer (its name after the layer's prefix):
    (dim, the rows or columns of the whole tensor) rank ``rank`` of ``tp`` holds, from the HF
    layouts: value head j reads key head j // group (repeat_interleave); Qwen3-Next packs
    [q, k, v-group, z-group] and [b-group, a-group] per key head; Qwen3.5 has q|k|v side by side;
    a full-attention head's q_proj rows are its query then its gate."""
    h = cfg.family_config
    dk, dv, d, group = h.head_k_dim, h.head_v_dim, cfg.head_dim, h.num_v_heads // h.num_k_heads
    keys = range(rank * h.num_k_heads // tp, (rank + 1) * h.num_k_heads // tp)
    values = [j for j in range(h.num_v_heads) if j // group in keys]

    def rows(heads, size: int, offset: int = 0) -> list[int]:
        return [offset + x * size + i for x in heads for i in range(size)]

    qkv = rows(keys, dk) + rows(keys, dk, h.key_dim) + rows(values, dv, 2 * h.key_dim)
    linear = {"conv1d.weight": (0, qkv), "A_log": (0, values), "dt_bias": (0, values),
              "norm.weight": (0, list(range(dv))), "out_proj.weight": (1, rows(values, dv))}
    if h.split_projections:
        linear.update({"in_proj_qkv.weight": (0, qkv), "in_proj_z.weight": (0, rows(values, dv)),
                       "in_proj_b.weight": (0, values), "in_proj_a.weight": (0, values)})
    else:
        linear.update({"in_proj_qkvz.weight": (0, rows(keys, 2 * dk + 2 * group * dv)),
                       "in_proj_ba.weight": (0, rows(keys, 2 * group))})
    heads = range(rank * cfg.num_attention_heads // tp, (rank + 1) * cfg.num_attention_heads // tp)
    kv_heads = range(rank * cfg.num_key_value_heads // tp,
                     (rank + 1) * cfg.num_key_value_heads // tp)
    full = {"q_proj.weight": (0, rows(heads, 2 * d)), "k_proj.weight": (0, rows(kv_heads, d)),
            "v_proj.weight": (0, rows(kv_heads, d)), "o_proj.weight": (1, rows(heads, d)),
            "q_norm.weight": (0, list(range(d))), "k_norm.weight": (0, list(range(d)))}
    return {**{f"linear_attn.{k}": v for k, v in linear.items()},
            **{f"self_attn.{k}": v for k, v in full.items()}}


def _dense(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A tensor as fp32, an FP8 projection's weight dequantized through the scale rows it holds."""
    from graphcp.kernels.fp8_torch import dense_weight
    owner, attr = module.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
    if attr == "weight" and getattr(owner, "fp8", None) is not None:
        return dense_weight(owner.fp8, torch.float32)
    return getattr(owner, attr).float()


@pytest.mark.parametrize("arch, fp8", [("qwen3_5", True), ("qwen3_next", False)])
def test_attention_tp_ranks_hold_whole_head_groups(hybrid_dir, arch, fp8):
    """At attention TP 2 each rank loads exactly its key heads' rows of every mixer tensor (HF's
    layouts, computed here head by head): Qwen3.5's q|k|v projection and every conv are three
    ranges, FP8 ones (24-row blocks, so ranges start inside blocks and share them) keep their
    scales; the Qwen3-Next projections are one range per rank. The states pool per rank's heads."""
    from graphcp.attention.kinds import state_parts
    src = make_hybrid_checkpoint(str(hybrid_dir / f"{arch}_tp"), arch, seed=4)
    path, whole = src, src
    if fp8:
        path, whole = make_fp8_checkpoint(src, str(hybrid_dir / f"{arch}_tp_fp8"),
                                          str(hybrid_dir / f"{arch}_tp_twin"), (24, 16))
    full = load_model(whole, torch.float32, torch.device("cpu"))
    cfg, checked = full.config, 0
    for rank in range(2):
        model = load_model(path, torch.float32, torch.device("cpu"), tp=TPInfo(size=2, rank=rank))
        if fp8:
            assert model.model.layers["0"].linear_attn.in_proj_qkv.weight.dtype == FP8
        for layer in (0, 1):                         # layer 0 Gated DeltaNet, layer 1 full
            prefix = f"model.layers.{layer}."
            mine = {n.removeprefix(prefix) for n in model.state_dict()
                    if n.startswith(prefix) and ".mlp." not in n and "layernorm" not in n
                    and not n.endswith("_scale_inv")}
            expected = {n: v for n, v in _rank_rows(cfg, rank, 2).items()
                        if n.startswith(("linear_attn." if layer == 0 else "self_attn."))}
            assert mine == set(expected)
            for name, (dim, index) in expected.items():
                want = _dense(full, prefix + name).index_select(dim, torch.tensor(index))
                got = _dense(model, prefix + name)
                assert got.shape == want.shape and torch.equal(got, want), (rank, name)
                checked += 1
        parts = state_parts(cfg, range(cfg.num_hidden_layers), 2)[0]
        h = cfg.family_config
        assert [p.shape for p in parts] == [(h.conv_kernel - 1, h.conv_dim // 2),
                                            (h.num_v_heads // 2, h.head_k_dim, h.head_v_dim)]
    assert checked == 2 * len(_rank_rows(cfg, 0, 2))

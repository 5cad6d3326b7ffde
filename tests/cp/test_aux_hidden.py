"""Speculative-decoding aux hidden states (--speculative-aux-hidden-layers) equal HF transformers'
``output_hidden_states`` for every new token, in the batch's order: one rank, CP 2 zigzag with graphs,
interleave across pipeline stages, DP groups, chunked prefill; bad layer ids are ConfigErrors."""
from __future__ import annotations

import pytest
import torch
from testkit.engines import cp_kwargs
from testkit.hf_reference import make_checkpoint, rel_err
from testkit.parity import TOL, Session, random_ids

from graphcp import ConfigError, Engine, EngineArgs, Request

VOCAB, LAYERS = 211, 3
AUX = [2, 0]            # listed out of order: columns follow the listed order


@pytest.fixture(scope="session")
def aux_checkpoint(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "qwen3_aux"), "qwen3", num_hidden_layers=LAYERS)


class AuxSession(Session):
    """A parity session that also checks ``out.aux_hidden_states`` against HF's hidden states."""

    def run(self, batch, check_kv=False, **kwargs):
        out = super().run(batch, check_kv=check_kv, **kwargs)
        model = self.oracle.models[self.path].model
        aux = out.aux_hidden_states
        assert aux.dtype == torch.float32 and aux.shape == (sum(len(ids) for _, ids in batch), len(AUX) * 64)
        start = 0
        for rid, ids in batch:
            with torch.no_grad():
                states = model(torch.tensor([self.history[rid]]), output_hidden_states=True).hidden_states
            n = len(ids)
            want = torch.cat([states[i][0, -n:] for i in AUX], dim=1)
            err = rel_err(aux[start:start + n], want)
            self.worst = max(self.worst, err)
            assert err <= TOL, f"{rid}: aux hidden states rel err {err:.2e} (mode {out.mode})"
            start += n
        return out


def _session(engines, oracle, path, **kwargs):
    engine = engines.get(path, speculative_aux_hidden_layers=AUX, cuda_graph_buckets=[32, 64], **kwargs)
    return AuxSession(engine, oracle, path)


def test_single_rank_graph_and_chunked(aux_checkpoint, engines, oracle):
    s = _session(engines, oracle, aux_checkpoint)
    out = s.run([("a", random_ids(37, VOCAB, 1)), ("b", random_ids(5, VOCAB, 2))], check_kv=True)
    assert out.mode == "graph", out.eager_reason
    out = s.run([("b", random_ids(20, VOCAB, 3)), ("c", random_ids(9, VOCAB, 4))])   # b: new rows only
    assert out.mode == "graph", out.eager_reason
    s.run([("a", random_ids(11, VOCAB, 5))], force_eager=True)
    s.release_all()


def test_cp2_zigzag_graph_eager_and_unsharded(aux_checkpoint, engines, oracle):
    s = _session(engines, oracle, aux_checkpoint, **cp_kwargs(2, "zigzag"))
    batch = [("a", random_ids(45, VOCAB, 10)), ("b", random_ids(9, VOCAB, 11)), ("c", random_ids(70, VOCAB, 12))]
    graph = s.run(batch, check_kv=True)
    assert graph.mode == "graph" and graph.cp_applied, graph.eager_reason
    out = s.run([("b", random_ids(30, VOCAB, 13)), ("d", random_ids(4, VOCAB, 14))])   # chunked prefill
    assert out.mode == "graph" and out.cp_applied, out.eager_reason
    out = s.run([("a", random_ids(3, VOCAB, 15)), ("e", random_ids(17, VOCAB, 16))])   # too short: unsharded
    assert out.cp_applied is False
    s.release_all()
    # The same batch eagerly gives the same rows as the graph replay.
    eager = s.run(batch, force_eager=True)
    assert eager.mode == "eager"
    assert (eager.aux_hidden_states - graph.aux_hidden_states).abs().max().item() <= 1e-6
    s.release_all()


def test_cp2_adaptive_placement_graph(aux_checkpoint, engines, oracle):
    """Adaptive CP: short requests whole on one rank, long ones split; rows still in batch order."""
    s = _session(engines, oracle, aux_checkpoint, **cp_kwargs(2, "zigzag", enable_adaptive_cp=True,
                                                            adaptive_cp_threshold=40))
    out = s.run([("a", random_ids(50, VOCAB, 50)), ("b", random_ids(3, VOCAB, 51)), ("c", random_ids(21, VOCAB, 52)),
                 ("d", random_ids(9, VOCAB, 53))], check_kv=True)
    assert out.mode == "graph" and out.cp_applied and sum(out.per_rank_tokens) == 83, out.eager_reason
    s.run([("c", random_ids(12, VOCAB, 54))])
    s.release_all()


def test_interleave_over_pipeline_stages(aux_checkpoint, engines, oracle):
    """CP 2 interleave on each of 2 stages: stage 0 sends layer 0's columns with its hidden state."""
    s = _session(engines, oracle, aux_checkpoint, pp_size=2, **cp_kwargs(2, "interleave"))
    out = s.run([("a", random_ids(21, VOCAB, 20)), ("b", random_ids(6, VOCAB, 21))], check_kv=True)
    assert out.cp_applied and out.mode == "eager"
    s.run([("a", random_ids(8, VOCAB, 22)), ("c", random_ids(1, VOCAB, 23))])
    s.release_all()


def test_dp_groups_merge_in_batch_order(aux_checkpoint, engines, oracle):
    s = _session(engines, oracle, aux_checkpoint, tp_size=2, dp_size=2)
    s.run([("a", random_ids(30, VOCAB, 30)), ("b", random_ids(7, VOCAB, 31)), ("c", random_ids(12, VOCAB, 32))])
    s.run([("c", random_ids(5, VOCAB, 33)), ("a", random_ids(9, VOCAB, 34))])
    s.release_all()


def test_unset_means_none(checkpoint, engines):
    engine = engines.get(checkpoint)
    out = engine.prefill([Request("x", random_ids(5, VOCAB, 40))])
    assert out.aux_hidden_states is None
    engine.release("x")


@pytest.mark.parametrize("layers,match", [
    ([LAYERS], f"layer id {LAYERS} is out of range"), ([0, 7], "layer id 7 is out of range"),
])
def test_out_of_range_layer_is_config_error(aux_checkpoint, layers, match):
    with pytest.raises(ConfigError, match="--speculative-aux-hidden-layers: " + match):
        Engine(EngineArgs(model_path=aux_checkpoint, speculative_aux_hidden_layers=layers))


@pytest.mark.parametrize("layers,match", [([], "at least one"), ([-1], "integers >= 0"), ([1, 1], "twice")])
def test_bad_layer_lists_are_config_errors(aux_checkpoint, layers, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model_path=aux_checkpoint, speculative_aux_hidden_layers=layers)


def test_cli_flag(aux_checkpoint):
    args = EngineArgs.from_cli(["--model-path", aux_checkpoint, "--speculative-aux-hidden-layers", "1", "0"])
    assert args.speculative_aux_hidden_layers == (1, 0)

"""Breakable graphs: bucket selection, every eager fallback, the capture rules of the CPU emulation,
fixed static addresses, and the host-launch counter."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from testkit.engines import cp_kwargs
from testkit.parity import Session, graph_and_eager, random_ids

from graphcp import Request
from graphcp.graph.cpu import CpuCapture
from graphcp.graph.protocol import GraphCaptureError, check_same_ops, graph_break
from graphcp.graph.runner import select_bucket
from graphcp.planner import config_ineligibility

VOCAB = 211


# -- bucket selection ------------------------------------------------------------------------------
def test_select_bucket_cases():
    buckets = [16, 32, 64, 128]
    assert select_bucket(buckets, 30, 32) == (32, None)                  # smallest that holds
    assert select_bucket(buckets, 33, 36) == (64, None)                  # the largest rank decides
    assert select_bucket(buckets, 7, 8)[0] is None                       # 16 > 2 x 7: padding guard
    assert "beyond 2x" in select_bucket(buckets, 7, 8)[1]
    assert select_bucket(buckets, 8, 8) == (16, None)                    # exactly 2x is allowed
    assert "no captured bucket" in select_bucket(buckets, 200, 200)[1]
    bucket, reason = select_bucket([16, 64], 20, 20, failed={32: "boom"})
    assert bucket is None and "bucket 32 failed to capture: boom" in reason


@pytest.mark.parametrize("change,reason", [
    (dict(disable_cuda_graph=True), "disabled"),
    (dict(pp_size=2), "pipeline parallelism (--pp > 1) runs eagerly"),
    (dict(dp_size=2), "data-parallel attention (--dp > 1) runs eagerly"),
    (dict(cp_strategy="interleave"), "interleave"),
    (dict(backend="flashattention"), "flashattention"),
    (dict(backend="torch"), "torch"),
])
def test_config_ineligibility_reasons(change, reason):
    base = dict(disable_cuda_graph=False, pp_size=1, dp_size=1, tp_size=2, attn_cp_size=2, cp_size=2,
                cp_strategy="zigzag", backend="trtllm_mha")
    base.update(change)
    args = SimpleNamespace(**base)
    assert config_ineligibility(args, "trtllm_mha") is None if not change else True
    assert reason in config_ineligibility(args, base["backend"])


def test_attention_tp_inside_cp_is_eligible():
    """CP 2 x attention TP 2 (the seed's --tp 4 --attn-cp-size 2) and attention TP alone replay
    graphs: attention TP is a head split plus collectives, which are breaks where not captured."""
    for tp, cp in ((4, 2), (2, 1)):
        args = SimpleNamespace(disable_cuda_graph=False, pp_size=1, dp_size=1, tp_size=tp,
                               attn_cp_size=cp, cp_size=cp, cp_strategy="zigzag")
        assert config_ineligibility(args, "trtllm_mha") is None


def test_single_rank_is_graphed_too():
    args = SimpleNamespace(disable_cuda_graph=False, pp_size=1, dp_size=1, tp_size=1, attn_cp_size=1, cp_size=1,
                           cp_strategy=None)
    assert config_ineligibility(args, "trtllm_mha") is None


# -- engine fallbacks --------------------------------------------------------------------------------
def test_engine_fallbacks_are_exact(checkpoint, engines, oracle):
    engine = engines.get(checkpoint, **cp_kwargs(2, cuda_graph_buckets=[16, 32], max_batch_requests=2))
    s = Session(engine, oracle, checkpoint)
    assert engine.stats()["graph_buckets"] == [16, 32]
    out = s.run([("a", random_ids(40, VOCAB, 1))])
    assert out.mode == "graph" and out.graph_bucket == 32 and out.eager_reason is None
    out = s.run([("b", random_ids(8, VOCAB, 2)), ("c", random_ids(9, VOCAB, 3)), ("d", random_ids(9, VOCAB, 4))])
    assert out.mode == "eager" and "capacity of 2" in out.eager_reason
    out = s.run([("e", random_ids(150, VOCAB, 5))])
    assert out.mode == "eager" and "no captured bucket" in out.eager_reason
    out = s.run([("f", random_ids(3, VOCAB, 6))])
    assert out.mode == "eager" and out.cp_applied is False and "zigzag needs" in out.eager_reason
    out = s.run([("g", random_ids(12, VOCAB, 7))])
    assert out.mode == "eager" and "beyond 2x" in out.eager_reason
    s.release_all()


def test_interleave_and_flashattention_run_eagerly(checkpoint, engines, oracle):
    engine = engines.get(checkpoint, **cp_kwargs(2, "interleave"))
    out = Session(engine, oracle, checkpoint).run([("i", random_ids(30, VOCAB, 1))])
    assert out.mode == "eager" and "interleave" in out.eager_reason and engine.stats()["graph_buckets"] == []
    engine.release("i")


# -- capture rules (CPU emulation) -----------------------------------------------------------------
def _capture(fn):
    with CpuCapture() as cap:
        fn()
    return cap


@pytest.mark.parametrize("bad,match", [
    (lambda x: x.sum().item(), "syncs with the host"),
    (lambda x: x.tolist(), "syncs with the host"),
    (lambda x: torch.nonzero(x), "syncs with the host"),
    (lambda x: x[x > 0], "boolean-mask"),
    (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), "constant tensor"),
])
def test_capture_rules_are_enforced(bad, match):
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match=match):
        _capture(lambda: bad(x * 2))


def test_rule_error_names_the_line():
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match="test_graphs.py"):
        _capture(lambda: (x * 2).max().item())


def test_data_dependent_shapes_are_caught():
    def segment(n: int):
        return lambda: torch.ones(n).cumsum(0)
    a, b = _capture(segment(4)), _capture(segment(5))
    with pytest.raises(GraphCaptureError, match="differs between two batches"):
        check_same_ops(a.signature, b.signature, bucket=16)


def test_replay_reexecutes_segments_and_breaks_with_live_data():
    calls = []
    inp, out = torch.zeros(3), torch.zeros(3)

    @graph_break
    def host_step(t, dst):
        calls.append(1)
        return dst.copy_(t + 100)          # writes into the caller's buffer

    def fwd():
        y = inp * 2
        z = torch.empty_like(y)
        host_step(y, z)
        out.copy_(z + 1)

    with CpuCapture() as cap:
        fwd()
    graph = cap.finish([inp, out])
    assert graph.num_segments == 2 and graph.num_breaks == 1
    inp.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert out.tolist() == [103.0, 105.0, 107.0] and len(calls) == 2
    ptr = inp.data_ptr()
    inp.set_(torch.zeros(3))               # a static input that moves must be refused
    assert inp.data_ptr() != ptr
    with pytest.raises(GraphCaptureError, match="moved"):
        graph.replay()


def test_injected_sync_serves_that_bucket_eagerly(checkpoint, monkeypatch, oracle):
    """A host sync inside the model, only at bucket 16: that bucket fails capture, others are captured,
    and batches that need bucket 16 run eagerly and exactly."""
    from graphcp import Engine, EngineArgs
    from graphcp.models.common import mlp
    original = mlp.GatedMLP.forward

    def leaky(self, x):
        if x.shape[0] == 16:
            x = x * (x.abs().sum() > 0).item()
        return original(self, x)

    monkeypatch.setattr(mlp.GatedMLP, "forward", leaky)
    with Engine(EngineArgs(model_path=checkpoint, max_total_tokens=2048, cuda_graph_buckets=[8, 16, 32])) as engine:
        stats = engine.stats()
        assert stats["graph_buckets"] == [8, 32] and "syncs with the host" in stats["capture_failures"][16]
        s = Session(engine, oracle, checkpoint)
        out = s.run([("a", random_ids(13, VOCAB, 1))])
        assert out.mode == "eager" and "bucket 16 failed to capture" in out.eager_reason
        out = s.run([("b", random_ids(27, VOCAB, 2))])
        assert out.mode == "graph" and out.graph_bucket == 32


# -- static buffers and the host-launch counter -------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2])
def test_host_ops_graph_vs_eager(checkpoint, engines, cp):
    engine = engines.get(checkpoint, **cp_kwargs(cp))
    batch = [Request("h0", random_ids(50, VOCAB, 1)), Request("h1", random_ids(70, VOCAB, 2))]
    graph, eager = graph_and_eager(engine, batch, count_host_ops=True)
    assert graph.mode == "graph" and eager.mode == "eager"
    assert eager.host_ops > 100 and graph.host_ops / eager.host_ops <= 0.25, (graph.host_ops, eager.host_ops)

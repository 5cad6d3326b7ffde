"""The last layer runs for each request's last token only (its K/V for every token): logits and
caches still equal HF's, and the rows that reach its FFN are the requests', not the tokens'."""
from __future__ import annotations

import pytest
from testkit.hf_reference import make_checkpoint
from testkit.parity import Session, random_ids

from graphcp.models.common.decoder import DecoderLM

VOCAB = 211


def _ffn_rows(engine) -> tuple[list[tuple[int, int]], list]:
    """(layer, rows) entering each layer's FFN per eager forward (a CPU replay runs no Python hooks),
    and the hooks' handles."""
    model, seen = engine._runner.model, []
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda _m, args, i=int(i): seen.append((i, args[0].shape[0])))
        for i, layer in model.model.layers.items()]
    return seen, hooks


@pytest.mark.parametrize("lens", [[300], [37, 1, 150]])
def test_last_layer_ffn_sees_one_row_per_request(checkpoint, engines, oracle, lens):
    engine = engines.get(checkpoint, disable_cuda_graph=True)
    assert engine._runner.prune_last_layer
    seen, hooks = _ffn_rows(engine)
    s = Session(engine, oracle, checkpoint)
    try:
        s.run([(f"r{i}", random_ids(n, VOCAB, 40 + i)) for i, n in enumerate(lens)])
        ids = random_ids(50, VOCAB, 49)                   # and a cached prefix: chunked prefill
        for chunk in (ids[:20], ids[20:]):
            s.run([("chunked", chunk)])
    finally:
        for hook in hooks:
            hook.remove()
    last = engine._runner.model.config.num_hidden_layers - 1
    assert [rows for layer, rows in seen if layer == last] == [len(lens), 1, 1]
    assert [rows for layer, rows in seen if layer != last] == [sum(lens), 20, 30]
    s.release_all()


def test_layers_that_cannot_keep_rows_run_whole(ckpt_dir, engines):
    """A MoE last layer (experts route rows of their own) keeps every row; dense layers before it
    are not the last, so nothing is skipped."""
    path = make_checkpoint(str(ckpt_dir / "moe-last"), "qwen3_moe", seed=21, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32)
    model = engines.get(path, disable_cuda_graph=True)._runner.model
    assert not DecoderLM.prunes_last_layer(model)


def test_last_token_queries_are_one_row_per_request_on_the_metadata_device():
    """Requests with new tokens attend with one query over their whole context, padding requests
    with none; an eager GPU forward has host descriptors and device metadata (the meta device
    stands in for the GPU)."""
    from dataclasses import replace

    import torch

    from graphcp.cp.metadata import last_tokens, zigzag_metadata
    ext, pre = torch.tensor([3, 5, 0]), torch.tensor([4, 0, 0])
    table = torch.arange(1, 10).view(3, 3)
    meta = zigzag_metadata(ext, pre, table, 2, 0, 8, 4)
    last = last_tokens(ext, pre, meta)
    assert last.cu_seqlens_q.tolist() == [0, 1, 2, 2] and last.q_limits.tolist() == [7, 5, 0]
    assert torch.equal(last.page_rows, table)
    moved = last_tokens(ext, pre, replace(meta, page_rows=meta.page_rows.to("meta")))
    assert {t.device.type for t in (moved.cu_seqlens_q, moved.page_rows, moved.q_limits)} == {"meta"}

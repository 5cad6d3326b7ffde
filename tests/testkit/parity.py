"""Parity helper: run a batch through graphcp and through HF on each request's whole history."""
from __future__ import annotations

import torch

from graphcp import Request
from testkit.hf_reference import rel_err

TOL = 1e-4


class Session:
    """Tracks each rid's tokens so far, so chunked prefill compares against HF on the full sequence."""

    def __init__(self, engine, oracle, path: str) -> None:
        self.engine, self.oracle, self.path = engine, oracle, path
        self.history: dict[str, list[int]] = {}
        self.worst = 0.0        # the largest relative error seen, logits and KV

    def run(self, batch: list[tuple[str, list[int]]], check_kv: bool = True, **kwargs):
        out = self.engine.prefill([Request(rid, ids) for rid, ids in batch], **kwargs)
        assert out.logits.shape[0] == len(batch) and out.logits.dtype == torch.float32
        for i, (rid, ids) in enumerate(batch):
            self.history[rid] = self.history.get(rid, []) + list(ids)
            logits, kv = self.oracle(self.path, self.history[rid])
            err = rel_err(out.logits[i], logits)
            self.worst = max(self.worst, err)
            assert err <= TOL, f"{rid}: logits rel err {err:.2e} (mode {out.mode}, reason {out.eager_reason})"
            assert out.next_token_ids[i] == int(out.logits[i].argmax())
            if check_kv:
                ours = self.engine.kv_cache(rid)
                assert len(ours) == len(kv)
                for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(ours, kv)):
                    assert k.shape == k_ref.shape, f"{rid} layer {layer}: K shape {k.shape} vs {k_ref.shape}"
                    kv_err = max(rel_err(k, k_ref), rel_err(v, v_ref))
                    self.worst = max(self.worst, kv_err)
                    assert kv_err <= TOL, f"{rid} layer {layer}: KV differs ({kv_err:.2e})"
        return out

    def release_all(self) -> None:
        for rid in self.history:
            self.engine.release(rid)
        self.history.clear()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def graph_and_eager(engine, batch, **kwargs):
    """The same fresh batch through the graph path, then forced eager; rids are released after each."""
    outs = []
    for force_eager in (False, True):
        outs.append(engine.prefill(batch, force_eager=force_eager, **kwargs))
        for r in batch:
            engine.release(r.rid)
    return outs

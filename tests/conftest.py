"""Shared fixtures: tiny random checkpoints built by transformers, the HF oracle, and engines reused
across tests (multi-rank engines are slow to start on two cores)."""
from __future__ import annotations

import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite runs on CPU: Triton kernels run in its interpreter, which must be chosen before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from testkit.hf_reference import HFReference, make_checkpoint

from graphcp import Engine, EngineArgs

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(ckpt_dir):
    """The suite's main checkpoint: Qwen3 (q/k norm, head_dim independent of hidden size)."""
    return make_checkpoint(str(ckpt_dir / "qwen3"), "qwen3")


class _Oracle:
    def __init__(self) -> None:
        self.models: dict[str, HFReference] = {}
        self.cache: dict[tuple, tuple] = {}

    def __call__(self, path: str, ids: list[int]):
        key = (path, tuple(ids))
        if key not in self.cache:
            if path not in self.models:
                self.models[path] = HFReference(path)
            self.cache[key] = self.models[path].run(list(ids))
        return self.cache[key]


@pytest.fixture(scope="session")
def oracle():
    return _Oracle()


class _Engines:
    """Engines keyed by their arguments, reused by every test; at most a few multi-rank ones alive."""

    def __init__(self, max_multi: int = 3) -> None:
        self.engines: dict[tuple, Engine] = {}
        self.max_multi = max_multi
        self.closing: list[threading.Thread] = []

    def _close_later(self, engine: Engine) -> None:
        """An evicted engine's ranks stop in the background (a graceful stop waits on every rank's
        exit); the next test does not wait for it."""
        thread = threading.Thread(target=engine.close, name="close-engine", daemon=True)
        thread.start()
        self.closing.append(thread)

    def get(self, model_path: str, **kwargs) -> Engine:
        kwargs.setdefault("max_total_tokens", 8192)
        key = (model_path,) + tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
        if key in self.engines:
            self.engines[key] = self.engines.pop(key)   # most recently used last
            return self.engines[key]
        multi = [k for k, e in self.engines.items() if e.args.world_size > 1]
        if EngineArgs(model_path=model_path, **kwargs).world_size > 1 and len(multi) >= self.max_multi:
            self._close_later(self.engines.pop(multi[0]))
        engine = Engine(EngineArgs(model_path=model_path, **kwargs))
        self.engines[key] = engine
        return engine

    def close(self) -> None:
        for engine in self.engines.values():
            self._close_later(engine)
        for thread in self.closing:
            thread.join(timeout=60)
        self.engines.clear()


@pytest.fixture(scope="session")
def engines():
    pool = _Engines()
    yield pool
    pool.close()

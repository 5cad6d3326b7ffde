"""Breakable graphs: captured segments replayed from fixed buffers, with eager breaks between them.

A function decorated with ``graph_break`` (an attention kernel that needs host arguments, a collective that
cannot be captured) ends the current segment when called during a capture, runs eagerly, and at replay runs
again eagerly with the same argument objects, writing into a caller-provided output buffer.

Two backends share one protocol (``begin`` / ``run_break`` / ``finish`` -> ``BreakableGraph.replay``):
- ``CudaCapture``: one ``torch.cuda.CUDAGraph`` per segment, one memory pool shared by all buckets.
- ``CpuCapture``: records every aten op of a segment with a dispatch mode and replays the recorded op list
  without re-running Python. It enforces the CUDA capture rules so that they hold on machines without a GPU:
  no host syncs, no data-dependent shapes, no constant tensors made inside a segment.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcp.profiling import nvtx_range


class GraphCaptureError(RuntimeError):
    """A capture rule was broken inside a segment; the bucket must run eagerly."""


_active: "_Capture | None" = None


def graph_break(fn: Callable) -> Callable:
    """Mark ``fn`` as a break point. It must write its result into an argument, not return new memory."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _active
        if _active is None:
            return fn(*args, **kwargs)
        capture, _active = _active, None       # a break runs eagerly, breaks nested inside it too
        try:
            return capture.run_break(fn, args, kwargs)
        finally:
            _active = capture

    return wrapper


def capture_active() -> bool:
    return _active is not None


# -- replay ---------------------------------------------------------------------------------------
@dataclass
class _Break:
    fn: Callable
    args: tuple
    kwargs: dict
    resolve: tuple | None = None            # CPU: (flat args, treespec, [(position, env index)])
    outs: list = field(default_factory=list)  # CPU: [(output position, env index)]


@dataclass
class BreakableGraph:
    items: list = field(default_factory=list)          # _CudaSegment | _CpuSegment | _Break
    static: list[torch.Tensor] = field(default_factory=list)
    static_ptrs: list[int] = field(default_factory=list)
    env_size: int = 0                                    # CPU: intermediates a replay holds
    count_host_ops: bool = False                         # set by bench: count ops run outside segments
    host_ops: int = 0                                    # launches of the last replay (segments count 1)

    @property
    def num_segments(self) -> int:
        return sum(not isinstance(i, _Break) for i in self.items)

    @property
    def num_breaks(self) -> int:
        return sum(isinstance(i, _Break) for i in self.items)

    def replay(self, env: list | None = None) -> None:
        for t, ptr in zip(self.static, self.static_ptrs):
            if t.data_ptr() != ptr:
                raise GraphCaptureError("a static buffer moved after capture; graphs read fixed addresses")
        env: list = [None] * self.env_size
        launches = 0
        for item in self.items:
            if isinstance(item, _Break):
                counter = OpCounter() if self.count_host_ops else contextlib.nullcontext()
                with nvtx_range(f"break:{item.fn.__name__}"), counter:
                    args, kwargs = _resolve_break(item, env)
                    out = item.fn(*args, **kwargs)
                    if item.outs:
                        flat_out = tree_flatten(out)[0]
                        for pos, ref in item.outs:
                            env[ref] = flat_out[pos]
                launches += counter.count if self.count_host_ops else 0
            else:
                item.replay(env)
                launches += 1
        self.host_ops = launches


# -- CPU emulation ---------------------------------------------------------------------------------
_SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select",
             "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
             "aten::is_nonzero", "aten::equal", "aten::allclose"}
_CONSTANT_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::_to_copy.from_host"}


def _caller() -> str:
    """The innermost frame outside torch and this file: where the offending op was written."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and not path.endswith("graph/capture.py"):
            return f"{path}:{frame.lineno} ({frame.line})"
    return "an unknown place"


def _op_name(func: Any) -> str:
    return getattr(func, "name", lambda: str(func))()


class _Recorder(TorchDispatchMode):
    """Records aten ops of one segment and checks the capture rules."""

    def __init__(self, capture: "CpuCapture") -> None:
        super().__init__()
        self.capture = capture
        self._saved: dict[str, Any] = {}

    # .tolist() and .numpy() read CPU memory without dispatching an op: guard them while recording.
    _HOST_READS = ("tolist", "numpy")

    def __enter__(self) -> "_Recorder":
        for name in self._HOST_READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _host_read_error(name))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        self._saved.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = _op_name(func).split(".")[0]
        if name in _SYNC_OPS:
            raise GraphCaptureError(f"{name} syncs with the host inside a captured segment (.item(), .tolist(), "
                                    f"nonzero or a data-dependent shape) at {_caller()}; move it out of the "
                                    f"segment or mark a graph_break")
        if name in _CONSTANT_OPS:
            raise GraphCaptureError(f"a constant tensor is made from host data inside a captured segment "
                                    f"(torch.tensor(...)) at {_caller()}; allocate it before capture")
        if name in ("aten::index", "aten::index_put", "aten::index_put_"):
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise GraphCaptureError(f"boolean-mask indexing inside a captured segment has a data-dependent "
                                        f"shape at {_caller()}; use torch.where or integer indices")
        out = func(*args, **kwargs)
        self.capture.record(func, args, kwargs, out)
        return out


def _host_read_error(name: str) -> Callable:
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise GraphCaptureError(f".{name}() syncs with the host inside a captured segment at {_caller()}; "
                                f"move it out of the segment or mark a graph_break")
    return refuse


class _CpuSegment:
    """Recorded aten ops. Arguments are stored as templates with the positions of intermediates, so a
    replay only patches those positions and calls the op: no Python model code, no pytree walks."""

    def __init__(self) -> None:
        # (op, args, kwargs, arg_refs [(i, j, ref)], kwarg_refs [(key, ref)], outs [(pos, ref)])
        self.nodes: list[tuple] = []
        self.drops: list[list[int]] = []

    def replay(self, env: list) -> None:
        for (op, args, kwargs, arefs, krefs, outs), drop in zip(self.nodes, self.drops):
            if arefs:
                args = list(args)
                for i, j, ref in arefs:
                    if j < 0:
                        args[i] = env[ref]
                    else:
                        if type(args[i]) is tuple:
                            args[i] = list(args[i])
                        args[i][j] = env[ref]
            if krefs:
                kwargs = dict(kwargs)
                for key, ref in krefs:
                    kwargs[key] = env[ref]
            out = op(*args, **kwargs)
            for pos, ref in outs:
                env[ref] = out if pos < 0 else out[pos]
            for ref in drop:
                env[ref] = None


class _Capture:
    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


class CpuCapture(_Capture):
    """Record a forward into a BreakableGraph of recorded-op segments and breaks."""

    def __init__(self) -> None:
        self.graph = BreakableGraph()
        self.ids: dict[int, int] = {}          # id(tensor made during capture) -> env index
        self.keep: list[torch.Tensor] = []     # keeps captured tensors alive so ids stay unique
        self.signature: list[tuple] = []
        self.segment: _CpuSegment | None = None
        self.mode: _Recorder | None = None

    def __enter__(self) -> "CpuCapture":
        global _active
        if _active is not None:
            raise GraphCaptureError("nested graph capture")
        _active = self
        self._begin()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        try:
            self._end()          # leaves the recording mode, also after an error (which then propagates)
        finally:
            _active = None

    def _begin(self) -> None:
        self.segment = _CpuSegment()
        self.mode = _Recorder(self)
        self.mode.__enter__()

    def _end(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        if self.segment is not None and self.segment.nodes:
            self.graph.items.append(self.segment)
        self.segment = None

    def _flatten_refs(self, tree: Any) -> tuple[list, Any, list[tuple[int, int]]]:
        flat, spec = tree_flatten(tree)
        refs = [(i, self.ids[id(x)]) for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and id(x) in self.ids]
        flat = [None if (isinstance(x, torch.Tensor) and id(x) in self.ids) else x for x in flat]
        return flat, spec, refs

    def _bind_outputs(self, out: Any) -> list[tuple[int, int]]:
        return [(pos, self._bind(t)) for pos, t in enumerate(tree_flatten(out)[0])
                if isinstance(t, torch.Tensor) and id(t) not in self.ids]

    def _ref(self, x: Any) -> int | None:
        return self.ids.get(id(x)) if isinstance(x, torch.Tensor) else None

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.signature.append(_signature(func, (args, kwargs), out))
        arefs, template = [], list(args)
        for i, a in enumerate(args):
            if isinstance(a, (list, tuple)):
                for j, x in enumerate(a):
                    if self._ref(x) is not None:
                        arefs.append((i, j, self._ref(x)))
                template[i] = tuple(a)       # copied on write at replay
            elif self._ref(a) is not None:
                arefs.append((i, -1, self._ref(a)))
        krefs = [(k, self._ref(v)) for k, v in kwargs.items() if self._ref(v) is not None]
        if any(isinstance(v, (list, tuple)) and any(self._ref(x) is not None for x in v) for v in kwargs.values()):
            raise GraphCaptureError(f"{_op_name(func)}: tensor lists in keyword arguments are not supported")
        if isinstance(out, torch.Tensor):
            outs = [] if id(out) in self.ids else [(-1, self._bind(out))]
        else:
            outs = [(pos, self._bind(t)) for pos, t in enumerate(out or ())
                    if isinstance(t, torch.Tensor) and id(t) not in self.ids]
        op = getattr(func, "_op", func)      # the C++ op behind the OpOverload: one Python frame less
        self.segment.nodes.append((op, tuple(template), dict(kwargs), arefs, krefs, outs))

    def _bind(self, t: torch.Tensor) -> int:
        self.ids[id(t)] = len(self.keep)
        self.keep.append(t)
        return self.ids[id(t)]

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self._end()
        flat, spec, refs = self._flatten_refs((args, kwargs))
        out = fn(*args, **kwargs)
        self.signature.append(("break", fn.__name__))
        self.graph.items.append(_Break(fn, args, kwargs, (flat, spec, refs), self._bind_outputs(out)))
        self._begin()
        return out

    def finish(self, static: list[torch.Tensor]) -> BreakableGraph:
        g = self.graph
        g.env_size = len(self.keep)
        _plan_drops(g)
        g.static, g.static_ptrs = list(static), [t.data_ptr() for t in static]
        self.keep.clear()
        self.ids.clear()
        return g


def _signature(func: Any, tree: Any, out: Any) -> tuple:
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), str(x.dtype))
        return repr(x)

    return (_op_name(func), tuple(describe(x) for x in tree_flatten(tree)[0]),
            tuple(describe(x) for x in tree_flatten(out)[0]))


def _plan_drops(g: BreakableGraph) -> None:
    """Free each intermediate after its last use so replay memory stays like an eager forward's."""
    last: dict[int, tuple[int, int]] = {}
    for si, item in enumerate(g.items):
        if isinstance(item, _Break):
            for _, ref in item.resolve[2]:
                last[ref] = (si, -1)
        else:
            for ni, node in enumerate(item.nodes):
                for ref in [r for _, _, r in node[3]] + [r for _, r in node[4]]:
                    last[ref] = (si, ni)
    for item in g.items:
        if not isinstance(item, _Break):
            item.drops = [[] for _ in item.nodes]
    for ref, (si, ni) in last.items():
        if ni >= 0:
            g.items[si].drops[ni].append(ref)


def _resolve_break(item: _Break, env: list) -> tuple[tuple, dict]:
    if item.resolve is None:  # CUDA: arguments live at fixed addresses
        return item.args, item.kwargs
    flat, spec, refs = item.resolve
    flat = list(flat)
    for pos, ref in refs:
        flat[pos] = env[ref]
    return tree_unflatten(flat, spec)


def check_same_ops(first: list[tuple], second: list[tuple], bucket: int) -> None:
    """Two captures of one bucket with different batches must launch the same ops with the same shapes."""
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            raise GraphCaptureError(f"bucket {bucket}: op #{i} differs between two batches of the same bucket "
                                    f"({a[0]} vs {b[0]}): a shape or argument depends on the batch data")
    if len(first) != len(second):
        raise GraphCaptureError(f"bucket {bucket}: {len(first)} vs {len(second)} ops for two batches of the same "
                                f"bucket: control flow depends on the batch data")


# -- CUDA -------------------------------------------------------------------------------------------
class _CudaSegment:
    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph

    def replay(self, env: list) -> None:
        self.graph.replay()


class CudaCapture(_Capture):
    """Capture a forward as CUDA graphs, one per segment, in a pool shared across buckets."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph = BreakableGraph()
        self.stream = torch.cuda.Stream()
        self.current: Any = None
        self.signature: list[tuple] = []

    def __enter__(self) -> "CudaCapture":
        global _active
        torch.cuda.synchronize()
        gc.collect()
        gc.freeze()  # no Python gc (and no CUDA frees it triggers) in the middle of a capture
        self.stream.wait_stream(torch.cuda.current_stream())
        self._stream_ctx = torch.cuda.stream(self.stream)
        self._stream_ctx.__enter__()
        _active = self
        self._begin()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        global _active
        try:
            if exc_type is None:
                self._end()
            else:   # end the interrupted capture so the stream is usable; the original error propagates
                with contextlib.suppress(RuntimeError):
                    self._end()
                self.current = None
        finally:
            _active = None
            self._stream_ctx.__exit__(None, None, None)
            torch.cuda.current_stream().wait_stream(self.stream)
            gc.unfreeze()

    def _begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def _end(self) -> None:
        if self.current is not None:
            self.current.capture_end()
            self.graph.items.append(_CudaSegment(self.current))
            self.current = None

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self._end()
        out = fn(*args, **kwargs)
        self.signature.append(("break", fn.__name__))
        self.graph.items.append(_Break(fn, args, kwargs))
        self._begin()
        return out

    def finish(self, static: list[torch.Tensor]) -> BreakableGraph:
        g = self.graph
        g.static, g.static_ptrs = list(static), [t.data_ptr() for t in static]
        return g


class OpCounter(TorchDispatchMode):
    """Counts aten ops launched from the host: the host-launch counter used by ``graphcp bench``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))

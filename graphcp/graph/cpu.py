"""The CPU emulation of graph capture: it records every aten op of a segment with a dispatch mode and
replays the recorded op list without re-running Python. It enforces the CUDA capture rules so that they hold
on machines without a GPU: no host syncs, no data-dependent shapes, no constant tensors made in a segment.

It also keeps CUDA's semantics where they matter: a captured segment computes nothing until it is
replayed. The ops run while they are recorded (the recorder needs real tensors), but when a segment ends
every tensor it allocated is overwritten with garbage (NaN, huge integers), as the stale pool memory a
CUDA capture leaves. A break run at capture therefore sees real inputs only because the protocol replays
the just-captured segment first, exactly as the CUDA backend must.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graphcp.graph.cpu_pool import CpuPool, Slot, out_variant, place_in_pool
from graphcp.graph.protocol import (
    Break,
    BreakableGraph,
    Capture,
    GraphCaptureError,
    capture_active,
    check_break_outputs,
    host_slot,
    set_active,
)
from graphcp.profiling import no_profiler_ranges

# -- CPU emulation ---------------------------------------------------------------------------------
_SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select",
             "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
             "aten::is_nonzero", "aten::equal", "aten::allclose"}
_VIEW_LIKE = {"aten::_unsafe_view", "aten::_reshape_alias"}   # views without an alias annotation
_CONSTANT_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::_to_copy.from_host"}


def _caller() -> str:
    """The innermost frame outside torch and this file: where the offending op was written."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and not path.endswith("graph/cpu.py"):
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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


def _storages(args: tuple, kwargs: dict) -> set[int]:
    """Storage addresses of an op's tensor arguments (aten arguments nest one list deep at most)."""
    ptrs = set()
    for a in (*args, *kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, torch.Tensor):
                ptrs.add(x.untyped_storage().data_ptr())
    return ptrs


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
        self.drops: list[list[int]] = []      # planned at finish; none while capturing
        self.fresh: list[int] = []            # refs of the tensors this segment allocates
        self.planned: dict[int, tuple] = {}   # node -> (out= overload, its out names, output refs)
        self.views: set[int] = set()          # nodes whose op only makes views of its arguments
        self.names: list[str] = []            # the nodes' op names, as captured

    def replay(self, env: list) -> None:
        drops = self.drops or [()] * len(self.nodes)
        for (op, args, kwargs, arefs, krefs, outs), drop in zip(self.nodes, drops):
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


class CpuCapture(Capture):
    """Record a forward into a BreakableGraph of recorded-op segments and breaks."""

    def __init__(self, replay_before_break: bool = True, pool: CpuPool | None = None) -> None:
        self.replay_before_break = replay_before_break   # the protocol; False only to show why it is needed
        self.pool = pool if pool is not None else CpuPool()
        self.roots: dict[int, int] = {}        # storage address -> the fresh tensor owning it
        self.root_of: dict[int, int] = {}      # ref -> its storage's owner (views, break outputs)
        self.slots: dict[int, Slot] = {}       # refs replayed into the pool
        self.graph = BreakableGraph()
        self.ids: dict[int, int] = {}          # id(tensor made during capture) -> env index
        self.keep: list[torch.Tensor] = []     # keeps captured tensors alive so ids stay unique
        self.signature: list[tuple] = []
        self.segment: _CpuSegment | None = None
        self.mode: _Recorder | None = None

    def __enter__(self) -> "CpuCapture":
        if capture_active():
            raise GraphCaptureError("nested graph capture")
        self._quiet = no_profiler_ranges()
        self._quiet.__enter__()
        set_active(self)
        self._begin()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._end()          # leaves the recording mode, also after an error (which then propagates)
        finally:
            set_active(None)
            self._quiet.__exit__(None, None, None)

    def _begin(self) -> None:
        self.segment = _CpuSegment()
        self.mode = _Recorder(self)
        self.mode.__enter__()

    def _end(self) -> _CpuSegment | None:
        """Close the segment; its tensors now hold garbage, as after a CUDA capture."""
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        segment, self.segment = self.segment, None
        if segment is None or not segment.nodes:
            return None
        self.graph.items.append(segment)
        for ref in segment.fresh:
            _poison(self.keep[ref])
        return segment

    def _replay_into_capture(self, segment: _CpuSegment) -> None:
        """Replay a just-captured segment and leave its results where the capture-time tensors are."""
        env = list(self.keep)
        segment.replay(env)
        for ref in segment.fresh:
            self.keep[ref].copy_(env[ref])

    def _flatten_refs(self, tree: Any) -> tuple[list, Any, list[tuple[int, int]]]:
        flat, spec = tree_flatten(tree)
        refs = [(i, self.ids[id(x)]) for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and id(x) in self.ids]
        flat = [None if (isinstance(x, torch.Tensor) and id(x) in self.ids) else x for x in flat]
        return flat, spec, refs

    def _bind_outputs(self, out: Any) -> list[tuple[int, int]]:
        bound = [(pos, self._bind(t)) for pos, t in enumerate(tree_flatten(out)[0])
                 if isinstance(t, torch.Tensor) and id(t) not in self.ids]
        for _, ref in bound:          # a break's outputs are views of its arguments
            self.root_of[ref] = self.roots.get(self.keep[ref].untyped_storage().data_ptr(), -1)
        return bound

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
        schema = getattr(func, "_schema", None)
        name, inputs = _op_name(func), _storages(args, kwargs)
        ptrs = {ref: self.keep[ref].untyped_storage().data_ptr() for _, ref in outs}
        aliasing = schema is None or any(r.alias_info is not None for r in schema.returns)
        fresh = []
        if not aliasing:
            # New memory (not a view, not an in-place or out= result): garbage until replayed.
            fresh = [ref for ref, ptr in ptrs.items() if self.keep[ref]._base is None
                     and ptr not in inputs and ptr not in self.roots]
            self.segment.fresh.extend(fresh)
        self.roots.update((ptrs[ref], ref) for ref in fresh)
        self.root_of.update((ref, self.roots.get(ptr, -1)) for ref, ptr in ptrs.items())
        self._plan_node(func, out, outs, fresh)
        if (schema is not None and not schema.is_mutable and ptrs and set(ptrs.values()) <= inputs
                and (aliasing or name in _VIEW_LIKE)):
            # a view (reshape and to() only where they did not copy)
            self.segment.views.add(len(self.segment.nodes))
        op = getattr(func, "_op", func)      # the C++ op behind the OpOverload: one Python frame less
        self.segment.nodes.append((op, tuple(template), dict(kwargs), arefs, krefs, outs))
        self.segment.names.append(name)

    def _plan_node(self, func: Any, out: Any, outs: list, fresh: list[int]) -> None:
        """Replay this op through its out= overload into the pool where every output is fresh."""
        variant = out_variant(func)
        count = 1 if isinstance(out, torch.Tensor) else len(out or ())
        if variant is None or not outs or len(outs) != count or len(fresh) != count:
            return
        tensors = [self.keep[ref] for _, ref in outs]
        if any(t.device.type != "cpu" or t.untyped_storage().nbytes() == 0 for t in tensors):
            return
        node = len(self.segment.nodes)
        for (_, ref), t in zip(outs, tensors):
            self.slots[ref] = Slot(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
                                   t.untyped_storage().nbytes())
        self.segment.planned[node] = (variant[0], variant[1], [ref for _, ref in outs])

    def _bind(self, t: torch.Tensor) -> int:
        self.ids[id(t)] = len(self.keep)
        self.keep.append(t)
        return self.ids[id(t)]

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        segment = self._end()
        if segment is not None and self.replay_before_break:
            self._replay_into_capture(segment)
        flat, spec, refs = self._flatten_refs((args, kwargs))
        out = fn(*args, **kwargs)
        check_break_outputs(fn, args, kwargs, out)
        self.signature.append(("break", fn.__name__))
        self.graph.items.append(Break(fn, args, kwargs, (flat, spec, refs), self._bind_outputs(out),
                                      host_slot(fn, args, kwargs)))
        self._begin()
        return out

    def finish(self, static: list[torch.Tensor]) -> BreakableGraph:
        g = self.graph
        g.env_size = len(self.keep)
        place_in_pool(g, self.slots, self.root_of, self.pool)
        _plan_drops(g)
        g.static, g.static_ptrs = list(static), [t.data_ptr() for t in static]
        for item in g.items:     # replays resolve breaks by ``resolve``: drop the capture's tensors
            if isinstance(item, Break):
                item.args, item.kwargs = (), {}
        self.keep.clear()
        self.ids.clear()
        return g


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(min(1 << 40, torch.iinfo(t.dtype).max))


def _signature(func: Any, tree: Any, out: Any) -> tuple:
    """What must agree between two captures of a bucket: the op, its arguments' shapes and dtypes
    and its other arguments' values (a plain walk: pytree's costs a capture more than the op)."""
    def describe(x: Any, acc: list) -> list:
        if isinstance(x, torch.Tensor):
            acc.append(("T", tuple(x.shape), str(x.dtype)))
        elif isinstance(x, (list, tuple)):
            for y in x:
                describe(y, acc)
        elif isinstance(x, dict):
            for y in x.values():
                describe(y, acc)
        else:
            acc.append(repr(x))
        return acc

    return _op_name(func), tuple(describe(tree, [])), tuple(describe(out, []))


def _plan_drops(g: BreakableGraph) -> None:
    """Free each intermediate after its last use so replay memory stays like an eager forward's."""
    last: dict[int, tuple[int, int]] = {}
    for si, item in enumerate(g.items):
        if isinstance(item, Break):
            for _, ref in item.resolve[2]:
                last[ref] = (si, -1)
        else:
            for ni, node in enumerate(item.nodes):
                for ref in [r for _, _, r in node[3]] + [r for _, r in node[4]]:
                    last[ref] = (si, ni)
    for item in g.items:
        if not isinstance(item, Break):
            item.drops = [[] for _ in item.nodes]
    for ref, (si, ni) in last.items():
        if ni >= 0:
            g.items[si].drops[ni].append(ref)

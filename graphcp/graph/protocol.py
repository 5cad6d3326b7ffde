"""The breakable-graph protocol: captured segments replayed from fixed buffers, with eager breaks between.

A function decorated with ``graph_break`` (an attention kernel that needs host arguments, a collective that
cannot be captured) ends the current segment when called during a capture, runs eagerly, and at replay runs
again eagerly with live arguments, writing into a caller-provided output buffer: every tensor it returns
must share storage with one of its arguments (a fresh tensor would be freed memory at a CUDA replay).

A capture backend (``graph/cpu.py``, ``graph/cuda.py``) implements ``run_break`` and ``finish``; both fill a
``BreakableGraph`` whose ``replay`` is shared. A break that takes host data of the batch names that
argument (``host_arg``); a replay passes the live batch's value, which replaces it by name, so a break
always sees the batch it serves.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcp.profiling import active_counter, nvtx_range, paused


class GraphCaptureError(RuntimeError):
    """A capture rule was broken inside a segment; the bucket must run eagerly."""


class PeerFailed(RuntimeError):
    """Another rank's warmup or capture failed: this rank stops its own at the next agreement."""


class Capture:
    """A capture backend. Entering it makes it the active capture that ``graph_break`` reports to."""

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def finish(self, static: list[torch.Tensor]) -> "BreakableGraph":
        raise NotImplementedError

    def before_collective(self) -> None:
        """A collective is about to be issued outside a break (NCCL's, captured in the graph)."""


_active: Capture | None = None


def set_active(capture: Capture | None) -> None:
    global _active
    _active = capture


def capture_active() -> bool:
    return _active is not None


def collective_point() -> None:
    """Called just before a collective that is not a graph break (NCCL's): an eager warmup agrees
    with its peers here that every rank still runs (``BreakLog``), so a rank that failed is never
    waited for inside the collective. Outside a warmup or capture, and inside breaks: nothing."""
    capture = _active
    if capture is None:
        return
    set_active(None)                   # the agreement's own collective is not a collective point
    try:
        capture.before_collective()
    finally:
        set_active(capture)


def graph_break(fn: Callable | None = None, *, collective: bool = False, host_arg: str | None = None) -> Callable:
    """Mark ``fn`` as a break point. It must write its result into an argument, not return new memory.
    ``collective``: ``fn`` is a collective its peers must meet (a rank whose capture fails still issues it,
    see ``BreakLog.drain``). ``host_arg``: the parameter that takes the batch's host data, replaced at
    replay by the live batch's."""
    if fn is None:
        return functools.partial(graph_break, collective=collective, host_arg=host_arg)
    fn.graphcp_collective = collective
    fn.graphcp_host_arg = host_arg

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        capture = _active
        if capture is None:
            return fn(*args, **kwargs)
        set_active(None)                       # a break runs eagerly, breaks nested inside it too
        try:
            return capture.run_break(fn, args, kwargs)
        finally:
            set_active(capture)

    return wrapper


class BreakLog(Capture):
    """An eager run that records its breaks: the sequence of collectives every pass of a capture issues.
    When a rank's capture fails partway, ``drain`` issues the collectives its peers still wait for, so
    every rank reaches the end of the capture and the agreement on the bucket with matched collectives.

    With ``agree`` (an all-rank AND), every rank agrees before each collective (a collective break,
    or an NCCL collective's ``collective_point``) that all are still running: a rank whose warmup
    fails calls ``agree(False)`` once instead of its next collective, and its peers, meeting that
    agreement, stop with ``PeerFailed``, so no collective is left unmatched."""

    def __init__(self, agree: Callable[[bool], bool] | None = None) -> None:
        self.calls: list[tuple[Callable, tuple, dict]] = []
        self.agree = agree

    def __enter__(self) -> "BreakLog":
        set_active(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_active(None)

    def run_break(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if getattr(fn, "graphcp_collective", False):
            self.before_collective()
        self.calls.append((fn, args, kwargs))
        return fn(*args, **kwargs)

    def before_collective(self) -> None:
        if self.agree is not None and not self.agree(True):
            raise PeerFailed("another rank's eager warmup failed")

    def drain(self, done: int, passes_left: int) -> None:
        """Issue the logged collectives after the first ``done`` breaks, then ``passes_left`` more passes'
        worth (on the warmup's own buffers: the values do not matter, only that peers are met)."""
        pending = self.calls[done:] + self.calls * passes_left
        for fn, args, kwargs in pending:
            if getattr(fn, "graphcp_collective", False):
                fn(*args, **kwargs)


def host_slot(fn: Callable, args: tuple, kwargs: dict) -> tuple[str, int | str] | None:
    """Where a break's named host argument sits in this call: ("pos", index) or ("kw", name)."""
    name = getattr(fn, "graphcp_host_arg", None)
    if name is None:
        return None
    if name in kwargs:
        return "kw", name
    index = list(inspect.signature(fn).parameters).index(name)
    if index >= len(args):
        raise GraphCaptureError(f"break {fn.__name__} was called without its host argument {name!r}")
    return "pos", index


def check_break_outputs(fn: Callable, args: tuple, kwargs: dict, out: Any) -> None:
    """Every tensor a break returns must live in one of its arguments' storage: at a CUDA replay the
    graph reads the break's output where the capture left it, so fresh memory would be freed by then."""
    storages = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
            raise GraphCaptureError(f"break {fn.__name__} returned a tensor that is not (a view of) one of its "
                                    "arguments; breaks must write into a caller-provided buffer")


def borrowed(t: torch.Tensor) -> torch.Tensor:
    """``t`` over the same memory without owning it (what torch's cudagraph trees use for outputs
    in a freed pool): the graph keeps reading and writing that address, the pool may hand it out."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device,
                                                           storage.nbytes())
    view = torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape,
                                                               t.stride())
    view.graphcp_borrowed = True
    return view


def borrow_break_args(g: "BreakableGraph") -> None:
    """A CUDA graph's breaks keep their device arguments as borrowed views, not owners. At replay
    every segment writes the addresses it wrote at capture, in the same order, so a break reads what
    it read then; once the capture ends, those pool blocks go back to the pool shared by every
    bucket (buckets replay one at a time), instead of each bucket holding its breaks' arguments
    for the engine's life (GBs at 80 layers x 11 buckets). Host tensors are kept as they are."""
    for item in g.items:
        if isinstance(item, Break):
            flat, spec = tree_flatten((item.args, item.kwargs))
            flat = [borrowed(t) if isinstance(t, torch.Tensor) and t.device.type != "cpu" else t
                    for t in flat]
            item.args, item.kwargs = tree_unflatten(flat, spec)


def held_storages(g: "BreakableGraph") -> dict[int, int]:
    """{storage address: bytes} of every tensor a graph's breaks own a reference to (borrowed views
    own nothing): what the graph keeps alive besides its pool, the static inputs and the weights."""
    held: dict[int, int] = {}
    for item in g.items:
        if not isinstance(item, Break):
            continue
        trees = [(item.args, item.kwargs)] + ([item.resolve[0]] if item.resolve else [])
        for t in tree_flatten(trees)[0]:
            if isinstance(t, torch.Tensor) and not getattr(t, "graphcp_borrowed", False):
                storage = t.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
    return held


@dataclass
class Break:
    fn: Callable
    args: tuple
    kwargs: dict
    resolve: tuple | None = None              # CPU: (flat args, treespec, [(position, env index)])
    outs: list = field(default_factory=list)  # CPU: [(output position, env index)]
    host: tuple | None = None                 # where the named host argument sits (``host_slot``)


@dataclass
class BreakableGraph:
    items: list = field(default_factory=list)          # segments (with .replay(env)) and Breaks
    static: list[torch.Tensor] = field(default_factory=list)
    static_ptrs: list[int] = field(default_factory=list)
    env_size: int = 0                                    # CPU: intermediates a replay holds
    pool_bytes: int = 0                                  # CPU: the arena its replays write into

    @property
    def num_segments(self) -> int:
        return sum(not isinstance(i, Break) for i in self.items)

    @property
    def num_breaks(self) -> int:
        return sum(isinstance(i, Break) for i in self.items)

    def replay(self, host: Any = None) -> None:
        """Run every segment and break in order; ``host`` replaces each break's named host argument. Under
        an active host-op counter a segment counts as one launch; a break's ops count one by one."""
        for t, ptr in zip(self.static, self.static_ptrs):
            if t.data_ptr() != ptr:
                raise GraphCaptureError("a static buffer moved after capture; graphs read fixed addresses")
        env: list = [None] * self.env_size
        counter = active_counter()
        for item in self.items:
            if isinstance(item, Break):
                with nvtx_range(f"break:{item.fn.__name__}"):
                    args, kwargs = _resolve_break(item, env, host)
                    out = item.fn(*args, **kwargs)
                    if item.outs:
                        flat_out = tree_flatten(out)[0]
                        for pos, ref in item.outs:
                            env[ref] = flat_out[pos]
            else:
                with paused(counter):
                    item.replay(env)
                if counter is not None:
                    counter.count += 1


def _resolve_break(item: Break, env: list, host: Any) -> tuple[tuple, dict]:
    if item.resolve is None:  # CUDA: tensor arguments live at fixed addresses
        args, kwargs = item.args, item.kwargs
    else:
        flat, spec, refs = item.resolve
        flat = list(flat)
        for pos, ref in refs:
            flat[pos] = env[ref]
        args, kwargs = tree_unflatten(flat, spec)
    if item.host is None or host is None:
        return args, kwargs
    where, key = item.host
    if where == "kw":
        return args, {**kwargs, key: host}
    return args[:key] + (host,) + args[key + 1:], kwargs


def check_same_ops(first: list[tuple], second: list[tuple], bucket: int) -> None:
    """Two captures of one bucket with different batches must launch the same ops with the same shapes."""
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            raise GraphCaptureError(f"bucket {bucket}: op #{i} differs between two batches of the same "
                                    f"bucket ({a[0]} vs {b[0]}): a shape or argument depends on the batch data")
    if len(first) != len(second):
        raise GraphCaptureError(f"bucket {bucket}: {len(first)} vs {len(second)} ops for two batches of the "
                                f"same bucket: control flow depends on the batch data")

"""Static memory for CPU replays, as a CUDA graph's private pool: a replay writes every
intermediate it can into fixed arena memory planned at capture, instead of allocating.

On CUDA a replay allocates nothing: each kernel writes where the capture's allocations were. The
CPU emulation matches that: an op with an ``out=`` overload replays through it into a slot of the
runner's arena; slots are reused once their tensor (and every view of it) is past its last use,
so the arena holds about an eager forward's peak of live activations. One arena serves every
bucket of a runner (one replays at a time), and the largest bucket is captured first, so it is
sized once. A replay's intermediates hold whatever the last replay left, as on CUDA, and a replay
skips the allocator (against allocating replays: -3% to +7% at 256-4K tokens, within noise here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphcp.graph.protocol import Break, BreakableGraph

_ALIGN = 64                       # bytes: torch's CPU allocations are 64-byte aligned too
_OUT_VARIANTS: dict[Any, tuple | None] = {}


def out_variant(func: Any) -> tuple | None:
    """(the ``out=`` overload of a functional aten op, its out argument names), or None where the op
    is a view, mutates, returns anything but tensors, or has no overload with its arguments."""
    if func in _OUT_VARIANTS:
        return _OUT_VARIANTS[func]
    found = None
    schema = getattr(func, "_schema", None)
    packet = getattr(func, "overloadpacket", None)
    if (schema is not None and packet is not None and not schema.is_mutable and schema.returns
            and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)):
        want = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
        for name in packet.overloads():
            cand = getattr(packet, name)
            args = cand._schema.arguments
            outs = [a.name for a in args if a.is_out]
            rest = [(a.name, str(a.type), a.kwarg_only) for a in args if not a.is_out]
            if len(outs) == len(schema.returns) and rest == want:
                found = (cand, outs)
                break
    _OUT_VARIANTS[func] = found
    return found


@dataclass
class Slot:
    """A planned output: its dtype, shape, strides and storage offset as captured."""
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    storage_offset: int
    nbytes: int                   # of its storage
    offset: int = -1              # in the arena, once planned


class CpuPool:
    """One arena shared by a runner's CPU graphs."""

    def __init__(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The arena, grown to ``nbytes``; graphs planned on a smaller one keep it alive."""
        if nbytes > self.arena.numel():
            self.arena = torch.empty(nbytes, dtype=torch.uint8)
        return self.arena


def assign_offsets(slots: dict[int, Slot], births: dict[int, int], deaths: dict[int, int]) -> int:
    """Arena offsets for the slots (keyed by root ref): a slot's bytes are free again after the step
    of its last use (a step's outputs never share memory with its inputs). Exact-size reuse: a
    forward's layers repeat their shapes. Returns the arena size."""
    by_birth: dict[int, list[int]] = {}
    by_death: dict[int, list[int]] = {}
    for ref in slots:
        by_birth.setdefault(births[ref], []).append(ref)
        by_death.setdefault(max(deaths.get(ref, births[ref]), births[ref]), []).append(ref)
    free: dict[int, list[int]] = {}
    top = 0
    for step in sorted(set(by_birth) | set(by_death)):
        for ref in by_birth.get(step, ()):
            size = -(-slots[ref].nbytes // _ALIGN) * _ALIGN
            spare = free.get(size)
            if spare:
                slots[ref].offset = spare.pop()
            else:
                slots[ref].offset, top = top, top + size
        for ref in by_death.get(step, ()):
            size = -(-slots[ref].nbytes // _ALIGN) * _ALIGN
            free.setdefault(size, []).append(slots[ref].offset)
    return top


def view_of(arena: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The slot's tensor in the arena, with the captured shape, strides and storage offset."""
    itemsize = torch.empty(0, dtype=slot.dtype).element_size()
    start = slot.offset // itemsize + slot.storage_offset
    empty = torch.empty(0, dtype=slot.dtype)
    return empty.set_(arena.untyped_storage(), start, slot.shape, slot.stride)


def place_in_pool(g: BreakableGraph, slots: dict[int, Slot], root_of: dict[int, int],
                  pool: CpuPool) -> None:
    """Give every planned output an arena slot by liveness (a slot lives while any view of it is
    used), make its node write there through its out= overload, then fold what became constant."""
    births, deaths, step = {}, {}, 0
    for item in g.items:
        step += 1
        if isinstance(item, Break):
            for _, ref in item.resolve[2]:
                if root_of.get(ref, -1) >= 0:
                    deaths[root_of[ref]] = step
            continue
        for ni, node in enumerate(item.nodes):
            step += 1
            for ref in [r for _, _, r in node[3]] + [r for _, r in node[4]]:
                if root_of.get(ref, -1) >= 0:
                    deaths[root_of[ref]] = step
            for ref in item.planned.get(ni, (None, None, ()))[2]:
                births[ref] = step
    arena = pool.reserve(assign_offsets(slots, births, deaths))
    const: dict[int, torch.Tensor] = {}       # refs at a fixed address in every replay
    for item in g.items:
        if isinstance(item, Break):
            flat, spec, refs = item.resolve
            flat = list(flat)
            for pos, ref in refs:
                if ref in const:
                    flat[pos] = const[ref]
            item.resolve = (flat, spec, [(pos, ref) for pos, ref in refs if ref not in const])
            continue
        nodes, kept = [], []
        for ni, (op, args, kwargs, arefs, krefs, outs) in enumerate(item.nodes):
            args, kwargs = _bake(args, kwargs, arefs, krefs, const)
            arefs = [(i, j, ref) for i, j, ref in arefs if ref not in const]
            krefs = [(key, ref) for key, ref in krefs if ref not in const]
            if ni in item.planned:
                variant, names, refs = item.planned[ni]
                for name, ref in zip(names, refs):
                    kwargs[name] = const[ref] = view_of(arena, slots[ref])
                op, outs = variant._op, []
            elif ni in item.views and not arefs and not krefs:
                # A view of fixed memory is fixed too (shapes are static): made once, not replayed.
                out = op(*args, **kwargs)
                for pos, ref in outs:
                    const[ref] = out if pos < 0 else out[pos]
                continue
            nodes.append((op, args, kwargs, arefs, krefs, outs))
            kept.append(item.names[ni])
        item.nodes, item.names = nodes, kept
    g.pool_bytes = arena.numel()


def _bake(args: tuple, kwargs: dict, arefs: list, krefs: list,
          const: dict[int, torch.Tensor]) -> tuple[tuple, dict]:
    """The node's argument templates with its constant references filled in."""
    args, kwargs = list(args), dict(kwargs)
    for i, j, ref in arefs:
        if ref not in const:
            continue
        if j < 0:
            args[i] = const[ref]
        else:
            items = list(args[i])
            items[j] = const[ref]
            args[i] = tuple(items)
    for key, ref in krefs:
        if ref in const:
            kwargs[key] = const[ref]
    return tuple(args), kwargs

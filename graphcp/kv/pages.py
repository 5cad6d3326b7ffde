"""Page allocation and per-request page tables, on the host. Every rank makes the same decisions.

Models with per-request state (``kv/states.py``) also take state slots here, in the same
transaction: every request of a batch gets a spare slot that its new state is written to; commit
makes it the request's slot (freeing the old one), rollback frees it.

Page ids live in int64 numpy arrays (the free stack and each request's row), so a batch's page table
is filled without turning Python ints into tensors one by one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcp.errors import RequestError

_NO_PAGES = np.zeros(0, dtype=np.int64)
_NO_PAGES.flags.writeable = False        # shared by every new request (its pages are replaced, never written)


def _no_pages() -> np.ndarray:
    return _NO_PAGES


@dataclass(eq=False)
class RequestKV:
    pages: np.ndarray = field(default_factory=_no_pages)     # int64 page ids, in token order
    cached_len: int = 0
    state_slot: int = 0          # committed per-request state (0: none yet)
    next_state_slot: int = 0     # where the batch in flight writes it (0: no batch in flight)


def pages_per_request(max_context: int, page_size: int) -> int:
    """Pages of the longest request: the width of every page-table row."""
    return -(-max_context // page_size)


class PageTable:
    """Owns the free pages (page 0 is reserved for the dummy slot) and each rid's pages."""

    def __init__(self, num_pages: int, page_size: int, max_context: int,
                 state_slots: int = 0) -> None:
        self.page_size = page_size
        self.state_slots = state_slots
        self._free_states = list(range(state_slots, 0, -1))     # a stack: slot 1 handed out first
        self.max_context = max_context
        # A stack: the top (the end) is handed out first, low page ids first.
        self._free = np.arange(num_pages - 1, 0, -1, dtype=np.int64)
        self._top = num_pages - 1
        self.total_pages = num_pages - 1
        self.requests: dict[str, RequestKV] = {}

    @property
    def free_pages(self) -> list[int]:
        """The free stack, bottom first (the last entry is handed out next)."""
        return self._free[:self._top].tolist()

    @property
    def max_pages_per_request(self) -> int:
        return pages_per_request(self.max_context, self.page_size)

    @property
    def tokens_total(self) -> int:
        return self.total_pages * self.page_size

    @property
    def tokens_free(self) -> int:
        return self._top * self.page_size

    def prefix_len(self, rid: str) -> int:
        state = self.requests.get(rid)
        return state.cached_len if state else 0

    def pages_needed(self, rid: str, extend_len: int) -> int:
        state = self.requests.get(rid)
        cached, have = (state.cached_len, len(state.pages)) if state else (0, 0)
        return max(0, -(-(cached + extend_len) // self.page_size) - have)

    def check(self, rids: list[str], extend_lens: list[int]) -> list[int]:
        """Raise RequestError for the first request that cannot fit; changes nothing. Returns each
        request's cached prefix length (read here anyway)."""
        ps, limit = self.page_size, self.max_context
        states = list(map(self.requests.get, rids))
        if states.count(None) == len(states) and max(extend_lens, default=0) <= limit:
            # Fresh requests, the common prefill: no prefixes, ceil(n / ps) pages each.
            prefix, need = [0] * len(rids), sum([-(-n // ps) for n in extend_lens])
        else:
            prefix, need = self._check_each(rids, extend_lens, states)
        if need > self._top:
            raise RequestError(f"request {rids[-1]!r}: the batch needs {need * self.page_size} KV tokens, "
                               f"only {self.tokens_free} of the pool's {self.tokens_total} are free; "
                               "release finished requests, or start the engine with a larger "
                               "--max-total-tokens (or --mem-fraction-static)")
        if self.state_slots and len(rids) > len(self._free_states):
            held = sum(1 for r in self.requests.values() if r.state_slot)
            first = rids[len(self._free_states)]
            raise RequestError(f"request {first!r}: no free per-request state slot ({held} "
                               "requests hold one, a batch writes each of its requests to a spare "
                               "one); release finished requests or raise --max-state-requests")
        return prefix

    def _check_each(self, rids: list[str], extend_lens: list[int], states: list
                    ) -> tuple[list[int], int]:
        need, ps, limit, prefix = 0, self.page_size, self.max_context, []
        for rid, n, state in zip(rids, extend_lens, states):
            cached, have = (state.cached_len, len(state.pages)) if state else (0, 0)
            prefix.append(cached)
            total = cached + n
            if total > limit:
                raise RequestError(f"request {rid!r}: {total} tokens exceed the context limit of {limit}")
            more = -(-total // ps) - have
            if more > 0:
                need += more
        return prefix, need

    def allocate(self, rids: list[str], extend_lens: list[int]) -> list[np.ndarray]:
        """Grow each request's pages for its new tokens; returns the undo list of new pages per request.
        The batch's pages leave the stack in one slice (top first, request by request)."""
        requests, ps, counts, states = self.requests, self.page_size, [], []
        for rid, n in zip(rids, extend_lens):
            state = requests.get(rid)
            if state is None:
                state = requests[rid] = RequestKV()
                counts.append(-(-n // ps))
            else:
                counts.append(max(0, -(-(state.cached_len + n) // ps) - len(state.pages)))
            states.append(state)
        total = sum(counts)
        block = self._free[self._top - total:self._top][::-1].copy()
        self._top -= total
        added, start = [], 0
        for state, k in zip(states, counts):
            new = block[start:start + k]
            start += k
            state.pages = np.concatenate((state.pages, new)) if len(state.pages) else new
            added.append(new)
        if self.state_slots:
            for state in states:
                state.next_state_slot = self._free_states.pop()
        return added

    def commit(self, rids: list[str], extend_lens: list[int]) -> None:
        for rid, n in zip(rids, extend_lens):
            state = self.requests[rid]
            state.cached_len += n
            if state.next_state_slot:
                self._free_state(state.state_slot)
                state.state_slot, state.next_state_slot = state.next_state_slot, 0

    def rollback(self, rids: list[str], added: list[np.ndarray]) -> None:
        """Undo ``allocate`` exactly, free-stack order included (last request first)."""
        states = [self.requests[rid] for rid in rids]
        if self.state_slots:
            for state in reversed(states):
                self._free_state(state.next_state_slot)
                state.next_state_slot = 0
        for rid, state, new in zip(rids, states, added):
            if len(new):
                state.pages = state.pages[:len(state.pages) - len(new)]
            if not len(state.pages) and state.cached_len == 0:
                del self.requests[rid]
        if added:
            self._push(np.concatenate(added))     # pushed reversed: the first page is on top again

    def release(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is None:
            raise RequestError(f"request {rid!r} is unknown: nothing to release")
        self._push(state.pages)
        self._free_state(state.state_slot)

    def _free_state(self, slot: int) -> None:
        if slot:
            self._free_states.append(slot)

    @property
    def state_slots_free(self) -> int:
        return len(self._free_states)

    def state_rows(self, rids: list[str]) -> tuple[list[int], list[int]]:
        """(the committed state slot each request reads, 0 for none; the slot its batch writes)."""
        requests = [self.requests[rid] for rid in rids]
        return [r.state_slot for r in requests], [r.next_state_slot for r in requests]

    def _push(self, pages: np.ndarray) -> None:
        """Return pages to the stack so that the first of them is handed out first again."""
        k = len(pages)
        self._free[self._top:self._top + k] = pages[::-1]
        self._top += k

    def rows(self, rids: list[str]) -> list[np.ndarray]:
        return [self.requests[rid].pages for rid in rids]

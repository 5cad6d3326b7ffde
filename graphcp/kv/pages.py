"""Page allocation and per-request page tables, on the host. Every rank makes the same decisions."""
from __future__ import annotations

from dataclasses import dataclass, field

from graphcp.errors import RequestError


@dataclass
class RequestKV:
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0


class PageTable:
    """Owns the free pages (page 0 is reserved for the dummy slot) and each rid's pages."""

    def __init__(self, num_pages: int, page_size: int, max_context: int) -> None:
        self.page_size = page_size
        self.max_context = max_context
        self.free_pages = list(range(num_pages - 1, 0, -1))  # pop() hands out low page ids first
        self.total_pages = num_pages - 1
        self.requests: dict[str, RequestKV] = {}

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def tokens_total(self) -> int:
        return self.total_pages * self.page_size

    @property
    def tokens_free(self) -> int:
        return len(self.free_pages) * self.page_size

    def prefix_len(self, rid: str) -> int:
        state = self.requests.get(rid)
        return state.cached_len if state else 0

    def pages_needed(self, rid: str, extend_len: int) -> int:
        state = self.requests.get(rid)
        have = len(state.pages) if state else 0
        total = self.prefix_len(rid) + extend_len
        return max(0, -(-total // self.page_size) - have)

    def check(self, rids: list[str], extend_lens: list[int]) -> None:
        """Raise RequestError for the first request that cannot fit; changes nothing."""
        need, ps, requests = 0, self.page_size, self.requests
        for rid, n in zip(rids, extend_lens):
            state = requests.get(rid)
            cached, have = (state.cached_len, len(state.pages)) if state else (0, 0)
            total = cached + n
            if total > self.max_context:
                raise RequestError(f"request {rid!r}: {total} tokens exceed the context limit of {self.max_context}")
            need += max(0, -(-total // ps) - have)
        if need > len(self.free_pages):
            raise RequestError(f"request {rids[-1]!r}: the batch needs {need * self.page_size} KV tokens, "
                               f"only {self.tokens_free} are free; release finished requests")

    def allocate(self, rids: list[str], extend_lens: list[int]) -> list[list[int]]:
        """Grow each request's pages for its new tokens; returns the undo list of new pages per request."""
        added = []
        for rid, n in zip(rids, extend_lens):
            state = self.requests.setdefault(rid, RequestKV())
            k = self.pages_needed(rid, n)
            new = self.free_pages[len(self.free_pages) - k:][::-1]   # what k pops would give, in one slice
            del self.free_pages[len(self.free_pages) - k:]
            state.pages.extend(new)
            added.append(new)
        return added

    def commit(self, rids: list[str], extend_lens: list[int]) -> None:
        for rid, n in zip(rids, extend_lens):
            self.requests[rid].cached_len += n

    def rollback(self, rids: list[str], added: list[list[int]]) -> None:
        """Undo ``allocate`` exactly, free-list order included (last request first)."""
        for rid, new in reversed(list(zip(rids, added))):
            state = self.requests[rid]
            del state.pages[len(state.pages) - len(new):]
            self.free_pages.extend(reversed(new))
            if not state.pages and state.cached_len == 0:
                del self.requests[rid]

    def release(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is None:
            raise RequestError(f"request {rid!r} is unknown: nothing to release")
        self.free_pages.extend(reversed(state.pages))

    def rows(self, rids: list[str]) -> list[list[int]]:
        return [self.requests[rid].pages for rid in rids]

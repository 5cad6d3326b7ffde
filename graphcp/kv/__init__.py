"""Paged KV cache: the pool tensors, the page allocator and per-request page tables."""
from graphcp.kv.cache import KVPool
from graphcp.kv.pages import PageTable, RequestKV

__all__ = ["KVPool", "PageTable", "RequestKV"]

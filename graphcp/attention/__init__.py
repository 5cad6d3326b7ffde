"""Attention: the paged varlen contract, its kernels (torch, Triton, flashinfer) and the per-layer op."""
from graphcp.attention.op import PagedAttention, resolve_kernel
from graphcp.attention.torch_ref import HostLengths, torch_paged_attention

__all__ = ["PagedAttention", "resolve_kernel", "HostLengths", "torch_paged_attention"]

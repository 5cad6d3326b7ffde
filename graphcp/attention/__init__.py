"""Attention: the paged varlen contract, its kernels (torch, Triton, flashinfer), the kernel registry
and the per-layer op."""

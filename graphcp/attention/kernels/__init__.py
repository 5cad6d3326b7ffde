"""Attention kernels behind one contract (see ``torch_paged_attention``): graphcp's Triton kernels and the
flashinfer glue. ``graphcp.attention.registry`` chooses among them and imports each lazily."""

"""Every kernel graphcp launches, in one folder: the paged attention kernels (torch reference, Triton,
flashinfer glue), the KV write, the DSA kernels, and the layer kernels (RMSNorm, RoPE, FP8 GEMM, MoE
experts). ``graphcp.kernels.registry`` chooses among them and imports each lazily."""

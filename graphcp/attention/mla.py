"""The dense MLA op (DeepSeek-V3 / R1, Kimi-K2) the layers call through the forward context:
``op(layer, q, mla_rows, kv_b)``.

Per layer: one all-gather of the new MLA rows ``[kv_latent | k_rope]`` over the CP group (padded
to the largest rank, rank-major), written at their slots on every rank (padding rows to the dummy
slot), as DSA's; then causal attention of this rank's queries over every visible row, in a graph
break that takes the batch's host maxima by name (``kernels/mla_torch.py``: expanded or absorbed
form, whichever costs less). Either layout serves: zigzag's early/late sequences and interleave's
per-token limits are the dense kernels' contract.
"""
from __future__ import annotations

import torch

from graphcp.attention.context import AttentionContext
from graphcp.cp.metadata import HostMaxima
from graphcp.graph.protocol import graph_break
from graphcp.kernels.mla_torch import MLAArgs, MLADims, mla_attention
from graphcp.models.deepseek.config import MLAConfig
from graphcp.models.deepseek.rope import softmax_scale
from graphcp.profiling import nvtx_range


@graph_break(host_arg="host")
def _mla_break(args: MLAArgs, host: HostMaxima) -> torch.Tensor:
    """Runs eagerly; a replay passes the live batch's ``host`` (its per-forward workspace)."""
    with nvtx_range("attention"):
        return mla_attention(args, host.workspace)


class MLAAttention:
    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx, self.meta, self.pool = ctx, ctx.meta, ctx.pool
        d = MLAConfig.of(ctx.cfg)
        self.dims = MLADims(d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim)
        self.scale = softmax_scale(ctx.cfg)

    def __call__(self, layer_id: int, q: torch.Tensor, mla_rows: torch.Tensor,
                 kv_b: torch.Tensor) -> torch.Tensor:
        """q [T, H, nope + rope] (RoPE applied), mla_rows [T, latent + rope], kv_b this rank's heads
        of ``kv_b_proj.weight`` -> attention output [T, H, v_head_dim]."""
        meta, pool = self.meta, self.pool
        pool.prepare(layer_id)      # LayerSplit: a non-owned layer's prefix comes from its owner
        pool.write(layer_id, "mla", meta.gather_slots, self.ctx.all_gather(mla_rows))
        out = q.new_empty(q.shape[0], q.shape[1], self.dims.value)
        args = MLAArgs(q, pool.part(layer_id, "mla"), kv_b, meta.cu_seqlens_q,
                       pool.map_pages(layer_id, meta.page_rows), meta.q_limits, out, pool.page_size,
                       self.scale, self.dims)
        return _mla_break(args, self.ctx.host)


__all__ = ["MLAAttention"]

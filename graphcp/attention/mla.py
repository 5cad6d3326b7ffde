"""The dense MLA op (DeepSeek-V3 / R1, Kimi-K2) the layers call through the forward context:
``op(layer, q, mla_rows, kv_b)``.

Per layer: one all-gather of the new MLA rows ``[kv_latent | k_rope]`` over the CP group (padded
to the largest rank, rank-major), written at their slots on every rank (padding rows to the dummy
slot), as DSA's; then causal attention of this rank's queries over every visible row. On CUDA the
Triton prefill (``kernels/triton_mla.py``: absorbed, online softmax over the paged latent rows, no
mask, captured in the graph) where its start-up check (``probe_mla``) passed; else, and on CPU, the
torch forms in a graph break that takes the batch's host maxima by name (``kernels/mla_torch.py``:
expanded or absorbed form, whichever costs less). Either layout serves: zigzag's early/late
sequences and interleave's per-token limits are the dense kernels' contract.
"""
from __future__ import annotations

import torch

from graphcp.attention.context import AttentionContext
from graphcp.cp.metadata import HostMaxima
from graphcp.graph.protocol import graph_break
from graphcp.kernels.mla_torch import MLAArgs, MLADims, mla_attention
from graphcp.kernels.registry import KernelChoices, chosen
from graphcp.models.config import ModelConfig
from graphcp.models.deepseek.config import MLAConfig
from graphcp.models.deepseek.rope import softmax_scale
from graphcp.profiling import nvtx_range


@graph_break(host_arg="host")
def _mla_break(args: MLAArgs, host: HostMaxima) -> torch.Tensor:
    """Runs eagerly; a replay passes the live batch's ``host`` (its per-forward workspace)."""
    with nvtx_range("attention"):
        return mla_attention(args, host.workspace)


def attend(args: MLAArgs, host: HostMaxima) -> torch.Tensor:
    """The Triton prefill where this rank's choices accepted it (capturable: no host length),
    else the torch forms in a graph break."""
    fn = chosen("mla_prefill")
    if fn is None:
        return _mla_break(args, host)
    with nvtx_range("attention"):
        return fn(args)


def probe_mla(choices: KernelChoices, cfg: ModelConfig, attn_tp: int, device: torch.device,
              dtype: torch.dtype) -> None:
    """Check the Triton prefill once at start (eagerly, before any capture) at the model's widths
    and this rank's heads: two sequences, one over a cached prefix, padding rows after them."""
    heads, d = cfg.num_attention_heads // attn_tp, MLAConfig.of(cfg)
    dims = MLADims(d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim)
    gen, page_size = torch.Generator().manual_seed(0), 16
    page_rows = torch.tensor([[1, 2], [3, 4]])
    limits = [20 + i for i in range(1, 6)] + [i for i in range(1, 12)] + [0] * 3
    q = torch.randn(19, heads, dims.nope + dims.rope, generator=gen)
    kv = torch.randn(5 * page_size, dims.latent + dims.rope, generator=gen)
    kv_b = torch.randn(heads * (dims.nope + dims.value), dims.latent, generator=gen) * 0.05

    def args() -> MLAArgs:
        return MLAArgs(q.to(device, dtype), kv.to(device, dtype), kv_b.to(device, dtype),
                       torch.tensor([0, 5, 16], device=device), page_rows.to(device),
                       torch.tensor(limits, device=device),
                       torch.empty(19, heads, dims.value, device=device, dtype=dtype), page_size,
                       softmax_scale(cfg), dims)

    choices.probe("mla_prefill", lambda fn: fn(args()), lambda: mla_attention(args()), dtype,
                  dims.latent)


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
        return attend(args, self.ctx.host)


__all__ = ["MLAAttention", "attend", "probe_mla"]

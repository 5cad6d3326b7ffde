"""Dense causal MLA over the paged rows ``[kv_latent | k_rope]`` in torch (SDPA), in the two forms
attention over a latent cache can take, chosen per group of sequences by their arithmetic:

- **expanded**: every visible row's latent goes through ``kv_b_proj`` into per-head keys
  ``[k_nope | k_rope]`` and values, then plain multi-head attention (head dim nope + rope, values
  v_head_dim). The expansion costs one GEMM per visible key; attention is cheap.
- **absorbed**: each head's no-RoPE query is multiplied into the latent space by its slice of
  ``kv_b_proj`` (W_UK), attention is one-KV-head MQA over the rows (head dim latent + rope, values
  the latent), and W_UV maps the latent outputs to values. No key is expanded; attention is wide.

A fresh prefill (queries = keys) is cheaper expanded (SGLang prefills MLA as MHA too); a short
chunk over a long cached prefix is cheaper absorbed (as decode). The contract is the dense paged
kernels' (``kernels/torch_ref.py``): sequences over the query rows, a page-table row and a causal
limit per query; rows past the last sequence are zeros. Host lengths are read here, so it runs in
a graph break.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.utils._pytree import register_dataclass

from graphcp.kernels.torch_ref import per_forward, sequence_layout

_SCORE_BYTES = 512 << 20          # at most this much fp32 attention scores per SDPA call


@dataclass(frozen=True)
class MLADims:
    latent: int      # kv_lora_rank
    rope: int        # qk_rope_head_dim
    nope: int        # qk_nope_head_dim
    value: int       # v_head_dim


@dataclass
class MLAArgs:
    q: torch.Tensor              # [T, H, nope + rope] this rank's queries (RoPE applied)
    kv_pool: torch.Tensor        # [slots, latent + rope] one layer's MLA rows
    kv_b: torch.Tensor           # [H * (nope + value), latent] this rank's heads of kv_b_proj
    cu_seqlens_q: torch.Tensor   # [S + 1]
    page_rows: torch.Tensor      # [S, P]
    q_limits: torch.Tensor       # [T]
    out: torch.Tensor            # [T, H, value] written in place
    page_size: int
    scale: float
    dims: MLADims


register_dataclass(MLAArgs)      # a graph break taking MLAArgs gets its tensors resolved at replay


def expanded_is_cheaper(sequences: int, max_q: int, max_kv: int, heads: int, d: MLADims) -> bool:
    """Multiply-adds of one padded group: attention (scores + values) per query-key pair and head,
    plus the expanded form's key expansion or the absorbed form's query absorption and value map."""
    pairs = sequences * max_q * max_kv * heads
    projection = heads * d.latent * (d.nope + d.value)
    absorbed = pairs * (2 * d.latent + d.rope) + sequences * max_q * projection
    expanded = pairs * (d.nope + d.rope + d.value) + sequences * max_kv * projection
    return expanded < absorbed


def mla_attention(args: MLAArgs, workspace: dict | None = None,
                  form: str | None = None) -> torch.Tensor:
    """``form``: "expanded" or "absorbed" for every group; None picks per group by cost."""
    d, out, heads = args.dims, args.out, args.q.shape[1]
    out.zero_()
    meta = (args.cu_seqlens_q, args.page_rows, args.q_limits)
    layout = per_forward(workspace, f"torch{args.page_size}", meta,     # shared with dense layers
                         lambda: sequence_layout(*meta, args.page_size))
    w = args.kv_b.view(heads, d.nope + d.value, d.latent)
    for q_idx, q_valid, _, slots, mask, limits, key_pos in layout:
        expanded = (expanded_is_cheaper(*q_idx.shape, slots.shape[1], heads, d) if form is None
                    else form == "expanded")
        kv = args.kv_pool[slots]                                         # [G, K, latent + rope]
        keys, values = _expand(kv, args.kv_b, heads, d) if expanded else (None, None)
        step = q_idx.shape[1] if mask is not None else max(
            1, _SCORE_BYTES // (4 * q_idx.shape[0] * heads * slots.shape[1]))
        for c in range(0, q_idx.shape[1], step):
            qi, qv = q_idx[:, c:c + step], q_valid[:, c:c + step]
            m = mask if mask is not None else \
                (key_pos[None, None, :] < limits[:, c:c + step, None])[:, None]
            q = args.q[qi]                                               # [G, q, H, nope + rope]
            if expanded:
                o = sdpa(q.transpose(1, 2), keys, values, attn_mask=m, scale=args.scale)
            else:
                o = _absorbed(q, kv, m, w, d, args.scale)
            o = o.transpose(1, 2)[qv]                                    # [G, H, q, value] -> rows
            out[qi[qv]] = o if o.dtype == out.dtype else o.to(out.dtype)
    return out


def _absorbed(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, w: torch.Tensor, d: MLADims,
              scale: float) -> torch.Tensor:
    """q [G, q, H, nope + rope] over rows kv [G, K, latent + rope] -> [G, H, q, value]. The heads
    share the one KV head, so they are folded into the query rows of one single-head call (an MQA
    call would repeat the keys per head)."""
    g, n, h = q.shape[:3]
    q_latent = torch.einsum("gqhn,hnc->ghqc", q[..., :d.nope], w[:, :d.nope])
    q = torch.cat([q_latent, q[..., d.nope:].transpose(1, 2)], dim=-1).reshape(g, 1, h * n, -1)
    mask = mask.expand(g, h, n, mask.shape[-1]).reshape(g, 1, h * n, -1)
    o = sdpa(q, kv[:, None], kv[:, None, :, :d.latent], attn_mask=mask, scale=scale)
    return torch.einsum("ghqc,hvc->ghqv", o.view(g, h, n, d.latent), w[:, d.nope:])


def _expand(kv: torch.Tensor, kv_b: torch.Tensor, heads: int,
            d: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [G, K, latent + rope] -> keys [G, H, K, nope + rope] and values [G, H, K, value]."""
    g, k = kv.shape[:2]
    kv_nope = torch.matmul(kv[..., :d.latent], kv_b.t()).view(g, k, heads, d.nope + d.value)
    k_rope = kv[:, :, None, d.latent:].expand(g, k, heads, d.rope)
    keys = torch.cat([kv_nope[..., :d.nope], k_rope], dim=-1)
    return keys.transpose(1, 2), kv_nope[..., d.nope:].transpose(1, 2)

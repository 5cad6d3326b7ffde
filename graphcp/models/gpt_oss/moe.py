"""gpt-oss's MoE block, HF weight names (``mlp.router``, ``mlp.experts``): a router with a bias
picks the top-k experts by logit and softmaxes over those k; each expert is a clamped SwiGLU with
biases. The releases hold the experts in MXFP4 (``*_blocks``, ``*_scales``): they stay 4-bit in
memory and the torch form dequantizes one expert per call; unquantized checkpoints hold them as
transformers does (``gate_up_proj`` [E, H, 2 I] with gate and up columns interleaved).

Either way a rank holds its experts as graphcp's experts do: ``gate_up_proj`` [E_local, 2 I_local,
...] gate rows first, then up rows, ``down_proj`` [E_local, H, ...], each expert split over the
expert-TP ranks along I (whole 32-value blocks when MXFP4)."""
from __future__ import annotations

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, shard_range
from graphcp.forward_context import current_moe_communicator
from graphcp.kernels.moe_torch import Biases, GatedActivation
from graphcp.kernels.mxfp4_torch import BLOCK, dequantize_mxfp4, fp4_table
from graphcp.models.common.moe import Experts
from graphcp.models.config import ModelConfig
from graphcp.models.gpt_oss.config import GptOssConfig


class TopKRouter(nn.Module):
    """-> (weights [N, k] in x's dtype, expert ids [N, k]): softmax over the k largest logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


class GptOssExperts(Experts):
    """This rank's experts with their biases (the down bias added on expert-TP rank 0 only: the
    ranks' partial sums add up to one expert output). MXFP4 experts keep the packed bytes
    (``gate_up_proj`` [E_local, 2 I_local, H / 2] uint8) and one scale byte per 32 values
    (``*_scales``)."""

    def __init__(self, cfg: ModelConfig, layer: int, ep: EPInfo) -> None:
        super().__init__(cfg, ep)
        family = GptOssConfig.of(cfg)
        self.activation = GatedActivation(family.swiglu_limit, family.swiglu_alpha, up_shift=1.0)
        self.quantized = layer in family.mxfp4_layers
        self.triton_form = not self.quantized      # the grouped GEMMs read no MXFP4
        self.adds_down_bias = ep.expert_tp_rank == 0
        per, hidden = self.num_local, cfg.hidden_size
        if self.quantized:       # the expert-TP slice in whole blocks
            self.slice = shard_range(self.inter, ep.expert_tp_size, ep.expert_tp_rank, BLOCK)
        inter = self.slice[1] - self.slice[0]
        if self.quantized:
            packed = dict(dtype=torch.uint8)
            self.gate_up_proj = _frozen(torch.empty(per, 2 * inter, hidden // 2, **packed))
            self.down_proj = _frozen(torch.empty(per, hidden, inter // 2, **packed))
            self.register_buffer("gate_up_proj_scales",
                                 torch.empty(per, 2 * inter, hidden // BLOCK, **packed))
            self.register_buffer("down_proj_scales",
                                 torch.empty(per, hidden, inter // BLOCK, **packed))
        else:
            self.gate_up_proj = _frozen(torch.empty(per, 2 * inter, hidden))
            self.down_proj = _frozen(torch.empty(per, hidden, inter))
        self.gate_up_proj_bias = _frozen(torch.empty(per, 2 * inter))
        self.down_proj_bias = _frozen(torch.empty(per, hidden))
        self.fp4_values: torch.Tensor | None = None     # MXFP4: the nibble table, made at load

    def biases(self) -> Biases:
        return self.gate_up_proj_bias, self.down_proj_bias if self.adds_down_bias else None

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple:
        """Local expert ``e``'s (gate_up, down, gate_up bias, down bias or None); MXFP4 weights
        dequantized for this call."""
        if self.quantized:
            gate_up = dequantize_mxfp4(self.gate_up_proj[e], self.gate_up_proj_scales[e],
                                       self.fp4_values, dtype)
            down = dequantize_mxfp4(self.down_proj[e], self.down_proj_scales[e],
                                    self.fp4_values, dtype)
        else:
            gate_up, down = self.gate_up_proj[e], self.down_proj[e]
        down_bias = self.down_proj_bias[e] if self.adds_down_bias else None
        return gate_up, down, self.gate_up_proj_bias[e], down_bias

    # -- loading ------------------------------------------------------------------------------
    def checkpoint_tensors(self, prefix: str, names: set[str], hidden: int) -> dict[str, tuple]:
        """The release's tensors (full shapes): MXFP4 blocks [E, rows, columns / 32, 16] and
        scales [E, rows, columns / 32] (rows the output features), or transformers' plain
        [E, in, out] weights; biases [E, out] either way."""
        experts, inter, per = self.num_experts, self.inter, BLOCK // 2
        out = {f"{prefix}.gate_up_proj_bias": (experts, 2 * inter),
               f"{prefix}.down_proj_bias": (experts, hidden)}
        if not self.quantized:
            return {**out, f"{prefix}.gate_up_proj": (experts, hidden, 2 * inter),
                    f"{prefix}.down_proj": (experts, inter, hidden)}
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            out[f"{prefix}.{name}_blocks"] = (experts, rows, cols // BLOCK, per)
            out[f"{prefix}.{name}_scales"] = (experts, rows, cols // BLOCK)
        return out

    @torch.no_grad()
    def load(self, prefix: str, names: set[str], read, take) -> None:
        """One expert at a time, this rank's experts and expert-TP slice only: gate and up rows
        come interleaved (gate, up, gate, ...) and are held gate rows first."""
        lo, hi = self.slice
        rows = slice(2 * lo, 2 * hi)            # the slice's interleaved gate/up rows
        for i in range(self.num_local):
            e = self.first + i
            if self.quantized:
                blocks = slice(lo // BLOCK, hi // BLOCK)
                self.gate_up_proj[i] = _split(take(f"{prefix}.gate_up_proj_blocks", (e, rows)))
                self.gate_up_proj_scales[i] = _split(take(f"{prefix}.gate_up_proj_scales",
                                                          (e, rows)))
                down = take(f"{prefix}.down_proj_blocks", (e, slice(None), blocks))
                self.down_proj[i] = down.flatten(1)
                self.down_proj_scales[i] = take(f"{prefix}.down_proj_scales",
                                                (e, slice(None), blocks))
            else:
                gate_up = take(f"{prefix}.gate_up_proj", (e, slice(None), rows))    # [H, 2 i]
                self.gate_up_proj[i] = _split(gate_up.t())
                self.down_proj[i] = take(f"{prefix}.down_proj", (e, slice(lo, hi))).t()
            self.gate_up_proj_bias[i] = _split(take(f"{prefix}.gate_up_proj_bias", (e, rows)))
            self.down_proj_bias[i] = take(f"{prefix}.down_proj_bias", e)
        if self.quantized:
            self.fp4_values = fp4_table(self.gate_up_proj.device)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _split(interleaved: torch.Tensor) -> torch.Tensor:
    """Rows gate0, up0, gate1, up1, ... (flattened past the row) as gate rows, then up rows."""
    flat = interleaved.flatten(1) if interleaved.dim() > 2 else interleaved
    return torch.cat((flat[0::2], flat[1::2]))


class GptOssMoE(nn.Module):
    """Router + experts; the forward context's MoE communicator decides where tokens meet them."""

    def __init__(self, cfg: ModelConfig, layer: int, ep: EPInfo) -> None:
        super().__init__()
        self.router = TopKRouter(cfg)
        self.experts = GptOssExperts(cfg, layer, ep)

    def fuse(self) -> None:
        """The experts are stored fused already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_moe_communicator().run(x, self.router, self.experts)

"""The decoder every family shares: embedding, a stack of layers, the final norm and the LM head;
pipeline stages build only their layers, the first the embedding, the last the norm and head. A family
gives its layers (``make_layer``), what every layer takes per forward (``position_inputs``: the llama
family's positions, DSA's cos/sin tables; ``layer_inputs`` when the token ids are needed too) and, if
its layers carry something else than (delta, residual) from layer to layer, how the stream starts,
reads and ends (``enter``/``stream``/``leave``: DeepSeek V4's hyper-connection streams). The default
layer is (norm, mixer, norm, FFN) with the residual add fused into the norm that follows it.

Heads and the vocabulary are split over the attention TP group (``tp``), MLP features over the FFN TP
group (``ffn_tp``, the whole TP world).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from graphcp.distributed.shards import EPInfo, TPInfo
from graphcp.models.common.layers import RMSNorm
from graphcp.models.common.linear import ColumnLinear, VocabEmbedding, vocab_logits
from graphcp.models.config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions: Any, delta: torch.Tensor, residual: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state is ``residual + delta`` (just ``delta`` before the first layer); each residual
        add happens inside the norm that follows it (one launch on CUDA). Returns (mlp output,
        residual); with ``rows`` (``keeps_rows`` layers), those rows' only."""
        if residual is None:
            residual, x = delta, self.input_layernorm(delta)
        else:
            x, residual = self.input_layernorm(delta, residual)
        if rows is None:
            x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        else:
            x = self.self_attn(positions, x, rows=rows)
            x, residual = self.post_attention_layernorm(x, residual.index_select(0, rows))
        return self.mlp(x), residual

    @property
    def keeps_rows(self) -> bool:
        return all(getattr(part, "keeps_rows", False) for part in (self.self_attn, self.mlp))

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, layers: dict[int, DecoderLayer]) -> None:
        super().__init__()
        first, last = min(layers) == 0, max(layers) == cfg.num_hidden_layers - 1
        if first:
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # Keyed by the global index, so names stay "model.layers.{i}.*" on every pipeline stage.
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """A family subclasses this with ``make_layer`` and, optionally, ``position_inputs``."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, layers: range | None = None,
                 ffn_tp: TPInfo | None = None, ep: EPInfo | None = None) -> None:
        super().__init__()
        tp = tp or TPInfo()
        self.config, self.tp = cfg, tp
        self.layer_range = layers if layers is not None else range(cfg.num_hidden_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_hidden_layers
        self.rotary = self.make_rotary(cfg)
        built = {i: self.make_layer(cfg, i, tp, ffn_tp or tp, ep or EPInfo()) for i in self.layer_range}
        self.model = Backbone(cfg, tp, built)
        if self.is_last and not (cfg.tie_word_embeddings and self.is_first):
            # Untied, or tied on a last stage without the embedding: the head loads its own vocab shard.
            self.lm_head = ColumnLinear(cfg.hidden_size, cfg.vocab_size, False, tp)

    # -- what a family gives --------------------------------------------------------------------
    def make_rotary(self, cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    def make_layer(self, cfg: ModelConfig, layer: int, tp: TPInfo, ffn_tp: TPInfo, ep: EPInfo) -> DecoderLayer:
        raise NotImplementedError

    def position_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What each layer's mixer takes for this rank's token positions."""
        return positions

    def layer_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                     dtype: torch.dtype) -> Any:
        """What every layer takes besides the stream, once per forward."""
        return self.position_inputs(positions, dtype)

    def enter(self, hidden: torch.Tensor) -> tuple:
        """The state layers pass on, from the embedding (or a previous stage's hidden state)."""
        return hidden, None

    def stream(self, state: tuple) -> torch.Tensor:
        """The residual stream of a state (what a speculative draft reads entering a layer)."""
        delta, residual = state
        return delta if residual is None else residual + delta

    def leave(self, state: tuple) -> torch.Tensor:
        """The hidden state after the last layer, before the final norm."""
        return self.stream(state)

    def prunes_last_layer(self) -> bool:
        """Whether ``forward(output_rows=...)`` runs the model's last layer for those rows only: the
        default layer and stream, with a mixer and FFN that keep rows. Every token's K/V is cached
        all the same; only the last layer's attention output and FFN of the other tokens are
        skipped, which nothing reads (llama.cpp skips them too)."""
        if not self.is_last or type(self).enter is not DecoderLM.enter:
            return False
        last = self.model.layers[str(self.config.num_hidden_layers - 1)]
        return type(last).forward is DecoderLayer.forward and last.keeps_rows

    # -- the shared forward ---------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden: torch.Tensor | None = None,
                capture_layers: Sequence[int] | None = None, output_rows: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, list]:
        """Residual stream for this rank's tokens after this stage's layers, before the final norm. With
        ``capture_layers`` (ids of this stage's layers), also the residual stream entering each of them, in
        that order (HF's ``hidden_states[i]``; speculative drafts read them). With ``output_rows``
        (where ``prunes_last_layer``), the stream at those rows only."""
        first = self.model.embed_tokens(input_ids) if hidden is None else hidden
        inputs = self.layer_inputs(input_ids, positions, first.dtype)
        state, captured = self.enter(first), {}
        last = str(self.config.num_hidden_layers - 1) if output_rows is not None else None
        for i, layer in self.model.layers.items():
            if capture_layers is not None and int(i) in capture_layers:
                captured[int(i)] = self.stream(state)
            state = layer(inputs, *state) if i != last else layer(inputs, *state, rows=output_rows)
        out = self.leave(state)
        return out if capture_layers is None else (out, [captured[i] for i in capture_layers])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (last stage), applied only to the rows that need logits."""
        head = self.lm_head if hasattr(self, "lm_head") else self.model.embed_tokens
        return vocab_logits(self.model.norm(hidden), head.weight, self.tp, self.config.vocab_size).float()

    def fuse_projections(self) -> None:
        """After loading: projections that share an input become one GEMM where the family fuses them."""
        for layer in self.model.layers.values():
            layer.fuse()

    def source_name(self, name: str) -> str:
        """The checkpoint tensor a parameter loads from (a tied head reads the embedding)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

"""Multi-token prediction (MTP) as Fast-LLM trains it: parallel heads on the input of the last decoder layer.

With s_t the input of the model's last decoder layer at position t (the residual stream after layer N - 2: "the
trunk", which the last layer and the next-token head read), MTP layer d (d = 1..D, config.num_mtp_layers; Fast-LLM's
`prediction_heads` = D + 1 counts the next-token head too) computes

    y^d   = block_d(s)                     (a copy of the last decoder layer's block: its mixer, MLP and settings,
                                            causal over the trunk of the earlier positions, with a cache of its own)
    g^d_t = norm_d(y^d_t),   logits = lm_head(g^d_t)    (predicting token t + d + 1; the LM head shared, as
                                                          Fast-LLM ties every head's output weight)

as Fast-LLM's `MultiTokenPrediction` does (fast_llm/layers/language_model/multi_token_prediction.py: its blocks are
`decoder.last_block_config` layers fed the last block's input, its heads a final norm each and the tied output
weight). The layers are independent: none reads another's output, nor a token embedding (Qwen3-Next's layers chain
them: mtp_head.py). Checkpoint names: `mtp.layers.{d-1}.*` (this family's decoder layer names) and
`mtp.norms.{d-1}.weight` (Fast-LLM: `multi_token_prediction.blocks.{d-1}.*`, `multi_token_prediction.heads.{d-1}.
final_norm.weight`). Every norm is the final norm's kind and epsilon (Fast-LLM's head normalization).

Training: the MTP loss is the mean over d of the cross-entropy of token t + d + 1 (`depths`, the same targets as
Qwen3-Next's layers at depth d). Drafting (mtp_parallel_drafting.py): at the last accepted position t, the
model's own head gives token t + 1 and layer d drafts token t + d + 1; all D drafts come from one pass of the layers
over the positions the model accepted, so nothing is drafted from a draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
)

from .cache_hybrid_linear import past_length
from .configuration_hybrid_linear import HybridLinearConfig, repeated_layer_config
from .fp8_layers import quantize_modules
from .mixer_attention import RotaryTables
from .mixer_registry import MIXERS
from .mtp_head import MTP_ATTRIBUTE
from .norms import HybridLinearRMSNorm
from .sequence_info import SequenceInfo, build_sequence_info


def parallel_mtp_config(config: HybridLinearConfig) -> HybridLinearConfig:
    """The config the MTP layers are built from: `num_mtp_layers` copies of the model's last layer (its mixer, its
    MLP and its per-layer settings), each with its own layer index (its own cache layer)."""
    head = repeated_layer_config(config, config.num_hidden_layers - 1, config.num_mtp_layers)
    head.block_fp8 = None  # (the heads quantize their own modules under their "mtp." names)
    return head


def trunk_index(config: HybridLinearConfig) -> int:
    """The index of the trunk, the last decoder layer's input, among transformers' hidden states (the embeddings,
    then each layer's output): the output of layer N - 2."""
    return config.num_hidden_layers - 1


class HybridLinearParallelMtpHeads(nn.Module):
    """Fast-LLM's MTP layers (see the module docstring). `decoder_layer(config, index)` builds a decoder block;
    `rotary(settings)` the rotary embedding of an attention layer's settings."""

    reads = "trunk"  # the input of the last decoder layer (Qwen3-Next's layers read the final norm's output)
    marker = "mtp.norms.0.weight"  # a tensor only this kind of head has (mtp_head.check_mtp_kind)
    one_draft_per_layer = True  # layer d drafts token t + d + 1 (Qwen3-Next's one layer is applied recursively)

    def __init__(self, config: HybridLinearConfig, decoder_layer: Callable[[HybridLinearConfig, int], nn.Module],
                 rotary: Callable[[object], nn.Module]):
        super().__init__()
        self.config = parallel_mtp_config(config)
        count = config.num_mtp_layers
        final_eps = config._getattr_without_heterogeneous_validation("rms_norm_eps")  # the final norm's
        self.layers = nn.ModuleList(decoder_layer(self.config, index) for index in range(count))
        self.norms = nn.ModuleList(HybridLinearRMSNorm(config.hidden_size, final_eps, config.zero_centered_norms)
                                   for _ in range(count))
        spec = MIXERS[self.config.mixer_types[0]]
        settings = spec.rotary_settings(self.config.per_layer_config[0]) if spec.state == "kv" else None
        self.rotary_emb = rotary(settings) if settings is not None else None
        quantize_modules(self, MTP_ATTRIBUTE + ".", config.block_fp8_settings)

    def forward(self, trunk: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Cache | None = None, sequence_info: SequenceInfo | None = None) -> list[torch.Tensor]:
        """Every MTP layer over T positions: trunk [B, T, H] (the last decoder layer's input), position_ids [B or 1,
        T]; attention_mask: the 2-D padding mask over the cache's tokens and these, the 4-D additive mask [B, 1, T,
        cache slots] of a cache that keeps its own bookkeeping (a VerifyCache, whose caller gives `sequence_info`,
        the real tokens), or None. Returns g^1..g^D, each [B, T, H]."""
        batch, length = trunk.shape[:2]
        kv = self.layers[0].mixer_state == "kv"
        mask = attention_mask if kv and attention_mask is not None and attention_mask.dim() == 4 else None
        if kv and mask is None:
            mask = self._causal_mask(trunk, attention_mask, cache, position_ids)
        if sequence_info is None:
            plain = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
            sequence_info = build_sequence_info(batch, length, plain, None, has_past=past_length(cache) > 0)
        tables = None
        if self.rotary_emb is not None:
            tables = self.rotary_emb(trunk, position_ids)
            tables = tables if torch.compiler.is_compiling() else RotaryTables(pair=tables)
        return [norm(layer(trunk, position_embeddings=tables, attention_mask=mask, sequence_info=sequence_info,
                           cache=cache, position_ids=position_ids))
                for layer, norm in zip(self.layers, self.norms)]

    def _causal_mask(self, trunk: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None,
                     position_ids: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of the layers (one for all: they are copies), from the 2-D padding mask or None."""
        kwargs = {"inputs_embeds": trunk, "attention_mask": attention_mask, "cache": cache,
                  "position_ids": position_ids}
        if self.config.layer_types[0] == "sliding_attention":
            return create_sliding_window_causal_mask(config=self.config.per_layer_config[0], layer_idx=0, **kwargs)
        return create_causal_mask(config=self.config, **kwargs)

    def depths(self, trunk: torch.Tensor, embeddings: torch.Tensor | None, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training's outputs over a whole sequence, as Qwen3-Next's layers give them (mtp_head.py): g^d [B, T - d,
        H] at positions t = 0..T-1-d (predicting token t + d + 1), for the depths with a target (T >= d + 2), from
        the trunk [B, T, H]; `embeddings` is not read (the heads take no token embedding: None will do);
        attention_mask the 2-D [B, T] one or None."""
        length = trunk.shape[1]
        if length < 3:  # (no depth has a target: token t + d + 1 lies past the sequence for every t)
            return []
        outputs = self(trunk, position_ids, attention_mask)
        return [g[:, : length - depth] for depth, g in enumerate(outputs, start=1) if length > depth + 1]


def _chosen(asked: bool | int | list[int] | None, count: int) -> set[int]:
    """The indices, of `count` hidden states, that an `output_hidden_states` selection other than True names (an
    index or a list of them, negative ones from the end; anything falsy names none)."""
    picks = [] if not asked else [asked] if isinstance(asked, int) else asked
    return {i % count for i in picks if -count <= i < count}


def with_hidden_state(asked: bool | int | list[int] | None, index: int, count: int) -> bool | list[int]:
    """transformers' `output_hidden_states` selection that also selects hidden state `index` of `count` (how the
    training forward gets the trunk: `trunk_index`), from the caller's `asked` (anything falsy, as transformers
    reads it, asks for none)."""
    if asked is True:
        return True
    return sorted(_chosen(asked, count) | {index})


def hidden_states_asked(hidden_states: tuple | None, asked: bool | int | list[int] | None,
                        index: int) -> tuple | None:
    """The hidden states the caller asked for (`asked`), from those selected by `with_hidden_state`: none, or the
    trunk's entry left empty where the caller's selection did not name it."""
    if not asked or hidden_states is None:
        return None
    if asked is True:
        return hidden_states
    chosen = _chosen(asked, len(hidden_states))
    return tuple(None if i == index and i not in chosen else state for i, state in enumerate(hidden_states))


__all__ = ["HybridLinearParallelMtpHeads", "hidden_states_asked", "parallel_mtp_config", "trunk_index",
           "with_hidden_state"]

"""Multi-token prediction (MTP): Qwen3-Next's `mtp.*` head, which predicts the token after next.

With h_t the model's last hidden state at position t (after the final norm, what the LM head reads) and e_{t+1} the
token embedding of the next token, an MTP layer computes

    x_t  = fc([norm_e(e_{t+1}) | norm_h(h_t)])           (fc: 2H -> H, no bias; the embedding's half first)
    y_t  = block(x_t)                                     (a decoder block: full attention at position t + 1, causal
                                                           over the head's own earlier inputs, then the MLP)
    g_t  = norm(y_t),   logits_t = lm_head(g_t)           (predicting token t + 2; embedding and LM head shared)

as vLLM's and SGLang's `Qwen3NextMultiTokenPredictor` do (tensor names `mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.{i}`, `mtp.norm`; every norm Qwen3-Next's zero-centred RMSNorm with
`rms_norm_eps`). The block is this family's decoder layer, "full_attention" with the MLP `config.mtp_mlp_type`.

Depth d (d = 1..D): training chains the layers as DeepSeek-V3 and transformers' `MtpModel` do, layer d taking the
hidden state g of depth d - 1 (h at depth 1) and the embedding of token t + d, and predicting token t + d + 1; the MTP
loss is the mean of the D cross-entropies (`mtp_loss`). Drafting (mtp_drafting.py) applies the head recursively to
its own g, as vLLM drafts several tokens from Qwen3-Next's single layer.

The head's attention has a cache of its own (a DynamicCache of `mtp_config(config)`, one attention layer per MTP
layer): the MTP config is the model's with `num_mtp_layers` full-attention layers and no per-layer overrides, so the
block reads the model's global settings, as Qwen3-Next's MTP layer does.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask

from .configuration_hybrid_linear import HybridLinearConfig
from .fp8_layers import quantize_modules
from .mixer_attention import RotaryTables
from .mlp_registry import MLPS
from .norms import HybridLinearRMSNorm
from .sequence_info import SequenceInfo

logger = logging.getLogger(__name__)

MTP_ATTRIBUTE = "mtp"  # the LM's attribute (checkpoint names "mtp.*", Qwen3-Next's)
# a converted folder keeps a head its config.json did not declare in this file, not loaded by default
# (conversion.extra_tensors); a model built with an MTP head loads it from there (`with_carried_head`)
CARRIED_TENSORS_FILE = "extra_tensors.safetensors"


def mtp_config(config: HybridLinearConfig) -> HybridLinearConfig:
    """The config the MTP layers are built from: `num_mtp_layers` full-attention layers of MLP `mtp_mlp_type`, the
    model's global settings (per-layer overrides dropped)."""
    count = config.num_mtp_layers
    if config.mtp_mlp_type not in MLPS:
        raise ValueError(f"config.mtp_mlp_type is {config.mtp_mlp_type!r} with num_mtp_layers={count}; set it to one "
                         f"of {tuple(MLPS)} (or build the config with num_mtp_layers, which resolves it).")
    head = copy.copy(config)
    head.__dict__.pop("_heterogeneity_spec", None)
    head.mixer_types, head.layer_types = ["full_attention"] * count, ["full_attention"] * count
    head.mlp_types = [config.mtp_mlp_type] * count
    head.block_fp8 = None  # (the head quantizes its own modules under their "mtp." names: HybridLinearMtpHead)
    head.mlp_layer_types = [MLPS[config.mtp_mlp_type].mlp_layer_type] * count
    head.num_hidden_layers = count
    return head


class HybridLinearMtpHead(nn.Module):
    """The MTP layers of Qwen3-Next (see the module docstring). `decoder_layer(config, index)` builds a decoder block;
    `rotary(config)` the rotary embedding of the block's attention."""

    reads = "final"  # the final norm's output h (Fast-LLM's parallel heads read the last layer's input)
    marker = "mtp.fc.weight"  # a tensor only this kind of head has (check_mtp_kind)
    one_draft_per_layer = False  # drafting applies the one layer recursively (Fast-LLM's heads draft one each)

    def __init__(self, config: HybridLinearConfig, decoder_layer: Callable[[HybridLinearConfig, int], nn.Module],
                 rotary: Callable[[HybridLinearConfig], nn.Module]):
        super().__init__()
        self.config = mtp_config(config)
        norm = lambda: HybridLinearRMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norms)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(), norm()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(decoder_layer(self.config, i) for i in range(config.num_mtp_layers))
        self.norm = norm()
        self.rotary_emb = rotary(self.config)
        # an FP8 checkpoint's head: the modules its setting quantizes, matched by their checkpoint names (fp8_layers)
        quantize_modules(self, MTP_ATTRIBUTE + ".", config.block_fp8_settings)

    def forward(self, hidden_states: torch.Tensor, next_embeddings: torch.Tensor, position_ids: torch.Tensor,
                depth: int = 0, attention_mask: torch.Tensor | None = None, cache: Cache | None = None
                ) -> torch.Tensor:
        """One MTP layer (`layers[depth]`) over T positions: hidden_states [B, T, H] (h or the previous depth's g),
        next_embeddings [B, T, H] (the embeddings of the tokens one position on), position_ids [B or 1, T] (those
        tokens' positions); attention_mask: the 2-D padding mask over the cache's tokens and these, the 4-D
        additive mask [B, 1, T, cache slots] of a cache that keeps its own bookkeeping (drafting's VerifyCache), or
        None. Returns g [B, T, H], normed (what the LM head reads)."""
        fused = torch.cat([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden_states)], -1)
        x = self.fc(fused)
        mask = attention_mask
        if mask is None or mask.dim() != 4:
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                      position_ids=position_ids, layer_idx=depth)
        tables = self.rotary_emb(x, position_ids)
        layer = self.layers[depth]
        x = layer(x, position_embeddings=tables if torch.compiler.is_compiling() else RotaryTables(pair=tables),
                  attention_mask=mask, sequence_info=SequenceInfo(x.shape[0], x.shape[1]), cache=cache,
                  position_ids=position_ids)
        return self.norm(x)

    def depths(self, hidden_states: torch.Tensor, embeddings: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training's chain over a whole sequence: g^d for the depths d = 1..D with a target (T >= d + 2), g^d [B,
        T - d, H] at positions t = 0..T-1-d (predicting token t + d + 1), from the model's h [B, T, H] and the input
        embeddings [B, T, H]; position_ids
        [B or 1, T], attention_mask the 2-D [B, T] one or None (the entries of padding: `valid_entries`)."""
        outputs, previous = [], hidden_states
        for depth in range(len(self.layers)):
            d = depth + 1
            if embeddings.shape[1] <= d + 1:  # (no target: token t + d + 1 lies past the sequence for every t)
                break
            mask = valid_entries(attention_mask, d)
            previous = self(previous[:, : embeddings.shape[1] - d], embeddings[:, d:], position_ids[:, d:], depth,
                            attention_mask=mask)
            outputs.append(previous)
        return outputs


def valid_entries(attention_mask: torch.Tensor | None, depth: int) -> torch.Tensor | None:
    """Which depth-`depth` entries t = 0..T-1-depth are real, [B, T - depth]: both ends of the entry (h at t, the
    embedding at t + depth) are real tokens; None without a mask. A padded entry is hidden from the others'
    attention and its target is not counted, so a padded row's loss is the row's alone."""
    if attention_mask is None:
        return None
    return attention_mask[:, : attention_mask.shape[1] - depth] * attention_mask[:, depth:]


def shifted_labels(labels: torch.Tensor, depth: int, ignore_index: int = -100) -> torch.Tensor:
    """The targets of depth `depth` (1-based) at positions t = 0..T-1-depth, as transformers' `shift_labels`: token
    t + depth + 1 (labels follow transformers' convention, labels[t] the token at t; -100 ignored)."""
    return nn.functional.pad(labels[:, depth + 1:], (0, 1), value=ignore_index)


def mtp_positions(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch: int, length: int,
                  device: torch.device) -> torch.Tensor:
    """The positions of a training forward's tokens as the model takes them: given, else counting the real tokens of
    a padded 2-D mask, else 0..T-1."""
    if position_ids is not None:
        return position_ids
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.arange(length, device=device).unsqueeze(0).expand(batch, -1)


def check_mtp_loss_inputs(position_ids: torch.Tensor | None, attention_mask, kwargs: dict) -> None:
    """The MTP loss pairs each position with the next token of its row: packed documents (cu_seq_lens, positions
    that restart) would pair a document's last token with the next document's first; refused in one line. Padded
    entries (a 2-D attention_mask's zeros) have positions of their own choosing (transformers fills them with 1):
    only two neighbouring real tokens whose positions do not step by one are a restart."""
    restarts = False
    if position_ids is not None and position_ids.shape[-1] > 1:
        steps = position_ids[..., 1:] != position_ids[..., :-1] + 1
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            real = attention_mask.to(torch.bool).to(steps.device)
            steps = steps & real[..., 1:] & real[..., :-1]
        restarts = bool(steps.any())
    if kwargs.get("cu_seq_lens_q") is not None or restarts:
        raise ValueError("mtp_loss_weight > 0 with packed sequences (cu_seq_lens or position_ids that restart): the "
                         "MTP loss would pair one document's tokens with the next one's; train the MTP heads on "
                         "unpacked rows (padding is fine), or set mtp_loss_weight=0.")
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        raise ValueError("mtp_loss_weight > 0 needs a 2-D attention_mask (or none); pass the [batch, tokens] mask.")



def _tensor_names(path: str) -> list[str]:
    """The tensor names a safetensors file stores (its header alone is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return list(handle.keys())


def _stored_mtp_names(checkpoint_files: list[str]) -> set[str]:
    """The MTP tensors (`mtp.*`) the checkpoint's safetensors files store."""
    return {name for path in checkpoint_files if str(path).endswith(".safetensors") for name in _tensor_names(path)
            if name.startswith(MTP_ATTRIBUTE + ".")}


def check_mtp_kind(model: nn.Module, checkpoint_files: list[str] | None) -> None:
    """One line, before any weight is read, where the checkpoint's MTP tensors are another kind's than the model's
    head (each kind's `marker` tensor tells them apart): loaded by name, the other kind's block tensors would fill
    this head's block of the same name, and the rest stay fresh."""
    head = getattr(model, MTP_ATTRIBUTE, None)
    if head is None or not checkpoint_files:
        return
    stored = _stored_mtp_names(checkpoint_files)
    if stored and head.marker not in stored:
        raise ValueError(f"the checkpoint's MTP tensors ({min(stored)}, ...) are not those of this model's "
                         f"heads (mtp_type {model.config.mtp_type!r}, whose {head.marker} it lacks): load it with "
                         "the mtp_type it was saved with, or with num_mtp_layers=0 to leave its heads out.")


def with_carried_head(model: nn.Module, checkpoint_files: list[str] | None) -> list[str] | None:
    """The checkpoint files to load, with the folder's CARRIED_TENSORS_FILE added where the model has an MTP head,
    the file holds exactly that head's tensors (`mtp.*`, by name) and the model's files hold none of them (a
    Qwen3-Next head converted beside a config that declared no MTP layers, then loaded with num_mtp_layers=1): the
    head is the checkpoint's, not a fresh one. A carried set that is not the head's (a sparse head's experts stored
    one by one, another layout) is left, with one warning line."""
    if not checkpoint_files or getattr(model, MTP_ATTRIBUTE, None) is None:
        return checkpoint_files
    carried = os.path.join(os.path.dirname(str(checkpoint_files[0])), CARRIED_TENSORS_FILE)
    if not os.path.isfile(carried) or carried in map(str, checkpoint_files):
        return checkpoint_files
    prefix = MTP_ATTRIBUTE + "."
    head = {name for name in model.state_dict() if name.startswith(prefix)}
    stored = set(_tensor_names(carried))
    if not any(name.startswith(prefix) for name in stored) or _stored_mtp_names(checkpoint_files):
        return checkpoint_files
    if stored != head:  # (a sparse head's experts stored one by one, as the hub does: the model holds them stacked)
        logger.warning(f"{carried} carries an MTP head whose tensors are not this model's head (its experts stored "
                       "one by one, or another layout), so the model's head is fresh: convert the source checkpoint "
                       "with its MTP layers declared (mtp_num_hidden_layers) to load it.")
        return checkpoint_files
    return [*checkpoint_files, carried]


__all__ = ["CARRIED_TENSORS_FILE", "MTP_ATTRIBUTE", "HybridLinearMtpHead", "check_mtp_kind", "check_mtp_loss_inputs",
           "mtp_config", "mtp_positions", "shifted_labels", "valid_entries", "with_carried_head"]

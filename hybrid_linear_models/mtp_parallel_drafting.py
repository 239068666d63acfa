"""Speculative decoding with Fast-LLM's parallel MTP heads (mtp_parallel_heads.py): `generate(..., use_mtp=k)`.

The loop is the one Qwen3-Next's head drafts for (mtp_drafting.py: transformers' assisted decoding for one row, this
package's batched loop otherwise); only the drafting differs. With the model's accepted tokens x_0..x_{L-1}:

1. the heads' caches must hold positions 0..L-2 (head d's layer reads the trunk s_t, the last decoder layer's input
   at position t, which the model's forward over x_t gives): the positions the model's last forward accepted are
   run through the heads, and only those (the heads read no draft, so their caches hold accepted positions alone
   and never need cutting back; a GDN/KDA head's state is advanced over exactly those);
2. at the last of them, t = L - 2, the model's own next token x_{L-1} came from its head; head d gives draft d,
   token t + d + 1 = x_{L-1+d}, for d = 1..k: k drafts from one pass, none drafted from another.

The batched loop's verify round runs its k + 1 tokens through the heads too (their VerifyCache keeps, like the
model's, what restores each row's GDN/KDA states to its accepted prefix), so a captured round drafts the next round
without the host.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from .cache_hybrid_linear import adopt_linear_layers
from .mtp_drafting import MtpCandidateGenerator, heads_cache, refilled
from .mtp_parallel_heads import trunk_index
from .sequence_info import SequenceInfo
from .verify_cache import VerifyCache


class ParallelMtpCandidateGenerator(MtpCandidateGenerator):
    """Drafts `use_mtp` tokens a round with the model's parallel MTP heads, for transformers' assisted decoding of
    one row (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig,
                 logits_processor: LogitsProcessorList | None = None):
        super().__init__(model, generation_config, logits_processor)
        # the verify forward's trunk only (what the heads read)
        self.trunk = trunk_index(model.config)
        self.model_kwargs_overrides = {"output_hidden_states": [self.trunk]}  # (a list: index 0 is not falsy there)
        adopt_linear_layers(self.cache)  # (the base class's DynamicCache of the heads' config: GDN/KDA layers too)

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict, model_outputs, is_first_iteration: bool,
                       n_last_matches: int, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if is_first_iteration:  # the prompt's forward comes first: it gives the trunk to draft from
            return input_ids, None
        length = input_ids.shape[1]
        new = length - 1 - self.held  # the positions the last forward verified and kept
        trunk = model_outputs.hidden_states[self.trunk][:, :new]
        mask = model_kwargs.get("attention_mask")
        mask = mask[:, : length - 1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        positions = self._positions(model_kwargs, length)[:, self.held: length - 1]
        outputs = self.model.mtp(trunk.to(self.model.get_input_embeddings().weight.dtype), positions,
                                 attention_mask=mask, cache=self.cache)
        self.held = length - 1
        drafts_wanted = min(self.num_drafts, self.max_length - length - 1)
        draft_logits, sequence = [], input_ids
        for g in outputs[: max(drafts_wanted, 0)]:
            token, logits = self._pick(sequence, self.model.lm_head(g[:, -1]).float())
            draft_logits.append(logits[:, None])
            sequence = torch.cat([sequence, token], dim=-1)
        if not draft_logits:
            return input_ids, None
        return sequence, torch.cat(draft_logits, dim=1)


class ParallelMtpBatchDrafter:
    """The parallel MTP heads as a drafter of speculative_decoding's batched loop (as mtp_drafting.MtpBatchDrafter
    for Qwen3-Next's head): `start` takes the prompts' trunk, `observe` each round's, `draft` reads each head's
    output at each row's last accepted position. The heads' entries sit in a `VerifyCache` of their own, position p
    at the slot of the model's token at p; `observe` runs a round's tokens through the heads and keeps each row's
    accepted ones, as the model's cache does (`VerifyCache.restore`)."""

    observes_hidden_states = True
    drafts_on_device = True
    reads = "trunk"  # the hidden states it observes: the last decoder layer's input (speculative_decoding)

    def __init__(self, model: PreTrainedModel):
        self.model, self.heads = model, model.mtp
        self.dtype = model.get_input_embeddings().weight.dtype
        self.cache: VerifyCache | None = None
        self.g: torch.Tensor | None = None  # [B, D, H]: each head's output at each row's last accepted position

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, hidden: torch.Tensor,
              first: torch.Tensor, slots: int) -> None:
        """The prompts' positions 0..P-1 ([B, P], left-padded; `hidden` their trunk [B, P, H]); first: the model's
        first new tokens (not read: the heads draft the tokens after it). slots: the model's cache's."""
        length, batch = input_ids.shape[1], input_ids.shape[0]
        self.cache = heads_cache(self.cache, self.heads, batch, slots, input_ids.device)
        real = self.cache.prompt_padding(attention_mask, length)
        self.g = refilled(self.g, torch.stack([out[:, -1] for out in self._run(hidden, real)], dim=1))
        self.cache.prompts_written(length)

    def observe(self, greedy: torch.Tensor, kept: torch.Tensor, hidden: torch.Tensor) -> None:
        """A round's k positions (`hidden` their trunk [B, k, H]), of which each row keeps its first kept[b] (its
        accepted drafts and the token before them); a row that keeps nothing keeps its state."""
        outputs = torch.stack(self._run(hidden), dim=1)  # [B, D, k, H]
        rows = torch.arange(outputs.shape[0], device=outputs.device)
        last = outputs[rows, :, (kept - 1).clamp(min=0)]  # [B, D, H]
        self.g.copy_(torch.where((kept > 0)[:, None, None], last, self.g))
        self.cache.restore(kept)

    def draft(self, sequences: object, count: int) -> torch.Tensor:
        """[B, count] greedy drafts: head d's at each row's last accepted position, d = 1..count."""
        return self.model.lm_head(self.g[:, :count]).argmax(-1)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor `observe` and `draft` read and write (what a capture saves and puts back)."""
        return [*self.cache.tensors(), self.g]

    def _run(self, hidden: torch.Tensor, real: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The heads over T new positions per row (trunk [B, T, H]) at each row's next slots; real [B, T]: a
        prompt's tokens that are not padding (None: all). Returns each head's g [B, T, H]."""
        cache, tokens = self.cache, hidden.shape[1]
        mask = None
        if self.heads.layers[0].mixer_state == "kv":
            eager = self.heads.config._attn_implementation == "eager"
            mask = cache.attention_mask(tokens, cache.layers[0].window, self.dtype, eager)
        info = SequenceInfo(hidden.shape[0], tokens, padding_mask=real)
        return self.heads(hidden.to(self.dtype), cache.positions(tokens), attention_mask=mask, cache=cache,
                          sequence_info=info)


__all__ = ["ParallelMtpBatchDrafter", "ParallelMtpCandidateGenerator"]

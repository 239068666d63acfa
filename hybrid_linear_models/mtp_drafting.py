"""Speculative decoding with the model's own MTP head: `generate(..., use_mtp=k)` (transformers' argument; True
drafts one token per MTP layer, an integer k = 1..4 drafts k).

transformers' assisted decoding (`_assisted_decoding`) runs the loop: ask a `CandidateGenerator` for draft tokens,
verify them with one forward of the model, keep the longest prefix the model agrees with plus the model's own next
token, and `crop` the cache to it (a GDN/KDA layer restored exactly: state_rollback.py). Greedy output is therefore
plain greedy decoding's, token for token, whatever the drafts. This module is the generator (`MtpCandidateGenerator`),
chosen by the model's `_get_candidate_generator` override.

Drafting, with L tokens accepted so far (x_0..x_{L-1}) and the model's hidden states h_t (after the final norm) of
every position the model has verified, t = 0..L-2:

1. the head's own attention cache must hold one entry per position 1..L-1 (the head's input at position t + 1 is
   (h_t, x_{t+1})): the entries of the positions the model's last forward verified and accepted are added (the whole
   prompt after the prefill; the accepted drafts plus the token before them after a verify forward), after dropping
   the entries of last round's recursive drafts;
2. draft 1 = argmax(lm_head(g)) of the head's output g at position L - 1 (predicting x_L);
3. draft j > 1: the head applied to its own g of the previous draft step and the embedding of draft j - 1, at the
   next position, as vLLM drafts several tokens from Qwen3-Next's single MTP layer; these entries are dropped at the
   next round (they came from the head's hidden state, not the model's).

The model's hidden states come from the verify forward itself (`output_hidden_states=-1`, the last one only). Sampling
(`do_sample=True`) draws the drafts from the processed logits and hands them to transformers' speculative sampling.
Drafting runs one MTP layer (Qwen3-Next's count).

A batch of several rows (greedy) runs speculative_decoding's batched loop, each row accepting its own drafts (so does
one row where the model's graph decoding is on for the device: its rounds replay a captured CUDA graph), with
`MtpBatchDrafter`: the same entries and drafts per row, in a head cache with per-row lengths (a `VerifyCache`, as the
model's): a row's entries are those of its accepted positions, contiguous, so rows of different lengths need no
mask of rejected entries; a rejected draft's entry and the recursion's lie past the row's length, unseen, until the
next round's overwrite them. Its bookkeeping being device tensors, a captured verify round drafts the next round's
tokens in the same graph (no host work between rounds but reading the tokens gained).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from .mtp_head import valid_entries
from .verify_cache import VerifyCache

MAX_MTP_DRAFT_TOKENS = 4  # drafts per round: the head's accuracy falls with each recursive step (vLLM uses 1 to 4)


def draft_length(use_mtp: Any, mtp_layers: int) -> int:
    """The drafts per round `use_mtp` asks for: True -> one per MTP layer (at most MAX_MTP_DRAFT_TOKENS), an integer
    k -> k."""
    return min(mtp_layers, MAX_MTP_DRAFT_TOKENS) if use_mtp is True else int(use_mtp)


def check_mtp_generation(model: PreTrainedModel, generation_config: GenerationConfig,
                         generation_mode_kwargs: dict) -> None:
    """One clear line for a `use_mtp` request this model cannot serve, before any work."""
    use_mtp = generation_config.use_mtp
    if use_mtp is None or use_mtp is False:
        return
    if use_mtp is not True and (isinstance(use_mtp, bool) or not isinstance(use_mtp, int)
                                or not 1 <= use_mtp <= MAX_MTP_DRAFT_TOKENS):
        raise ValueError(f"use_mtp must be True or a number of draft tokens from 1 to {MAX_MTP_DRAFT_TOKENS}, got "
                         f"{use_mtp!r}.")
    layers = model.config.num_mtp_layers
    if not layers or getattr(model, "mtp", None) is None:
        raise ValueError("use_mtp needs the model's multi-token-prediction weights, and this model has none "
                         "(config.num_mtp_layers is 0); convert a checkpoint that has them (Qwen3-Next's mtp.*, "
                         "Fast-LLM's prediction_heads > 1), or generate without use_mtp.")
    if model.mtp.one_draft_per_layer:
        if use_mtp is not True and use_mtp > layers:
            raise ValueError(f"use_mtp={use_mtp} asks for more drafts than this model's {layers} MTP layer(s) give "
                             f"(Fast-LLM's heads: one draft each, config.num_mtp_layers); pass use_mtp from 1 to "
                             f"{min(layers, MAX_MTP_DRAFT_TOKENS)}, or True.")
    elif layers != 1:
        raise ValueError(f"use_mtp drafts with one MTP layer applied recursively (Qwen3-Next's), and this model has "
                         f"{layers} (config.num_mtp_layers); generate without use_mtp.")
    if generation_config.prompt_lookup_num_tokens is not None or generation_mode_kwargs.get("assistant_model"):
        raise ValueError("use_mtp drafts with the model's MTP head; pass it without prompt_lookup_num_tokens or "
                         "assistant_model (one drafter per generate call).")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(f"use_mtp drafts for greedy or sampled decoding, one sequence a row, and num_beams is "
                         f"{generation_config.num_beams}; pass num_beams=1, or leave out use_mtp for beam search.")
    if generation_config.output_hidden_states:
        raise ValueError("use_mtp takes the hidden states the model's verify forwards select for its MTP head, so "
                         "generate cannot return them too (output_hidden_states=True); leave out one of the two.")


def heads_cache(previous: VerifyCache | None, head: torch.nn.Module, batch: int, slots: int,
                device: torch.device) -> VerifyCache:
    """The VerifyCache of an MTP head's layers for a batched call: `previous` started over in place where it has the
    call's batch, slots and device (a kept captured round reads its buffers by address: kept_verify_rounds), else a
    new one."""
    if previous is not None and (previous.batch, previous.slots, previous.device) == (batch, slots, device):
        previous.start_over()
        return previous
    return VerifyCache(head, batch, slots, device, layers=head.layers)


def refilled(previous: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`value` in `previous`'s storage where it fits (same shape, device and dtype: read by address by a kept
    captured round), else a copy of it."""
    if previous is not None and (previous.shape, previous.device, previous.dtype) == (value.shape, value.device,
                                                                                      value.dtype):
        return previous.copy_(value)
    return value.clone()


class MtpCandidateGenerator(CandidateGenerator):
    """Drafts `use_mtp` tokens a round with the model's MTP head (see the module docstring)."""

    requires_model_outputs = True
    # the verify forward's last hidden state only (what the head reads)
    model_kwargs_overrides: ClassVar[dict[str, Any]] = {"output_hidden_states": -1}

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig,
                 logits_processor: LogitsProcessorList | None = None):
        self.model = model
        self.num_drafts = draft_length(generation_config.use_mtp, model.config.num_mtp_layers)
        self.max_length = generation_config.max_length
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        self.cache = DynamicCache(config=model.mtp.config)
        self.held = 0  # the head's cache entries that came from the model's hidden states (positions 1..held)

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict, model_outputs, is_first_iteration: bool,
                       n_last_matches: int, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if is_first_iteration:  # the prompt's forward comes first: it gives the hidden states to draft from
            return input_ids, None
        length = input_ids.shape[1]
        new = length - 1 - self.held  # the positions the last forward verified and kept
        hidden = model_outputs.hidden_states[-1][:, :new]
        self.cache.crop(self.held - self.cache.get_seq_length())  # last round's recursive drafts
        head, embed = self.model.mtp, self.model.get_input_embeddings()
        positions = self._positions(model_kwargs, length)
        mask = model_kwargs.get("attention_mask")
        # the head's entries 1..L-1 (position t + 1: h_t and x_{t+1}), real where both tokens are (valid_entries)
        mask = valid_entries(mask[:, :length], 1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        tokens = input_ids[:, self.held + 1: length]
        g = head(hidden.to(embed.weight.dtype), embed(tokens), positions[:, self.held + 1: length],
                 attention_mask=mask, cache=self.cache)[:, -1:]
        self.held = length - 1
        drafts_wanted = min(self.num_drafts, self.max_length - length - 1)
        drafts, draft_logits, sequence = [], [], input_ids
        for step in range(max(drafts_wanted, 0)):
            if step:
                position = positions[:, -1:] + step
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
                g = head(g, embed(drafts[-1]), position, attention_mask=mask, cache=self.cache)
            token, logits = self._pick(sequence, self.model.lm_head(g)[:, -1].float())
            drafts.append(token)
            draft_logits.append(logits[:, None])
            sequence = torch.cat([sequence, token], dim=-1)
        if not drafts:
            return input_ids, None
        return sequence, torch.cat(draft_logits, dim=1)

    def _positions(self, model_kwargs: dict, length: int) -> torch.Tensor:
        """The positions of the L tokens: generate's own when it keeps them, else 0..L-1."""
        positions = model_kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == length:
            return positions
        return torch.arange(length, device=self.model.device).unsqueeze(0)

    def _pick(self, sequence: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft token from the head's logits [B, V] (processed as generate processes the model's), and those
        logits (what speculative sampling compares with the model's)."""
        if self.logits_processor is not None and len(self.logits_processor) > 0:
            logits = self.logits_processor(sequence, logits)
        if self.do_sample:
            token = torch.multinomial(logits.softmax(dim=-1), num_samples=1)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        return token, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """The draft length is fixed (`use_mtp`)."""


class MtpBatchDrafter:
    """The MTP head as a drafter of speculative_decoding's batched loop (`observes_hidden_states`; see the module
    docstring): `start` takes the prompts' hidden states, `observe` each round's, `draft` runs the head recursively
    from each row's last accepted position.

    The head's entries sit in a `VerifyCache` of its own, row b's entry for position p + 1 at the slot of the model's
    token at position p: per-row lengths that move with the model's cache (both keep each row's accepted tokens), the
    row's padding as the model's. So the head's bookkeeping is device tensors of fixed size, and `observe` and `draft`
    read nothing on the host (`drafts_on_device`): a captured verify round runs them too (CapturedVerifyRound). A
    `start` for the same batch and slots as the last starts its cache over in place, and refills `g`: a captured round
    kept for later calls (kept_verify_rounds) reads them by address."""

    observes_hidden_states = True
    drafts_on_device = True
    reads = "final"  # the hidden states it observes: the final norm's output (speculative_decoding)

    def __init__(self, model: PreTrainedModel):
        self.model, self.head = model, model.mtp
        self.embed = model.get_input_embeddings()
        self.vocab_size = model.config.vocab_size
        self.cache: VerifyCache | None = None
        self.g: torch.Tensor | None = None  # [B, H]: the head's output at each row's last accepted position

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, hidden: torch.Tensor,
              first: torch.Tensor, slots: int) -> None:
        """Entries t = 0..P-1 of the prompts [B, P]: (h_t, x_{t+1}) at x_{t+1}'s position, x_P the first new token;
        real where token t is (left padding: the token after a real one is real). slots: the model's cache's."""
        length, batch = input_ids.shape[1], input_ids.shape[0]
        self.cache = heads_cache(self.cache, self.head, batch, slots, input_ids.device)
        self.cache.prompt_padding(attention_mask, length)  # (the head's attention masks its entries by the pads)
        tokens = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)
        self.g = refilled(self.g, self._run(hidden, tokens)[:, -1])
        self.cache.prompts_written(length)

    def observe(self, greedy: torch.Tensor, kept: torch.Tensor, hidden: torch.Tensor) -> None:
        """Entries j = 0..k-1 of a round: (h of the round's token j, greedy[:, j]) at the position after it, kept
        for j < kept (the accepted drafts, then the model's own token); a row that keeps nothing keeps its state."""
        g = self._run(hidden, greedy)
        last = g[torch.arange(g.shape[0], device=g.device), (kept - 1).clamp(min=0)]
        self.g.copy_(torch.where((kept > 0)[:, None], last, self.g))
        self.cache.restore(kept)  # (the head's attention entries kept: its lengths move on)

    def draft(self, sequences, count: int) -> torch.Tensor:
        """[B, count] greedy drafts: the first from each row's last accepted position, each next one from the head
        applied to the previous draft step's output and token, its entry written past the row's length (seen by
        this recursion alone: the next round's entries overwrite it)."""
        g, drafts = self.g, []
        for step in range(count):
            if step:
                g = self._run(g[:, None], drafts[-1][:, None])[:, -1]
                self.cache.lengths.add_(1)
            drafts.append(self.model.lm_head(g).argmax(-1))
        if count > 1:
            self.cache.lengths.sub_(count - 1)
        return torch.stack(drafts, dim=1)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor `observe` and `draft` read and write (what a capture saves and puts back)."""
        return [*self.cache.tensors(), self.g]

    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The head over T new entries per row (h [B, T, H], the tokens [B, T]) at each row's next slots; an
        entry's position is its slot's less the padding, plus one (the token it embeds is the next one). Returns g
        [B, T, H]."""
        cache, dtype = self.cache, self.embed.weight.dtype
        eager = self.head.config._attn_implementation == "eager"  # (what the head's attention runs)
        mask = cache.attention_mask(tokens.shape[1], None, dtype, eager)
        return self.head(hidden.to(dtype), self.embed(tokens), cache.positions(tokens.shape[1]) + 1,
                         attention_mask=mask, cache=cache)


__all__ = ["MAX_MTP_DRAFT_TOKENS", "MtpBatchDrafter", "MtpCandidateGenerator", "check_mtp_generation",
           "draft_length", "heads_cache", "refilled"]

"""Batched greedy speculative decoding with per-row acceptance: `speculative_generate`.

transformers' assisted generation takes one row. Here a left-padded batch drafts, verifies and accepts per row:

    prefill:  the prompts into a `VerifyCache` (verify_cache.py); each row's first token is the argmax after it
    round:    ids = [last token | k - 1 drafted tokens] per row, one forward of those k tokens (`verify_round`):
              greedy[b, j] = argmax of the logits after ids[b, :j + 1]; row b accepts its a_b leading drafts that
              equal greedy's (a_b = cumprod(draft == greedy).sum()), and gains a_b + 1 tokens, greedy[b, :a_b + 1]
              (the accepted drafts, then the model's own next token); its cache keeps ids[b, :a_b + 1], the tokens
              before the new last one: the attention layers by the row's length, the GDN/KDA layers restored per row
              from the step's window (`VerifyCache.restore`)

so every token a row gains is the argmax of the model's logits after that row's own accepted prefix: the row's
output is its plain greedy decoding, token for token, whatever the drafts and the other rows (the logits of a row
depend on its own tokens alone; they agree with the row decoded alone to the rounding of kernels that run k tokens
at once instead of one). A row that has its tokens (max_new_tokens, or the end-of-sequence token) keeps 0 tokens of
later rounds (`live`): its cache stays as it is, within its slots.

`verify_round` is one forward, the acceptance and the restore, with no host synchronisation and no shape that
depends on a value (the bookkeeping is `VerifyCache`'s device tensors): what a CUDA graph captures per (batch, k,
slots) (`CapturedVerifyRound`, replayed where `speculative_generate(..., graphs=True)` runs on CUDA; its capture is
stood in by an eager run on the CPU in the tests). The captured round is kept with its cache for later calls of the
same shape, the slots rounded up to few sizes (kept_verify_rounds.py). The host reads each round's accepted counts
and tokens once, to hand the drafter the rows' sequences.

A drafter is any object with `draft(sequences, count) -> [B, count]` (sequences: each row's prompt and generated
tokens, 1-D) and optionally `vocab_size`; `PromptLookupDrafter` (n-gram lookup in the row's own tokens) and
`AssistantDrafter` (greedy drafts of a smaller model) are given. A drafter with `observes_hidden_states` true is
handed the model's final hidden states of every verified position: `start(input_ids, attention_mask, hidden [B, P,
H], first [B], slots)` after the prefill and `observe(greedy, kept, hidden [B, k, H])` after each round (the model's
MTP head: `mtp_drafting.MtpBatchDrafter`). One that also has `drafts_on_device` true (the MTP head) drafts from its
device state alone, without the sequences: each round is `drafting_round`, the next round's drafts made after the
acceptance in the same forward pass, and in the same captured graph, so the host reads nothing but the tokens gained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Protocol

import torch

from .fused_projections import projections_stacked_for_few_rows
from .kept_verify_rounds import kept_rounds, round_key
from .kernels_gemv import decode_gemv_mode
from .mlp_sparse_moe import graph_safe_experts
from .mtp_drafting import MtpBatchDrafter, draft_length
from .ops import recurrent_kernels_for_short_sequences
from .sequence_info import SequenceInfo
from .state_rollback import MAX_ROLLBACK_TOKENS
from .static_cache_slots import static_cache_slots
from .verify_cache import VerifyCache

MIN_VERIFY_TOKENS = 2  # the last token and at least one draft
MAX_VERIFY_TOKENS = MAX_ROLLBACK_TOKENS  # what a GDN/KDA layer's window restores
# The delta-rule kernels of a verify round on CUDA: fla's token-by-token ones ("recurrent", up to
# ops.RECURRENT_MAX_TOKENS tokens) or its chunked ones ("chunked", which pad a round to a chunk of 64 tokens);
# benchmarks/bench_verify_step.py measures both.
SHORT_RULE_KERNEL = "recurrent"


class Drafter(Protocol):
    def draft(self, sequences: Sequence[torch.Tensor], count: int) -> torch.Tensor: ...


def forward_tokens(model, cache: VerifyCache, input_ids: torch.Tensor, real: torch.Tensor | None = None,
                   last_only: bool = False, with_hidden: bool = False):
    """The logits [B, T, V] (or [B, 1, V] with `last_only`) of T tokens per row written at each row's next slots of
    `cache` (`cache.lengths` is not moved: `VerifyCache.restore` does); with `with_hidden`, (logits, the final norm's
    output [B, T, H] at every position: what an MTP head reads). real [B, T] bool marks a prompt's tokens that are
    not padding (the GDN/KDA layers keep their states through pads); None: all are real. No host synchronisation
    (capturable)."""
    base = model.model
    batch, tokens = input_ids.shape
    hidden = base.embed_tokens(input_ids)
    positions = cache.positions(tokens)
    position_embeddings = base._step_rotary_tables(hidden, positions)  # (the whole-head tables straight from them)
    eager = model.config._attn_implementation == "eager"
    # the additive mask of each distinct window (None: full attention), built once
    masks = {window: cache.attention_mask(tokens, window, hidden.dtype, eager) for window in cache.windows}
    info = SequenceInfo(batch, tokens, padding_mask=real)
    residual = None  # each layer's last residual add is done by the next norm, as in a decoding step
    for layer in base.layers[: model.config.num_hidden_layers]:
        kv = cache.layers[layer.layer_idx]
        rotary = base.rotary_of_layer[layer.layer_idx]
        hidden, residual = layer.decode(hidden, residual, position_embeddings[rotary] if rotary is not None else None,
                                        masks[kv.window] if layer.mixer_state == "kv" else None, info, cache,
                                        position_ids=positions)
    if with_hidden:
        hidden = _final_norm(base, hidden, residual)
        return model.lm_head(hidden[:, -1:] if last_only else hidden), hidden
    if last_only:
        hidden, residual = hidden[:, -1:], residual[:, -1:] if residual is not None else None
    return model.lm_head(_final_norm(base, hidden, residual))


def _final_norm(base, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The model's final norm of the last layer's (MLP output, residual), their sum done in the norm's kernel."""
    return base.norm(hidden) if residual is None else base.norm(hidden, residual=residual)[0]


def prefill(model, cache: VerifyCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            with_hidden: bool = False):
    """Runs the left-padded prompts [B, P] into the empty `cache`; returns each row's first new token [B] (and, with
    `with_hidden`, the final norm's output [B, P, H] over the prompts)."""
    real = None if attention_mask is None else attention_mask.bool()
    if real is not None:
        cache.pads.copy_(input_ids.shape[1] - real.sum(-1))
    if real is not None and bool(real.all()):
        real = None
    out = forward_tokens(model, cache, input_ids, real, last_only=True, with_hidden=with_hidden)
    logits, hidden = out if with_hidden else (out, None)
    for layer in cache.linear_layers:
        layer.rollback = None
    cache.prompts_written(input_ids.shape[1])
    first = logits[:, -1].argmax(-1)
    return (first, hidden) if with_hidden else first


def verify_round(model, cache: VerifyCache, input_ids: torch.Tensor, live: torch.Tensor,
                 with_hidden: bool = False) -> tuple[torch.Tensor, ...]:
    """One verify step (see the module docstring): input_ids [B, k] = [last token | k - 1 drafts], live [B] bool.
    Returns greedy [B, k] (the argmax after each prefix) and kept [B] (the tokens each row gains: its accepted drafts
    + 1; 0 for a row not live), the cache advanced by kept; with `with_hidden`, also the final norm's output
    [B, k, H] at the k positions. No host synchronisation (capturable)."""
    with (recurrent_kernels_for_short_sequences() if SHORT_RULE_KERNEL == "recurrent" else nullcontext(),
          projections_stacked_for_few_rows()):  # (the round's few rows, as a decoding step's: fused_projections)
        out = forward_tokens(model, cache, input_ids, with_hidden=with_hidden)
        logits, hidden = out if with_hidden else (out, None)
        greedy = logits.argmax(-1)
        accepted = (input_ids[:, 1:] == greedy[:, :-1]).long().cumprod(-1).sum(-1)
        kept = torch.where(live, accepted + 1, torch.zeros_like(accepted))
        cache.restore(kept)
    return (greedy, kept, hidden) if with_hidden else (greedy, kept)


def drafting_round(model, cache: VerifyCache, input_ids: torch.Tensor, live: torch.Tensor,
                   drafter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_round`, then the round handed to a drafter that drafts on the device (`drafts_on_device`: the MTP
    head) and its drafts for the next round: (greedy [B, k], kept [B], drafts [B, k - 1]). No host synchronisation
    (capturable)."""
    greedy, kept, hidden = verify_round(model, cache, input_ids, live, with_hidden=True)
    drafter.observe(greedy, kept, hidden)
    return greedy, kept, drafter.draft(None, input_ids.shape[1] - 1)


class CapturedVerifyRound:
    """`verify_round` for one (batch, k, cache) captured as a CUDA graph: the inputs copied into its buffers, the
    graph replayed, its outputs returned; with a drafter that drafts on the device, `drafting_round` (the next
    round's drafts made in the same graph). The capture runs the round to warm up (`record_graph`), from the cache and
    drafter as they are, and puts them back (saved: `VerifyCache.tensors`, the drafter's `tensors`), so they are as
    they were after the capture. It is recorded as the decoding step is: its linear layers of at most 16 rows (batch x
    k) on the decoding GEMV kernel."""

    def __init__(self, model, cache: VerifyCache, tokens: int, pool=None, with_hidden: bool = False, drafter=None):
        self.ids = torch.zeros(cache.batch, tokens, dtype=torch.long, device=cache.device)
        self.live = torch.zeros(cache.batch, dtype=torch.bool, device=cache.device)
        state = lambda: cache.tensors() + (drafter.tensors() if drafter is not None else [])
        saved = [t.clone() for t in state()]

        def reset():
            for tensor, value in zip(state(), saved):
                tensor.copy_(value)

        def run():  # as the decoding step's capture: sparse MoE layers on an experts implementation without host
            # reads, and the products of at most 16 rows (batch x k) through this package's GEMV kernel (kernels_gemv)
            with decode_gemv_mode(cache.device), graph_safe_experts(model.config, model.lm_head.weight.dtype,
                                                                    cache.device.type):
                if drafter is not None:
                    return drafting_round(model, cache, self.ids, self.live, drafter)
                return verify_round(model, cache, self.ids, self.live, with_hidden)

        try:
            self.graph, self.outputs = self._record(run, cache.device, reset, pool)
        finally:
            reset()

    @staticmethod
    def _record(run: Callable, device: torch.device, reset: Callable, pool) -> tuple:
        from .cuda_graph_decoding import record_graph

        return record_graph(run, device, pool, reset=reset)  # (tests stand in an eager replay here)

    def __call__(self, input_ids: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids.copy_(input_ids)
        self.live.copy_(live)
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the row's own tokens (transformers' prompt lookup, per row): the tokens that
    followed the latest earlier occurrence of the row's last n tokens (n = max_ngram down to 1); a row with no match
    drafts its last token repeated (a draft may always be wrong: it costs acceptance, never correctness)."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def draft(self, sequences: Sequence[torch.Tensor], count: int) -> torch.Tensor:
        rows = []
        for tokens in sequences:
            found = None
            for n in range(min(self.max_ngram, tokens.numel() - 1), 0, -1):
                tail = tokens[-n:]
                windows = tokens[:-1].unfold(0, n, 1)  # (the last n-gram itself excluded)
                hits = (windows == tail).all(-1).nonzero().flatten()
                for start in reversed(hits.tolist()):
                    follow = tokens[start + n: start + n + count]
                    if follow.numel():
                        found = follow
                        break
                if found is not None:
                    break
            if found is None:
                found = tokens[-1:]
            rows.append(torch.cat([found, found[-1:].expand(count - found.numel())])[:count])
        return torch.stack(rows)


class AssistantDrafter:
    """Greedy drafts of an assistant model (a smaller causal LM of the same vocabulary), one `generate` per row."""

    def __init__(self, assistant):
        self.assistant = assistant
        self.vocab_size = assistant.config.vocab_size

    def draft(self, sequences: Sequence[torch.Tensor], count: int) -> torch.Tensor:
        device = self.assistant.device
        rows = []
        with torch.no_grad():
            for tokens in sequences:
                out = self.assistant.generate(tokens[None].to(device), max_new_tokens=count, min_new_tokens=count,
                                              do_sample=False, pad_token_id=0)
                rows.append(out[0, tokens.numel():].cpu())
        return torch.stack(rows)


def check_speculative_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, drafter,
                             num_tokens: int, max_new_tokens: int) -> None:
    """The one-line refusals of `speculative_generate`, before any work."""
    if not isinstance(num_tokens, int) or not MIN_VERIFY_TOKENS <= num_tokens <= MAX_VERIFY_TOKENS:
        raise ValueError(f"num_tokens={num_tokens!r}: a verify step runs the last token and num_tokens - 1 drafts, "
                         f"from {MIN_VERIFY_TOKENS} to {MAX_VERIFY_TOKENS} tokens (what a GDN/KDA layer restores); "
                         "pass num_tokens in that range (4 or 5 is usual).")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: pass a positive number of tokens to generate.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids with at least one token per row.")
    if attention_mask is not None and (attention_mask.shape != input_ids.shape
                                       or not bool((attention_mask[:, 1:].bool() >= attention_mask[:, :-1].bool()).all())
                                       or not bool(attention_mask[:, -1].bool().all())):
        raise ValueError(f"attention_mask must be [batch, length] = {tuple(input_ids.shape)} with each row's padding "
                         "on the left (its last column all ones): pad the prompts on the left (tokenizer "
                         "padding_side='left').")
    if not callable(getattr(drafter, "draft", None)):
        raise TypeError(f"the drafter ({type(drafter).__name__}) has no draft(sequences, count) method; pass "
                        "PromptLookupDrafter(), AssistantDrafter(model) or an object with one.")
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != model.config.vocab_size:
        raise ValueError(f"the drafter's vocabulary has {vocab} tokens and the model's {model.config.vocab_size}: "
                         "its drafts would be other tokens; draft with a model of the same tokenizer and vocabulary.")


def _check_draft(draft: object, batch: int, count: int, vocab: int) -> torch.Tensor:
    if not isinstance(draft, torch.Tensor) or tuple(draft.shape) != (batch, count) or draft.is_floating_point():
        shape = tuple(draft.shape) if isinstance(draft, torch.Tensor) else type(draft).__name__
        raise ValueError(f"the drafter returned {shape}; draft(sequences, count) must return integer token ids "
                         f"[batch, count] = {(batch, count)}.")
    if draft.numel() and not (0 <= int(draft.min()) and int(draft.max()) < vocab):
        raise ValueError(f"the drafter returned token ids outside the model's vocabulary (0 to {vocab - 1}): "
                         "draft with a model of the same vocabulary.")
    return draft.long()


def speculative_generate(model, input_ids: torch.Tensor, drafter: Drafter, num_tokens: int = 4,
                         max_new_tokens: int = 32, attention_mask: torch.Tensor | None = None,
                         eos_token_id: int | None = None, pad_token_id: int = 0,
                         graphs: bool = False) -> torch.Tensor:
    """Greedy decoding of a left-padded batch, num_tokens per verify step (the last token and num_tokens - 1 drafts
    from `drafter`), each row accepting its own drafts (see the module docstring). Returns [B, P + max_new_tokens]:
    the prompts as given, then each row's tokens (padded with `pad_token_id` after its end-of-sequence token).
    graphs: replay each round from a captured CUDA graph (`CapturedVerifyRound`; on CUDA)."""
    check_speculative_inputs(model, input_ids, attention_mask, drafter, num_tokens, max_new_tokens)
    device = model.device
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    batch, prompt = input_ids.shape
    # slots: a live row writes at most up to slot prompt + max_new_tokens - 2 + num_tokens - 1; a row that ended
    # with its last round's drafts all accepted has a length up to prompt + max_new_tokens - 2 + num_tokens, and its
    # verify tokens are still written after it in the rounds the other rows go on with: num_tokens more slots
    slots = prompt + max_new_tokens + 2 * num_tokens
    observes = getattr(drafter, "observes_hidden_states", False)
    # a drafter that drafts from device state alone (the MTP head) drafts inside each round: drafting_round
    on_device = observes and getattr(drafter, "drafts_on_device", False)
    stored = None
    if graphs:  # the captured round, its cache and on-device drafter kept across calls (kept_verify_rounds.py)
        slots = static_cache_slots(slots)
        key = round_key(batch, num_tokens, slots, observes, drafter if on_device else None, device)
        stored = kept_rounds(model).entry(model, key, lambda: VerifyCache(model, batch, slots, device),
                                          drafter if on_device else None)
        drafter = stored.drafter if on_device else drafter
    cache = stored.cache if stored is not None else VerifyCache(model, batch, slots, device)
    real = attention_mask.bool().cpu() if attention_mask is not None else torch.ones(batch, prompt, dtype=torch.bool)
    sequences = [row[mask] for row, mask in zip(input_ids.cpu(), real)]
    generated: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    round_ = stored.round if stored is not None else None
    draft = None
    with torch.no_grad():
        if observes:  # (the MTP head's drafter: it reads the model's hidden states of every verified position)
            first_tokens, hidden = prefill(model, cache, input_ids, attention_mask, with_hidden=True)
            drafter.start(input_ids, attention_mask, hidden, first_tokens, cache.slots)
            first = first_tokens.tolist()
            if on_device:
                draft = drafter.draft(None, num_tokens - 1)
        else:
            first = prefill(model, cache, input_ids, attention_mask).tolist()
        last = torch.tensor(first, device=device)
        for b, token in enumerate(first):
            generated[b].append(token)
            done[b] = token == eos_token_id or max_new_tokens <= 1
        while not all(done):
            if not on_device:
                rows = [torch.cat([s, torch.tensor(g, dtype=s.dtype)]) for s, g in zip(sequences, generated)]
                draft = _check_draft(drafter.draft(rows, num_tokens - 1), batch, num_tokens - 1,
                                     model.config.vocab_size)
            ids = torch.cat([last[:, None], draft.to(device)], dim=1)
            live = torch.tensor([not d for d in done], device=device)
            if stored is not None and round_ is None:
                round_ = CapturedVerifyRound(model, cache, num_tokens, with_hidden=observes,
                                             drafter=drafter if on_device else None)
                stored.keep(model, round_)
            if round_ is not None:
                outputs = round_(ids, live)
            elif on_device:
                outputs = drafting_round(model, cache, ids, live, drafter)
            else:
                outputs = verify_round(model, cache, ids, live, observes)
            greedy, kept = outputs[:2]
            if on_device:
                draft = outputs[2]
            elif observes:
                drafter.observe(greedy, kept, outputs[2])
            last = greedy[torch.arange(batch, device=device), (kept - 1).clamp(min=0)]
            rows_host = torch.cat([kept[:, None], greedy], dim=1).tolist()  # (one read: the round's only wait)
            for b in range(batch):
                if done[b]:
                    continue
                gained = rows_host[b][1: 1 + rows_host[b][0]]
                if eos_token_id is not None and eos_token_id in gained:
                    gained, done[b] = gained[: gained.index(eos_token_id) + 1], True
                generated[b] += gained
                if len(generated[b]) >= max_new_tokens:
                    done[b] = True
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=input_ids.dtype)
    for b, tokens in enumerate(generated):
        tokens = tokens[:max_new_tokens]
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), out], dim=1).to(device)


def batched_loop_refuses(logits_processor, stopping_criteria, generation_config, streamer) -> list[str]:
    """What of an assisted `generate` request `assisted_generate_batch` does not take (empty: it takes it all)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    eos = generation_config._eos_token_tensor
    return [name for name, present in (
        ("do_sample=True", generation_config.do_sample),
        ("logits processors (repetition penalty, min_new_tokens, bad words, ...)", len(logits_processor or []) > 0),
        ("stopping criteria other than max_length and eos_token_id",
         any(not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria or [])),
        ("a streamer", streamer is not None),
        ("return_dict_in_generate=True", generation_config.return_dict_in_generate),
        ("several eos_token_id values", eos is not None and eos.numel() > 1)) if present]


def _requested_drafts(name: str, value: object, default: int | None = None) -> int:
    """generate's draft length `name` (prompt_lookup_num_tokens, num_assistant_tokens): a positive integer (None: the
    default); a round verifies at most MAX_VERIFY_TOKENS - 1 of them (more are cut to that)."""
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: the tokens drafted a round must be a positive integer (a round verifies "
                         f"up to {MAX_VERIFY_TOKENS - 1}); pass one in that range (3 to 5 is usual).")
    return value


def assisted_generate_batch(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                            assistant_model=None, streamer=None, **model_kwargs) -> torch.Tensor:
    """transformers' assisted `generate` (`prompt_lookup_num_tokens=` or `assistant_model=`) for a batch of several
    rows, which transformers refuses: `speculative_generate` with the matching drafter, the verify width the draft
    length + 1 (at most MAX_VERIFY_TOKENS), its rounds replayed from a CUDA graph where the model's graph decoding is
    on for the device (`set_cuda_graph_decoding`; captured once per call, as the round's cache is the call's).
    Greedy only, with generate's length and one end-of-sequence stop: anything else (sampling, logits processors,
    other stopping criteria, streaming, a dict output, several eos_token_id values) is refused in one line.
    Returns the sequences as `generate` does: cut after the last column a row still generated."""
    rows = "one row" if input_ids.shape[0] == 1 else f"{input_ids.shape[0]} rows"
    unsupported = batched_loop_refuses(logits_processor, stopping_criteria, generation_config, streamer)
    if unsupported:
        raise ValueError(f"assisted generate of {rows} runs batched greedy speculative decoding, which does not take "
                         f"{', '.join(unsupported)}; leave those out, or generate one row at a time.")
    if generation_config.use_mtp:  # (checked by mtp_drafting.check_mtp_generation before any work)
        drafter = MtpBatchDrafter(model)
        drafts = draft_length(generation_config.use_mtp, model.config.num_mtp_layers)
    elif assistant_model is not None:
        drafter = AssistantDrafter(assistant_model)
        drafts = _requested_drafts("num_assistant_tokens", generation_config.num_assistant_tokens, default=20)
    elif generation_config.prompt_lookup_num_tokens is None:
        raise ValueError(f"assisted generate of {rows} drafts by prompt lookup (prompt_lookup_num_tokens=), an "
                         "assistant model (assistant_model=) or the model's MTP head (use_mtp=); for another drafter, "
                         "call speculative_decoding.speculative_generate with it, or generate one row at a time.")
    else:
        drafter = PromptLookupDrafter(generation_config.max_matching_ngram_size or 2)
        drafts = _requested_drafts("prompt_lookup_num_tokens", generation_config.prompt_lookup_num_tokens)
    eos = generation_config._eos_token_tensor
    pad = generation_config._pad_token_tensor
    prompt = input_ids.shape[1]
    out = speculative_generate(
        model, input_ids, drafter, num_tokens=min(int(drafts) + 1, MAX_VERIFY_TOKENS),
        max_new_tokens=generation_config.max_length - prompt, attention_mask=model_kwargs.get("attention_mask"),
        eos_token_id=int(eos) if eos is not None else None, pad_token_id=int(pad) if pad is not None else 0,
        graphs=model.captures_graphs_on(input_ids.device))  # (the rounds captured where the steps would be)
    if eos is not None:  # generate stops once every row has ended: the columns after that are cut
        ended = (out[:, prompt:] == int(eos)).long().cumsum(-1).clamp(max=1).cumsum(-1)  # 1 at each row's end
        ends = torch.where(ended.eq(1).any(-1), ended.eq(1).long().argmax(-1) + 1, out.shape[1] - prompt)
        out = out[:, : prompt + int(ends.max())]
    return out


__all__ = [
    "MAX_VERIFY_TOKENS",
    "MIN_VERIFY_TOKENS",
    "AssistantDrafter",
    "CapturedVerifyRound",
    "PromptLookupDrafter",
    "assisted_generate_batch",
    "batched_loop_refuses",
    "check_speculative_inputs",
    "drafting_round",
    "forward_tokens",
    "prefill",
    "speculative_generate",
    "verify_round",
]

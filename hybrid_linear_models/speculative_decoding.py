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
same shape, the slots rounded up to few sizes (kept_verify_rounds.py). Every round runs on the same buffers
(`VerifyRound`) and writes the next round's first token, each row's last one gained, into them itself
(`chain_round`), so the host's work between two rounds is to read one report of the tokens gained (`ReportReader`:
a copy and an event, no other kernel) and, for a host drafter, to write the drafts. A drafter that drafts on the
device needs nothing from the host: on CUDA the next round is launched before the last one's report is read
(`rounds_ahead`), so the device does not wait for the host's bookkeeping between rounds.

A drafter is any object with `draft(sequences, count) -> [B, count]` (sequences: each row's prompt and generated
tokens, 1-D) and optionally `vocab_size`; `PromptLookupDrafter` (n-gram lookup in the row's own tokens) and
`AssistantDrafter` (greedy drafts of a smaller model) are given. A drafter with `observes_hidden_states` true is
handed the hidden states it `reads` ("final": the final norm's output, the default; "trunk": the last decoder layer's
input) at every verified position: `start(input_ids, attention_mask, hidden [B, P, H], first [B], slots)` after the
prefill and `observe(greedy, kept, hidden [B, k, H])` after each round (the model's MTP head: the `batch_drafter` of
its kind, mtp_heads.py). One that also has
`drafts_on_device` true (the MTP head) drafts from its device state alone, without the sequences: each round is
`drafting_round`, the next round's drafts made after the acceptance in the same forward pass, and in the same captured
graph, so the host reads nothing but the tokens gained.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from .fused_projections import projections_stacked_for_few_rows
from .kept_verify_rounds import kept_rounds, round_key
from .kernels_gemv import decode_gemv_mode
from .mlp_sparse_moe import graph_safe_experts
from .mtp_drafting import draft_length
from .mtp_heads import MTP_HEADS
from .mtp_parallel_heads import trunk_index
from .ops import recurrent_kernels_for_short_sequences
from .recorded_graphs import record_graph, replays_under_way
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
                   last_only: bool = False, with_hidden: bool | str = False):
    """The logits [B, T, V] (or [B, 1, V] with `last_only`) of T tokens per row written at each row's next slots of
    `cache` (`cache.lengths` is not moved: `VerifyCache.restore` does); with `with_hidden`, (logits, hidden states
    [B, T, H] at every position: the final norm's output for True or "final", the last decoder layer's input for
    "trunk", as a drafter that observes them reads them: its `reads`). real [B, T] bool marks a prompt's tokens that
    are not padding (the GDN/KDA layers keep their states through pads); None: all are real. No host synchronisation
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
    # the trunk (the last layer's input, which Fast-LLM's MTP heads read): the sum of what the layer before it left
    # (its MLP output, its residual)
    trunk_layer, trunk = trunk_index(model.config) if with_hidden == "trunk" else None, None
    for layer in base.layers[: model.config.num_hidden_layers]:
        if layer.layer_idx == trunk_layer:
            trunk = hidden if residual is None else hidden + residual
        kv = cache.layers[layer.layer_idx]
        rotary = base.rotary_of_layer[layer.layer_idx]
        hidden, residual = layer.decode(hidden, residual, position_embeddings[rotary] if rotary is not None else None,
                                        masks[kv.window] if layer.mixer_state == "kv" else None, info, cache,
                                        position_ids=positions)
    if with_hidden:
        normed = _final_norm(base, hidden, residual)
        return model.lm_head(normed[:, -1:] if last_only else normed), trunk if trunk_layer is not None else normed
    if last_only:
        hidden, residual = hidden[:, -1:], residual[:, -1:] if residual is not None else None
    return model.lm_head(_final_norm(base, hidden, residual))


def _final_norm(base, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The model's final norm of the last layer's (MLP output, residual), their sum done in the norm's kernel."""
    return base.norm(hidden) if residual is None else base.norm(hidden, residual=residual)[0]


def prefill(model, cache: VerifyCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            with_hidden: bool | str = False):
    """Runs the left-padded prompts [B, P] into the empty `cache`; returns each row's first new token [B] (and, with
    `with_hidden`, the hidden states `forward_tokens` gives over the prompts, [B, P, H])."""
    real = cache.prompt_padding(attention_mask, input_ids.shape[1])
    out = forward_tokens(model, cache, input_ids, real, last_only=True, with_hidden=with_hidden)
    logits, hidden = out if with_hidden else (out, None)
    cache.prompts_written(input_ids.shape[1])
    first = logits[:, -1].argmax(-1)
    return (first, hidden) if with_hidden else first


def verify_round(model, cache: VerifyCache, input_ids: torch.Tensor, live: torch.Tensor,
                 with_hidden: bool | str = False) -> tuple[torch.Tensor, ...]:
    """One verify step (see the module docstring): input_ids [B, k] = [last token | k - 1 drafts], live [B] bool.
    Returns greedy [B, k] (the argmax after each prefix) and kept [B] (the tokens each row gains: its accepted drafts
    + 1; 0 for a row not live), the cache advanced by kept; with `with_hidden`, also the hidden states
    `forward_tokens` gives at the k positions, [B, k, H]. No host synchronisation (capturable)."""
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
    greedy, kept, hidden = verify_round(model, cache, input_ids, live, with_hidden=drafter.reads)
    drafter.observe(greedy, kept, hidden)
    return greedy, kept, drafter.draft(None, input_ids.shape[1] - 1)


def chain_round(ids: torch.Tensor, greedy: torch.Tensor, kept: torch.Tensor,
                drafts: torch.Tensor | None = None) -> torch.Tensor:
    """After a round on `ids` [B, k]: writes the next round's first column in place, each row's last token gained
    (greedy at kept - 1; a row that kept nothing gets greedy's first, unread), and with `drafts` [B, k - 1] the rest;
    returns the round's report for the host, [B, 1 + k] = (kept, greedy). No host synchronisation (capturable)."""
    ids[:, :1].copy_(greedy.gather(1, (kept - 1).clamp(min=0)[:, None]))
    if drafts is not None:
        ids[:, 1:].copy_(drafts)
    return torch.cat([kept[:, None], greedy], dim=1)


class VerifyRound:
    """A verify round on fixed buffers, so that every round of a call is the same work on the same tensors (what a
    CUDA graph replays: CapturedVerifyRound): ids [B, k] (the last token, then k - 1 drafts) and live [B]. `replay()`
    runs `verify_round`, or `drafting_round` with a drafter that drafts on the device, then `chain_round`: the next
    round's ids are written in place (their drafts too, for such a drafter), so consecutive rounds need no host
    input. `outputs`: (report [B, 1 + k] = (kept, greedy), then the hidden states [B, k, H] where asked)."""

    def __init__(self, model, cache: VerifyCache, tokens: int, with_hidden: bool | str = False, drafter=None):
        self.model, self.cache, self.drafter, self.with_hidden = model, cache, drafter, with_hidden
        self.ids = torch.zeros(cache.batch, tokens, dtype=torch.long, device=cache.device)
        self.live = torch.zeros(cache.batch, dtype=torch.bool, device=cache.device)
        self.outputs: tuple[torch.Tensor, ...] = ()

    def run(self) -> tuple[torch.Tensor, ...]:
        if self.drafter is not None:
            greedy, kept, drafts = drafting_round(self.model, self.cache, self.ids, self.live, self.drafter)
            return (chain_round(self.ids, greedy, kept, drafts),)
        greedy, kept, *hidden = verify_round(self.model, self.cache, self.ids, self.live, self.with_hidden)
        return (chain_round(self.ids, greedy, kept), *hidden)

    def replay(self) -> None:
        self.outputs = self.run()

    def __call__(self, input_ids: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One round of `input_ids` [B, k] and `live` [B], as verify_round or drafting_round return it: (greedy
        [B, k], kept [B], then the hidden states or the next drafts [B, k - 1]), copies."""
        self.ids.copy_(input_ids)
        self.live.copy_(live)
        self.replay()
        report, *rest = (t.clone() for t in self.outputs)
        if self.drafter is not None:
            rest = [self.ids[:, 1:].clone()]
        return (report[:, 1:], report[:, 0], *rest)


class CapturedVerifyRound(VerifyRound):
    """`VerifyRound` captured as a CUDA graph, replayed. The capture runs the round to warm up (`record_graph`),
    from the cache and drafter as they are, and puts them back (saved: `VerifyCache.tensors`, the drafter's
    `tensors`), so they are as they were after the capture. It is recorded as the decoding step is: its linear layers
    of at most 16 rows (batch x k) on the decoding GEMV kernel."""

    def __init__(self, model, cache: VerifyCache, tokens: int, pool=None, with_hidden: bool | str = False,
                 drafter=None):
        super().__init__(model, cache, tokens, with_hidden, drafter)
        state = lambda: cache.tensors() + (drafter.tensors() if drafter is not None else [])
        saved = [t.clone() for t in state()]

        def reset():
            for tensor, value in zip(state(), saved):
                tensor.copy_(value)

        def run():  # as the decoding step's capture: sparse MoE layers on an experts implementation without host
            # reads, and the products of at most 16 rows (batch x k) through this package's GEMV kernel (kernels_gemv)
            with decode_gemv_mode(cache.device), graph_safe_experts(model.config, model.lm_head.weight.dtype,
                                                                    cache.device.type):
                return self.run()

        try:
            self.graph, self.outputs = self._record(run, cache.device, reset, pool)
        finally:
            reset()

    @staticmethod
    def _record(run: Callable, device: torch.device, reset: Callable, pool) -> tuple:
        return record_graph(run, device, pool, reset=reset)  # (tests stand in an eager replay here)

    @property
    def expired(self) -> bool:
        """Whether the graph was destroyed with its device's others (recorded_graphs): the round is captured again."""
        return self.graph.expired

    def replay(self) -> None:
        self.graph.replay()


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the row's own tokens (transformers' prompt lookup, per row): the tokens that
    followed the latest earlier occurrence of the row's last n tokens (n = max_ngram down to 1); a row with no match
    drafts its last token repeated (a draft may always be wrong: it costs acceptance, never correctness). Each row's
    n-grams are indexed as the row grows (`NgramIndex`), so a round costs the tokens gained, not the row's length."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self._rows: list[NgramIndex] = []

    def draft(self, sequences: Sequence[torch.Tensor], count: int) -> torch.Tensor:
        if len(self._rows) != len(sequences):
            self._rows = [NgramIndex(self.max_ngram) for _ in sequences]
        drafts = [row.follow(tokens.tolist(), count) for row, tokens in zip(self._rows, sequences)]
        return torch.tensor(drafts, dtype=sequences[0].dtype)


class NgramIndex:
    """One row's n-grams (n = 1..max_ngram), each by its latest start among those that end before the row's last
    token (an n-gram's follower must exist), indexed once each as the row grows."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # by n
        self.indexed = [0] * (max_ngram + 1)  # by n: the starts below it are in latest[n]

    def follow(self, tokens: list[int], count: int) -> list[int]:
        """The `count` tokens after the latest earlier occurrence of the last n of `tokens`, for the largest n that
        has one (see PromptLookupDrafter), padded with their last; `tokens` extends the last call's (else the index
        starts over: another row or another call)."""
        if tokens[: len(self.tokens)] != self.tokens:
            self.latest = [{} for _ in range(self.max_ngram + 1)]
            self.indexed = [0] * (self.max_ngram + 1)
        self.tokens = tokens
        length = len(tokens)
        for n in range(1, self.max_ngram + 1):
            latest = self.latest[n]
            for start in range(self.indexed[n], length - n):  # (the last n-gram itself is not an earlier one)
                latest[tuple(tokens[start: start + n])] = start
            self.indexed[n] = max(self.indexed[n], length - n)
        found = tokens[-1:]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self.latest[n].get(tuple(tokens[length - n:]))
            if start is not None:
                found = tokens[start + n: start + n + count]
                break
        return (found + found[-1:] * count)[:count]


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


def check_assisted_request(model, generation_config, generation_mode_kwargs: dict) -> None:
    """One line, before any work, for an assisted `generate` request no loop takes: a prompt_lookup_num_tokens that
    is not a positive integer, or an `assistant_model` of another vocabulary given without the two tokenizers that
    transformers' universal assisted decoding translates drafts with (one row)."""
    if generation_config.prompt_lookup_num_tokens is not None:
        _requested_drafts("prompt_lookup_num_tokens", generation_config.prompt_lookup_num_tokens)
    assistant = generation_mode_kwargs.get("assistant_model")
    if assistant is None or {"tokenizer", "assistant_tokenizer"} <= set(generation_mode_kwargs):
        return
    theirs, ours = assistant.config.get_text_config().vocab_size, model.config.get_text_config().vocab_size
    if theirs != ours:
        raise ValueError(f"the assistant model's vocabulary has {theirs} tokens and this model's {ours}: its drafts "
                         "would be other tokens; draft with a model of the same tokenizer, or (one row) pass "
                         "tokenizer= and assistant_tokenizer= for transformers' universal assisted decoding.")


def _check_draft(draft: object, batch: int, count: int, vocab: int) -> torch.Tensor:
    if not isinstance(draft, torch.Tensor) or tuple(draft.shape) != (batch, count) or draft.is_floating_point():
        shape = tuple(draft.shape) if isinstance(draft, torch.Tensor) else type(draft).__name__
        raise ValueError(f"the drafter returned {shape}; draft(sequences, count) must return integer token ids "
                         f"[batch, count] = {(batch, count)}.")
    if draft.numel() and not (0 <= int(draft.min()) and int(draft.max()) < vocab):
        raise ValueError(f"the drafter returned token ids outside the model's vocabulary (0 to {vocab - 1}): "
                         "draft with a model of the same vocabulary.")
    return draft.long()


class _RowProgress:
    """Each row's tokens on the host: its prompt's real tokens, the tokens it has gained, whether it has ended."""

    def __init__(self, prompts: list[torch.Tensor], first: list[int], max_new_tokens: int, eos_token_id: int | None):
        self.prompts, self.max_new_tokens, self.eos_token_id = prompts, max_new_tokens, eos_token_id
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.done = [False] * len(prompts)
        self.gain([[1, token] for token in first])

    def gain(self, report: list[list[int]]) -> bool:
        """Takes a round's report rows (kept, greedy...): each live row's kept tokens, cut at its end-of-sequence
        token or at max_new_tokens. Returns whether a row ended."""
        ended = False
        for b, (kept, *greedy) in enumerate(report):
            if self.done[b]:
                continue
            gained = greedy[:kept]
            if self.eos_token_id is not None and self.eos_token_id in gained:
                gained, self.done[b] = gained[: gained.index(self.eos_token_id) + 1], True
            self.generated[b] += gained
            self.done[b] = self.done[b] or len(self.generated[b]) >= self.max_new_tokens
            ended = ended or self.done[b]
        return ended

    def sequences(self) -> list[torch.Tensor]:
        """Each row's tokens so far (what a host drafter drafts from)."""
        return [torch.cat([p, torch.tensor(g, dtype=p.dtype)]) for p, g in zip(self.prompts, self.generated)]

    def live(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([not d for d in self.done], device=device)

    def finished(self) -> bool:
        return all(self.done)


class ReportReader:
    """Brings each round's report [B, 1 + k] to the host without waiting on the rounds launched after it: a copy, in
    stream order, into one of `buffers` host buffers (pinned on CUDA), and an event to wait on."""

    def __init__(self, shape: tuple[int, int], device: torch.device, buffers: int):
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(shape, dtype=torch.long, pin_memory=cuda) for _ in range(buffers)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(buffers)]
        self.waiting: deque[int] = deque()
        self.next = 0

    def push(self, report: torch.Tensor) -> None:
        slot, self.next = self.next, (self.next + 1) % len(self.buffers)
        self.buffers[slot].copy_(report, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.waiting.append(slot)

    def pop(self) -> list[list[int]]:
        """The oldest pushed report, as rows of ints (waits for it)."""
        slot = self.waiting.popleft()
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return self.buffers[slot].tolist()


def rounds_ahead(drafts_on_device: bool, device: torch.device) -> int:
    """Rounds launched before the oldest unread one's report is read. 1 where the drafts are made on the device and
    the device runs behind the host (CUDA): round r + 1 needs nothing from the host, so the host reads round r's
    tokens while the device runs r + 1. A row that ended in round r is then still live in round r + 1, whose tokens
    for it are dropped (the cache has the slots: speculative_generate). 0 otherwise (a host drafter drafts from the
    tokens read)."""
    return int(drafts_on_device and device.type == "cuda")


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
    observes = getattr(drafter, "observes_hidden_states", False)
    reads = getattr(drafter, "reads", "final") if observes else False  # (the hidden states it observes)
    # a drafter that drafts from device state alone (the MTP head) drafts inside each round: drafting_round
    on_device = observes and getattr(drafter, "drafts_on_device", False)
    ahead = rounds_ahead(on_device, device)
    # slots: a live row writes at most up to slot prompt + max_new_tokens - 2 + num_tokens - 1; a row that ended
    # with its last round's drafts all accepted has a length up to prompt + max_new_tokens - 2 + num_tokens (plus
    # num_tokens for each round run ahead), and its verify tokens are still written after it in the rounds the other
    # rows go on with: num_tokens more slots
    slots = prompt + max_new_tokens + (2 + ahead) * num_tokens
    stored = None
    if graphs:  # the captured round, its cache and on-device drafter kept across calls (kept_verify_rounds.py)
        slots = static_cache_slots(slots)
        key = round_key(batch, num_tokens, slots, reads, drafter if on_device else None, device)
        stored = kept_rounds(model).entry(model, key, lambda: VerifyCache(model, batch, slots, device),
                                          drafter if on_device else None)
        drafter = stored.drafter if on_device else drafter
    cache = stored.cache if stored is not None else VerifyCache(model, batch, slots, device)
    real = attention_mask.bool().cpu() if attention_mask is not None else torch.ones(batch, prompt, dtype=torch.bool)
    with torch.no_grad():
        if observes:  # (the MTP head's drafter: it reads the model's hidden states of every verified position)
            first, hidden = prefill(model, cache, input_ids, attention_mask, with_hidden=reads)
            drafter.start(input_ids, attention_mask, hidden, first, cache.slots)
        else:
            first = prefill(model, cache, input_ids, attention_mask)
        rows = _RowProgress([row[mask] for row, mask in zip(input_ids.cpu(), real)], first.tolist(), max_new_tokens,
                            eos_token_id)
        if not rows.finished():
            round_ = stored.round if stored is not None else None
            if round_ is None:
                make = CapturedVerifyRound if graphs else VerifyRound
                round_ = make(model, cache, num_tokens, with_hidden=reads, drafter=drafter if on_device else None)
                if stored is not None:
                    stored.keep(model, round_)
            round_.ids[:, 0] = first
            if on_device:
                round_.ids[:, 1:] = drafter.draft(None, num_tokens - 1)
            with replays_under_way(device):  # (an assistant model's generate may record graphs between rounds)
                _run_rounds(round_, rows, drafter, ahead, model.config.vocab_size)
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=input_ids.dtype)
    for b, tokens in enumerate(rows.generated):
        tokens = tokens[:max_new_tokens]
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), out], dim=1).to(device)


def _run_rounds(round_: VerifyRound, rows: _RowProgress, drafter, ahead: int, vocab: int) -> None:
    """Verify rounds until every row has ended: a host drafter's drafts written into the round's ids before each
    (the round writes the last token itself), `ahead` rounds launched before a report is read, the rows' live flags
    written only when a row ends."""
    device = round_.ids.device
    batch, count = round_.ids.shape[0], round_.ids.shape[1] - 1
    round_.live.copy_(rows.live(device))
    reader, launched = ReportReader((batch, 2 + count), device, ahead + 1), 0  # (kept, then the k greedy tokens)
    while not rows.finished():
        while launched <= ahead:
            if round_.drafter is None:
                round_.ids[:, 1:].copy_(_check_draft(drafter.draft(rows.sequences(), count), batch, count, vocab))
            round_.replay()
            report = round_.outputs[0]
            if round_.drafter is None and getattr(drafter, "observes_hidden_states", False):
                drafter.observe(report[:, 1:].clone(), report[:, 0].clone(), round_.outputs[1].clone())
            reader.push(report)
            launched += 1
        launched -= 1
        if rows.gain(reader.pop()):
            round_.live.copy_(rows.live(device))


def batched_loop_refuses(logits_processor, stopping_criteria, generation_config, streamer) -> list[str]:
    """What of an assisted `generate` request `assisted_generate_batch` does not take (empty: it takes it all)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    eos = generation_config._eos_token_tensor
    return [name for name, present in (
        ("do_sample=True", generation_config.do_sample),
        # (with do_sample, sampling's own warpers are logits processors: do_sample names the request)
        ("logits processors (repetition penalty, min_new_tokens, bad words, ...)",
         len(logits_processor or []) > 0 and not generation_config.do_sample),
        ("stopping criteria other than max_length and eos_token_id",
         any(not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria or [])),
        ("a streamer", streamer is not None),
        ("return_dict_in_generate=True", generation_config.return_dict_in_generate),
        ("several eos_token_id values", eos is not None and eos.numel() > 1)) if present]


def cap_drafts(generator: Any, max_length: int) -> Any:
    """transformers' candidate generator (one row's assisted decoding: prompt lookup, an assistant model, the MTP head)
    with its drafts cut to MAX_VERIFY_TOKENS - 1 (what a GDN/KDA layer restores after a rejection: its window of a
    forward's last MAX_ROLLBACK_TOKENS) and to max_length (prompt lookup may propose past it; the static cache holds
    max_length). The generator keeps its class (transformers checks it) and its own schedule of draft lengths, which
    sees the cut drafts."""
    drafts = generator.get_candidates

    def get_candidates(input_ids: torch.LongTensor, *args, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        ids, logits = drafts(input_ids, *args, **kwargs)
        kept = min(MAX_VERIFY_TOKENS - 1, max(max_length - input_ids.shape[1] - 1, 0))
        if ids.shape[1] - input_ids.shape[1] > kept:
            ids = ids[:, : input_ids.shape[1] + kept]
            logits = logits[:, :kept] if logits is not None else None
        return ids, logits

    generator.get_candidates = get_candidates
    return generator


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
    on for the device (`set_cuda_graph_decoding`; captured once, and kept with its cache for later calls:
    kept_verify_rounds).
    Greedy only, with generate's length and one end-of-sequence stop: anything else (sampling, logits processors,
    other stopping criteria, streaming, a dict output, several eos_token_id values) is refused in one line.
    Returns the sequences as `generate` does: cut after the last column a row still generated."""
    rows = "one row" if input_ids.shape[0] == 1 else f"{input_ids.shape[0]} rows"
    unsupported = batched_loop_refuses(logits_processor, stopping_criteria, generation_config, streamer)
    if unsupported:
        raise ValueError(f"assisted generate of {rows} runs batched greedy speculative decoding, which does not take "
                         f"{', '.join(unsupported)}; leave those out, or generate one row at a time.")
    if generation_config.use_mtp:  # (checked by mtp_drafting.check_mtp_generation before any work)
        drafter = MTP_HEADS[model.config.mtp_type].batch_drafter(model)
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
    "NgramIndex",
    "PromptLookupDrafter",
    "ReportReader",
    "VerifyRound",
    "assisted_generate_batch",
    "batched_loop_refuses",
    "cap_drafts",
    "chain_round",
    "check_assisted_request",
    "check_speculative_inputs",
    "drafting_round",
    "forward_tokens",
    "prefill",
    "rounds_ahead",
    "speculative_generate",
    "verify_round",
]

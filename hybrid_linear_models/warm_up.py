"""`HybridLinearForCausalLM.warm_up`: what generation will need, compiled, tuned and captured at process start.

A process's first call of a kind pays for work later calls of that kind do not: Triton kernels compiled and autotuned
for their first shapes (fla's; this package's tune only here, inside `kernel_tuning.autotuning()`, and elsewhere run
a default configuration), and with a static cache on CUDA (generate's default there) the decoding step's
graph per batch size and cache size, and the prompts' graphs per length bucket. None of it is keyed on the exact
prompt length (static caches come in few sizes: static_cache_slots; prompt graphs in 4 buckets per doubling up to
cuda_graph_prefill.LARGEST_CAPTURED_TOKENS; the kernels' compile and tuning keys hold widths, batch sizes and flags,
not token counts), so one call up front takes all of it for the requests it covers:

- static caches (CUDA, graph decoding on): `max_length` (prompt plus new tokens) fixes the size of every later static
  cache of up to that many tokens (transformers keeps the largest size asked: `_previous_max_cache_length`); for each
  batch size, a short generate per prompt bucket captures that bucket's graph (rows left-padded too, above batch 1),
  and the first one also the decoding step's;
- the dynamic cache (`cache_implementation="dynamic"`, beam search): a prompt of each divisibility Triton
  specialises an integer argument on (a multiple of 16, and not), for each batch size, left-padded too above batch 1
  (fla's variable-length kernels), each with decoding steps; where `max_length` allows, also the shortest prompts
  that run in pieces of tokens (token_chunks; fla's kernels then take the state carried from the piece before, a
  tuning key of theirs), their last piece of each divisibility; and with FP8 weights, the prompts that reach each
  row tile of their products (`fp8_layers.fp8_tuning_prompt_lengths`).

On a CPU nothing is compiled, tuned or captured: one short prompt per batch size (what a first decoding step builds
once, the stacked projections). It refuses, in one line and before allocating anything, arguments that are not
positive integers, a length past the model's positions, or caches that would not fit in memory (the default cache's
prompts of the largest batch, and each static cache), and prints what it did and the seconds it took.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import StaticCache

from .cache_checks import check_static_cache_size
from .cuda_graph_prefill import captured_buckets
from .fp8_layers import fp8_tuning_prompt_lengths
from .kernel_tuning import autotuning
from .position_limit import model_position_limit
from .shown_values import brief
from .static_cache_slots import static_cache_slots
from .token_chunks import shortest_chunked_length

NEW_TOKENS = 2  # per warm-up generate: the prefill, then a decoding step (the first replayed or run uncaptured)
DYNAMIC_CACHE_LENGTHS = (64, 65)  # a multiple of 16 and not: the two specialisations of a length argument


@dataclass
class WarmUpReport:
    """What `warm_up` did: the batch sizes, the static caches' key slots (None: static caches not warmed), the graphs
    captured (decoding steps and prompt buckets), the generate calls it made and the seconds it took."""

    batch_sizes: tuple[int, ...]
    static_cache_slots: int | None
    captured_steps: int
    captured_prompts: int
    generate_calls: int
    seconds: float

    def __str__(self) -> str:
        static = ("static caches not warmed (graphs need CUDA and set_cuda_graph_decoding(True))"
                  if self.static_cache_slots is None else
                  f"static caches of {self.static_cache_slots} slots: {self.captured_steps} decoding step(s) and "
                  f"{self.captured_prompts} prompt bucket(s) captured")
        return (f"warm_up: batch sizes {list(self.batch_sizes)}, {static}; {self.generate_calls} generate calls in "
                f"{self.seconds:.1f} s")


def warm_up(model, max_batch_size: int = 1, max_length: int | None = None, batch_sizes: list[int] | None = None,
            verbose: bool = True) -> WarmUpReport:
    """See the module docstring. max_length: the most tokens (prompt plus new) a request will hold, the model's
    positions by default; batch_sizes: those to warm (1 and max_batch_size by default; others warm at first use)."""
    reach = model_position_limit(model.model)  # (None: no limit; max_position_embeddings is then the default)
    positions = reach[0] if reach is not None else None
    max_length = (positions or model.config.max_position_embeddings) if max_length is None else max_length
    sizes = _batch_sizes(batch_sizes, max_batch_size)
    _check_arguments(max_batch_size, max_length, sizes, reach)
    device = next(model.parameters()).device
    graphs = model.captures_graphs_on(device)
    # (a larger size an earlier call fixed stays: transformers never shrinks it)
    slots = max(static_cache_slots(max_length, positions), getattr(model, "_previous_max_cache_length", 0) or 0) \
        if graphs else None
    # on a CPU nothing is compiled, tuned or captured: one short prompt per batch size builds what a first decoding
    # step builds once (stacked projections); the other lengths and the padded rows serve GPU kernels' keys
    tunes = compiles_kernels_on(device)
    lengths = _dynamic_cache_lengths(max_length, fp8_tuning_prompt_lengths(model)) if tunes else \
        _dynamic_cache_lengths(max_length)[:1]
    # the memory of every cache asked for, before any allocation: the dynamic prompts' (as large as a static cache
    # of their tokens) and each static cache's
    _check_cache_memory(model, max(sizes), max(lengths) + NEW_TOKENS, max_length, "its prompts' caches")
    if graphs:
        for batch in sizes:
            _check_cache_memory(model, batch, slots, max_length, "a static cache")
    start = time.perf_counter()
    steps_before = len(model._graph_decoder.captured_keys) if graphs else 0
    # (None: prompts run uncaptured; so do a model's with sliding-window layers: cuda_graph_prefill's obstacle)
    prompt_graphs = model._graph_prefill if graphs and "sliding_attention" not in model.config.layer_types else None
    prompts_before = len(prompt_graphs._graphs) if prompt_graphs is not None else 0
    calls = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autotuning():
            # the dynamic cache first: its decoding steps stack projection weights into shared storage once
            # (fused_projections), which graphs captured before would read as moved weights and capture again
            for batch in sizes:
                for padded in (False, True) if batch > 1 and tunes else (False,):
                    for length in lengths:
                        _generate(model, batch, length, padded, device, "dynamic")
                        calls += 1
            if graphs:
                model._previous_max_cache_length = slots
                # a first static generate captures a decoding step, whose kept weights (the stacked projections its
                # GEMVs read: derived_weights) prompt graphs captured before it would find changed
                _generate(model, sizes[0], min(64, slots - NEW_TOKENS), False, device, "static")
                calls += 1
                calls += _capture_steps_and_prompts(model, sizes, slots, device, prompt_graphs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        model.train(was_training)
    report = WarmUpReport(
        batch_sizes=sizes, static_cache_slots=slots,
        captured_steps=(len(model._graph_decoder.captured_keys) - steps_before) if graphs else 0,
        captured_prompts=(len(prompt_graphs._graphs) - prompts_before) if prompt_graphs is not None else 0,
        generate_calls=calls, seconds=time.perf_counter() - start)
    if verbose:
        print(report, flush=True)
    return report


def _capture_steps_and_prompts(model, sizes, slots: int, device: torch.device, prompt_graphs) -> int:
    """For each batch size a static generate per prompt bucket, each bucket's graph captured at its first prompt
    (rows left-padded too, above batch 1); where prompts are not captured, one generate per batch size (its
    decoding step's graph). Returns the generate calls made."""
    calls = 0
    if prompt_graphs is not None:
        prompt_graphs.capture_first_use = True
    try:
        for batch in sizes:
            for padded in (False, True) if batch > 1 else (False,):
                buckets = captured_buckets(batch, slots) if prompt_graphs is not None else []
                for bucket in buckets or [min(64, slots - NEW_TOKENS)]:
                    _generate(model, batch, min(bucket, slots - NEW_TOKENS), padded, device, "static")
                    calls += 1
    finally:
        if prompt_graphs is not None:
            prompt_graphs.capture_first_use = False
    return calls


def _dynamic_cache_lengths(max_length: int, tiles: Sequence[int] = ()) -> list[int]:
    """The prompt lengths of the dynamic cache's warm-up (see the module docstring), with `tiles` (the lengths that
    reach the FP8 products' row tiles), that fit in `max_length`."""
    lengths = [*DYNAMIC_CACHE_LENGTHS, *tiles]
    chunked = shortest_chunked_length()
    if chunked + 1 + NEW_TOKENS <= max_length:
        lengths += [chunked, chunked + 1]
    return list(dict.fromkeys(min(n, max_length - NEW_TOKENS) for n in lengths))


def _check_arguments(max_batch_size, max_length, sizes, reach: tuple[int, str] | None) -> None:
    for name, value in (("max_batch_size", max_batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"warm_up: {name} must be a positive integer, got {value!r}.")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"warm_up: batch_sizes must be positive integers, got {list(sizes)!r}.")
    if reach is not None and max_length > reach[0]:
        raise ValueError(f"warm_up: max_length={max_length} passes the model's {reach[0]} positions "
                         f"({reach[1]}): ask for at most {reach[0]} tokens.")
    if max_length <= NEW_TOKENS:
        raise ValueError(f"warm_up: max_length={max_length} leaves no room for a prompt and {NEW_TOKENS} new tokens: "
                         f"ask for at least {NEW_TOKENS + 1}.")


def compiles_kernels_on(device: torch.device) -> bool:
    """Whether generate on `device` runs kernels compiled and tuned per shape (Triton's, fla's: CUDA), which the
    warm-up's prompt lengths and padded rows are chosen to reach."""
    return device.type == "cuda"


def _batch_sizes(batch_sizes, max_batch_size) -> tuple:
    """The batch sizes to warm, sorted without repeats: 1 and max_batch_size by default (checked with the other
    arguments), or a non-empty list of positive integers."""
    if batch_sizes is None:
        return tuple(sorted({1, max_batch_size})) if isinstance(max_batch_size, int) else (max_batch_size,)
    if (not isinstance(batch_sizes, (list, tuple)) or not batch_sizes
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes)):
        raise ValueError(f"warm_up: batch_sizes must be a non-empty list of positive integers (the batch sizes to "
                         f"warm), got {brief(batch_sizes)}; pass e.g. batch_sizes=[1, 8], or leave it out.")
    return tuple(sorted(set(batch_sizes)))


def _check_cache_memory(model, batch: int, slots: int, max_length: int, what: str) -> None:
    """A cache of `batch` rows and `slots` tokens the warm-up would fill, checked for memory before any is allocated
    (no buffer is allocated here: transformers' static layers allocate on their first update)."""
    cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=slots)
    try:
        check_static_cache_size(model.model, cache, batch)
    except ValueError as error:
        raise ValueError(f"warm_up(max_batch_size={batch}, max_length={max_length}), {what} of {slots} slots: "
                         f"{error}") from None


def _generate(model, batch: int, length: int, padded: bool, device: torch.device, cache: str | None) -> None:
    """One short generate of random tokens: `batch` rows of `length`, the rows after the first left-padded by up to
    half when `padded`."""
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=generator).to(device)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch):
            mask[row, : row * length // (2 * batch)] = 0
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                   pad_token_id=pad, cache_implementation=cache)

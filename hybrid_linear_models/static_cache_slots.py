"""How many key slots `generate` gives a static cache: the tokens asked for, rounded up to one of few sizes.

transformers' `generate(..., cache_implementation="static")` sizes a new static cache per call to the prompt plus the
new tokens, and never below the largest size an earlier call made (`_previous_max_cache_length`). What is captured for
a static cache (the decoding step's CUDA graph, the prompts' graphs: cuda_graph_decoding, cuda_graph_prefill) is
captured per cache size, so sizes taken from each request's exact length would capture again at every new longest
request. Rounded up to 2 sizes per doubling from 256 slots (256, 384, 512, 768, 1,024, ...: 24 sizes up to 1M), a
process meets at most a few, and `HybridLinearForCausalLM.warm_up` takes the one for its longest request up front.
The rounding never passes the model's positions (`max_position_embeddings`), and gives way to the exact size where
the rounded one's buffers would not fit in memory (cache_checks.check_static_cache_size says so before allocating).
"""

from __future__ import annotations

SMALLEST_SLOTS = 256
SIZES_PER_DOUBLING = 2


def static_cache_slots(tokens: int, positions: int | None = None) -> int:
    """The key slots of a static cache for `tokens` tokens per row: the next of 256, 384, 512, 768, ... (2 per
    doubling), at most `positions` (the model's) where `tokens` fits in them."""
    if tokens <= SMALLEST_SLOTS:
        slots = SMALLEST_SLOTS
    else:
        power = 1 << (tokens - 1).bit_length() - 1  # the largest power of two below tokens
        step = power // SIZES_PER_DOUBLING
        slots = -(-tokens // step) * step
    if positions is not None and tokens <= positions:
        slots = min(slots, positions)
    return max(slots, tokens)

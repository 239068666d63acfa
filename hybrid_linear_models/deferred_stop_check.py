"""`generate`'s stop check one step behind on CUDA, for this package's models (their `_sample`).

transformers' sampling loop ends every step by reading `unfinished_sequences.max() == 0` on the host. At batch 1 on a
GPU that read is the cost that remains once a decoding step is one replayed CUDA graph: the host waits for the step to
finish, then the GPU waits while the host runs the loop's Python, the input preparation and the replay's bookkeeping
(a fifth or more of a step's time on a GPU server's host: docs/performance.md). transformers (5.24) has the remedy,
`DeferredStopCheck`: the flag is copied to pinned memory without waiting and read one step later, so the host queues
step t + 1 while the GPU runs step t; a stop found a step late costs one more forward, whose token `generate` drops.
transformers turns it on for "mps" only, waiting to see gains on CUDA; the gain is measured here
(`benchmarks/bench_generation.py`), so within this package's `_sample` (`deferred_stop_checks`) it is on for CUDA too.

What `generate` returns does not change (`tests/test_deferred_stop_check.py` compares sequences, scores and streamed
tokens with the check deferred and not). transformers' cache rule is kept: a cache handed back to the caller (one the
caller passed in, or `return_dict_in_generate=True`) must be croppable to undo the extra step, and GDN/KDA states are
not (one state per row, overwritten each step), so with one the check stays synchronous. So does generation with
`synced_gpus` (peers stepping in lockstep under ZeRO-3 or FSDP), which transformers never defers either.

The switch is `DeferredStopCheck.is_supported`, which `_sample` asks; it is wrapped once per process, on first use,
so that it also answers for CUDA while a context variable says a model of this package is sampling (per thread and
task: another model's `generate`, elsewhere, sees transformers' rule unchanged). A transformers without
`DeferredStopCheck` leaves the check synchronous."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from transformers.generation import utils as generation_utils

_DEFERRING = contextvars.ContextVar("hybrid_linear_models_deferred_stop_checks", default=False)


def _deferrable(device: torch.device | str, cache, cache_is_returned: bool, is_assistant: bool) -> bool:
    """transformers' rule without its device gate: not for an assistant model, and a cache that is handed back must be
    croppable (the extra step undone)."""
    if is_assistant or torch.device(device).type != "cuda":
        return False
    return cache is None or not cache_is_returned or bool(cache.is_croppable)


def _installed_switch() -> contextvars.ContextVar | None:
    """The context variable the wrapped `DeferredStopCheck.is_supported` reads, wrapping it first if nothing has (one
    wrapper and one variable per process, whichever copy of this module installed them: a saved folder's remote code
    loaded beside the package is another copy); None when this transformers has no deferred check."""
    deferred = getattr(generation_utils, "DeferredStopCheck", None)
    if deferred is None or not hasattr(deferred, "is_supported"):
        return None
    switch = getattr(deferred.is_supported, "_hybrid_linear_switch", None)
    if switch is not None:
        return switch
    original, switch = deferred.is_supported, _DEFERRING

    def is_supported(device, cache, cache_is_returned, is_assistant=False):
        if switch.get() and _deferrable(device, cache, cache_is_returned, is_assistant):
            return True
        return original(device, cache, cache_is_returned, is_assistant=is_assistant)

    is_supported._hybrid_linear_switch = switch
    deferred.is_supported = staticmethod(is_supported)
    return switch


@contextlib.contextmanager
def deferred_stop_checks(enabled: bool = True) -> Iterator[bool]:
    """Within it, `generate`'s stop check on a CUDA device runs one step behind (see the module docstring); yields
    whether it can (enabled, and this transformers has a deferred check)."""
    switch = _installed_switch() if enabled else None
    if switch is None:
        yield False
        return
    token = switch.set(True)
    try:
        yield True
    finally:
        switch.reset(token)

"""Captured speculative verify rounds kept across `generate` calls, with the caches they read.

A captured round (`speculative_decoding.CapturedVerifyRound`) is bound to the tensors it read when it was recorded:
its `VerifyCache` and, for a drafter that drafts on the device (the MTP head's `MtpBatchDrafter`), the drafter's own
cache and state. Recording one runs an eager round to warm up, records, and saves and restores the caches around
both: tens of milliseconds, the time of dozens of replayed rounds, so a call that captured its own round spent a
large share of its time there.

So a model keeps its rounds (`KeptVerifyRounds`, one per model), each with its cache and drafter, under the key
(batch, verify tokens k, cache slots, whether the round returns hidden states, the on-device drafter's type, device).
A later call with that key starts the cache over (`VerifyCache.start_over`: the same buffers, emptied), runs its
prompts into them and replays the kept graph. The slots are the call's need rounded up to few sizes
(`static_cache_slots`: 2 per doubling), so a process meets few keys; at most KEPT_ROUNDS are kept, the least recently
used dropped. Before a kept round is used, the weights it reads are checked as a captured decoding step's are
(`cuda_graph_decoding.WeightsRead`: the kept derived weights, every parameter and buffer): a weight replaced or
given new storage, or a derived weight made stale, drops it, and the call captures afresh. The kept caches stay allocated
between calls, as the captured decoding step's cache storage does; `set_cuda_graph_decoding` drops them all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cuda_graph_decoding import WeightsRead
from .verify_cache import VerifyCache

KEPT_ROUNDS = 4  # kept rounds per model (batch sizes, k, cache sizes), the least recently used dropped


@dataclass
class KeptRound:
    """A verify cache, the on-device drafter that drafts from it (None for a host drafter), the round captured on
    them (None until the first round of the first call), and what its weights were at capture."""

    cache: VerifyCache
    drafter: object | None
    round: object | None = None
    read: WeightsRead | None = None  # the weights the round read, at capture

    def keep(self, model, captured) -> None:
        """Keeps `captured` (a CapturedVerifyRound on this cache and drafter) and the weights it read."""
        self.round, self.read = captured, WeightsRead(model)

    def stale(self) -> bool:
        """Whether the kept round's graph was destroyed (recorded_graphs), or a weight it reads changed since its
        capture (see the module docstring)."""
        return self.round is not None and (self.round.expired or self.read.changed())


class KeptVerifyRounds:
    """One model's kept rounds, by key (see the module docstring)."""

    def __init__(self):
        self._rounds: OrderedDict[tuple, KeptRound] = OrderedDict()

    def __reduce__(self):
        """Copies (copy.deepcopy of the model, pickling) start with nothing kept: a CUDA graph cannot be copied, and
        it reads the original's weights and caches, not the copy's."""
        return KeptVerifyRounds, ()

    def entry(self, model, key: tuple, make_cache: Callable[[], VerifyCache], drafter: object | None) -> KeptRound:
        """The kept round of `key`, its cache started over; a new entry (a new cache from make_cache(), `drafter`
        kept with it, no round yet) where none is kept or the kept one is stale."""
        kept = self._rounds.pop(key, None)
        if kept is not None and kept.stale():
            kept = None
        if kept is None:
            kept = KeptRound(make_cache(), drafter)
        else:
            kept.cache.start_over()
        self._rounds[key] = kept
        while len(self._rounds) > KEPT_ROUNDS:
            self._rounds.popitem(last=False)
        return kept

    def clear(self) -> None:
        self._rounds.clear()


def kept_rounds(model) -> KeptVerifyRounds:
    """The model's kept rounds (made on first use)."""
    kept = getattr(model, "_kept_verify_rounds", None)
    if kept is None:
        kept = KeptVerifyRounds()
        model._kept_verify_rounds = kept
    return kept


def round_key(batch: int, tokens: int, slots: int, with_hidden: bool | str, drafter: object | None,
              device: torch.device) -> tuple:
    """The key of a kept round: an on-device drafter by its type (it keeps only device state, which the kept entry's
    drafter holds), a host drafter not at all (the round does not read it)."""
    return batch, tokens, slots, with_hidden, type(drafter).__qualname__ if drafter is not None else None, device


__all__ = ["KEPT_ROUNDS", "KeptRound", "KeptVerifyRounds", "kept_rounds", "round_key"]

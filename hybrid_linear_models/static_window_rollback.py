"""A static sliding-window attention layer that `crop` restores exactly, for assisted decoding with a static cache.

transformers' `StaticSlidingWindowLayer` keeps the last `window` keys of a row in a buffer of `window` slots: once a
forward passes the window, the keys it pushes out are gone, so `crop` after a rejected draft cannot put them back, and
the layer says it is not croppable (`generate(cache_implementation="static", prompt_lookup_num_tokens=...)` is then
refused). `RollbackSlidingWindowLayer` is that layer plus, while the cache records its past
(`cache.activate_past_recording()`, which assisted generation calls), a history of its last
window + MAX_ROLLBACK_TOKENS keys and values in order. `crop(-n)` rebuilds the buffer from the history as
transformers' own updates leave it after the kept tokens (keys in order, the newest last once full; slots 0..len-1
before it is full), and moves both counters back: exact, since the buffer then holds the very values a forward of
the kept prefix writes. A crop reaches at most MAX_ROLLBACK_TOKENS tokens back past the window and is refused, in one
line, further. Without past recording the layer is transformers' own (crops only while the window was never passed).

The history costs (window + MAX_ROLLBACK_TOKENS) keys and values per row, a copy per forward while recording; plain
decoding (no recording) keeps none. `adopt_static_window_layers` takes each empty transformers layer of a cache as
one, before the model's first forward writes into it (as the GDN/KDA layers are adopted: cache_hybrid_linear.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from .state_rollback import MAX_ROLLBACK_TOKENS


class RollbackSlidingWindowLayer(StaticSlidingWindowLayer):
    """transformers' static sliding-window layer, restorable by `crop` while it records its past (module docstring)."""

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, sliding_window=sliding_window, **kwargs)
        self.record_past = False
        self._history: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H, n, D] keys and values, in order

    @classmethod
    def like(cls, layer: StaticSlidingWindowLayer) -> RollbackSlidingWindowLayer:
        """An empty layer of `layer`'s window and croppability (`layer.max_cache_len` is its buffer: min(window,
        the cache's slots))."""
        new = cls(max_cache_len=layer.max_cache_len, sliding_window=layer.max_cache_len)
        new._is_croppable = layer._is_croppable
        return new

    def activate_past_recording(self) -> None:
        self.record_past = True

    @property
    def is_croppable(self) -> bool:
        return self.record_past or self._is_croppable

    def _ordered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the buffer holds, oldest first (the filled slots before it is full)."""
        held = min(self.cumulative_length_int, self.max_cache_len)
        return self.keys[:, :, :held], self.values[:, :, :held]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.record_past:
            self._history = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before = self._history if self._history is not None else tuple(t.clone() for t in self._ordered())
        keep = self.max_cache_len + MAX_ROLLBACK_TOKENS
        self._history = tuple(torch.cat([old, new.to(old.dtype)], dim=2)[:, :, -keep:]
                              for old, new in zip(before, (key_states, value_states)))
        return super().update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last -tokens_to_remove tokens, the buffer rebuilt from the history (module docstring)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass the negative count of tokens to remove (crop(-2) drops "
                             "the last 2), as transformers' cache layers take it.")
        if tokens_to_remove == 0:
            return
        if self._history is None:
            if not self._is_croppable:
                raise ValueError(
                    f"crop({tokens_to_remove}): this sliding-window layer passed its window of {self.max_cache_len} "
                    "keys without recording them; call cache.activate_past_recording() before the forwards to cut "
                    "back (assisted generate does).")
            super().crop(tokens_to_remove)
            return
        held = self.cumulative_length_int
        target = held + tokens_to_remove
        keys, values = self._history
        reach = held - keys.shape[2]  # the token count at the history's first key
        if target < 0 or target - min(target, self.max_cache_len) < reach:
            raise ValueError(
                f"crop({tokens_to_remove}): the sliding-window layer holds {held} tokens and keeps the keys to restore "
                f"it to {max(reach + self.max_cache_len, 0)} to {held} tokens (its window of {self.max_cache_len} plus "
                f"{MAX_ROLLBACK_TOKENS}); re-run the prompt, or copy the cache (copy.deepcopy) before the tokens to "
                "drop.")
        cut = keys.shape[2] + tokens_to_remove
        keys, values = keys[:, :, :cut], values[:, :, :cut]
        kept = min(target, self.max_cache_len)
        self.keys[:, :, :kept].copy_(keys[:, :, cut - kept:])
        self.values[:, :, :kept].copy_(values[:, :, cut - kept:])
        self._history = (keys, values)
        self.cumulative_length_int = target
        self.cumulative_length.fill_(kept)

    def reset(self) -> None:
        super().reset()
        self._history = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._history = None
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._history = None
        super().batch_select_indices(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._history = None
        super().reorder_cache(beam_idx)


def adopt_static_window_layers(cache, record_past: bool = False) -> None:
    """Takes each empty `StaticSlidingWindowLayer` of `cache` (transformers' own class, not a subclass) as a
    `RollbackSlidingWindowLayer`, in place, recording its past with `record_past` (the cache's other layers were
    asked to: `activate_past_recording` skips transformers' layer, which has no such method)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer and not layer.is_initialized:
            cache.layers[index] = RollbackSlidingWindowLayer.like(layer)
            cache.layers[index].record_past = record_past


__all__ = ["RollbackSlidingWindowLayer", "adopt_static_window_layers"]

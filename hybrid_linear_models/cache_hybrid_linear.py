"""Generation cache of GDN/KDA layers, on transformers' own cache layers.

transformers builds every layer's cache from `config.layer_types` (`DynamicCache(config=...)`,
`StaticCache(config=..., max_cache_len=...)`, what `generate` builds): attention layers get its KV layers
(`DynamicLayer`, `DynamicSlidingWindowLayer`, or their static versions; a multi-head latent attention layer keeps
its compressed KV there, one [B, 1, T, r + rope] key tensor and an empty value, mixer_mla.py), "linear_attention"
layers its `LinearAttentionLayer`. A GDN/KDA layer keeps, per batch row, the last K-1 inputs of its short convolution
and its float32 recurrent state [H, dk, dv]: a fixed size, whatever the context length. It keeps them in
`LinearStateLayer`, transformers' `LinearAttentionLayer` with the layout this package's kernels update in place; the
model takes each empty `LinearAttentionLayer` of a cache it is given as one (`adopt_linear_layers`), before its first
forward writes into it. `crop` restores the layer to one of its last tokens from what its forwards kept
(state_rollback.py), for assisted/speculative decoding.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from .state_rollback import (
    MAX_ROLLBACK_TOKENS,
    RollbackWindow,
    crop_error,
    keeps_window,
)
from .static_window_rollback import adopt_static_window_layers


class LinearStateLayer(LinearAttentionLayer):
    """Cache of one GDN/KDA layer: conv state [B, C, K-1] and recurrent state [B, H, dk, dv] (float32).

    The conv state lives in the last K-1 columns of a [B, C, K] window (`conv_window`, whose first column no kernel
    reads: fla's layout, so a decoding step shifts the new input in, in place, in one kernel; after a step the window
    holds the K-1 inputs before it, then its own, which state_rollback keeps). Updates copy into the
    existing buffers (fixed addresses, so a captured CUDA graph or a compiled decode step can reuse them). A recurrent
    state cannot be cut back, only restored: `crop(-n)` restores the layer n tokens back from the window its last
    forwards kept (`rollback`, state_rollback.py), and refuses, in one line, a token it did not keep.

    The tokens it has seen are counted on the host in eager mode (`seen_tokens`, read without a synchronisation) and
    in a tensor on the states' device while torch.compile traces: a Python int that a compiled step updated would be
    a guard on its value, failing at the next step (one recompilation per token until dynamo makes it dynamic)."""

    is_compileable = True
    is_sliding = False
    # whether a kept window copies its tensors (views of the forward's, which a later forward may reuse); a verify
    # cache's windows are read within their round (verify_cache.py)
    window_copies = True
    # whether every forward that keeps a new window is followed by `restore` in the same round (a verify cache): the
    # forward then leaves the states as they were, its window's base is the state itself, and `restore` writes them
    restores_every_window = False

    def __init__(self, **kwargs):
        super().__init__(number_of_states=1)
        self._host_count = 0  # tokens stored in eager mode
        self._device_count: torch.Tensor | None = None  # tokens stored under torch.compile ([] int64)
        self._counted_on_device = False  # whether _device_count may be nonzero (set under compile, read in eager)
        self.rollback: RollbackWindow | None = None  # what restores the last tokens (state_rollback.py)

    @property
    def seen_tokens(self) -> int:
        """Tokens stored so far (a host read; one synchronisation only after compiled steps stored some)."""
        return self._host_count + (int(self._device_count) if self._counted_on_device else 0)

    @seen_tokens.setter
    def seen_tokens(self, count: int) -> None:
        if self._counted_on_device:  # (else the device count is zero: no kernel, which a replayed step's count would
            self._device_count.zero_()  # launch for every layer after every replay)
        self._host_count, self._counted_on_device = count, False

    # ------------------------------------------------------------------------------------------------ state

    @property
    def conv_state(self) -> torch.Tensor | None:
        """The last K-1 inputs of the convolution, [B, C, K-1] (a view of `conv_window`)."""
        return self.conv_states[0][..., 1:] if self.has_previous_state[0] else None

    @property
    def conv_window(self) -> torch.Tensor | None:
        """[B, C, K]: the conv state in its last K-1 columns, updated in place by `ops.causal_conv1d_step`."""
        return self.conv_states[0] if self.has_previous_state[0] else None

    @property
    def recurrent_state(self) -> torch.Tensor | None:
        return self.recurrent_states[0] if self.has_previous_state[0] else None

    @property
    def batch_size(self) -> int:
        if not self.is_recurrent_states_initialized[0]:  # absent until the first update, as for transformers' layers
            raise AttributeError("batch_size")
        return self.recurrent_states[0].shape[0]

    def store(self, conv_state: torch.Tensor | None, recurrent_state: torch.Tensor | None, new_tokens: int) -> None:
        """Keeps the states after `new_tokens` more tokens (conv_state None: `conv_window` was updated in place;
        recurrent_state None: both kept as they are, for `restore` to write: `restores_every_window`)."""
        if conv_state is not None:
            self.update_conv_state(conv_state)
        if recurrent_state is not None:
            self.update_recurrent_state(recurrent_state)
        self.has_previous_state[0] = True
        if self._device_count is None:  # (made by the first store, before any compiled step reads it)
            self._device_count = torch.zeros((), dtype=torch.int64, device=self.recurrent_states[0].device)
        if torch.compiler.is_compiling():
            self._device_count.add_(new_tokens)
            self._counted_on_device = True  # (written, never read, under compile: no guard)
        else:
            self._host_count += new_tokens

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        if conv_states is not None:  # [B, C, K-1] -> a zeroed [B, C, K] window
            self.device, self.dtype = conv_states.device, conv_states.dtype
            B, C, keep = conv_states.shape
            self.conv_states[state_idx] = conv_states.new_zeros(B, C, keep + 1)
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            self.recurrent_states[state_idx] = torch.zeros_like(recurrent_states)
            self.is_recurrent_states_initialized[state_idx] = True

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Writes the conv state [B, C, K-1] into the window's last K-1 columns."""
        window = self.conv_states[state_idx]
        if not self.is_conv_states_initialized[state_idx] or window[..., 1:].shape != conv_states.shape:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx)
        self.conv_states[state_idx][..., 1:].copy_(conv_states)
        return self.conv_states[state_idx]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        return self._write(self.recurrent_states, self.is_recurrent_states_initialized, "recurrent_states",
                           recurrent_states.to(torch.promote_types(recurrent_states.dtype, torch.float32)), state_idx)

    def _write(self, buffers, initialized, kind, value, state_idx):
        if initialized[state_idx] and value is buffers[state_idx]:
            return value  # updated in place by the kernel (recurrent_in_place.py)
        if not initialized[state_idx] or buffers[state_idx].shape != value.shape:
            self.lazy_initialization(**{kind: value, "state_idx": state_idx})
        buffers[state_idx].copy_(value)
        return buffers[state_idx]

    # ------------------------------------------------------------------------------------------ cache API

    def get_seq_length(self) -> int | torch.Tensor:
        """`seen_tokens`; while torch.compile traces, a tensor (as transformers' static layers count), read without
        a guard on the host count that compiled steps leave as it was."""
        if torch.compiler.is_compiling():
            count = torch.as_tensor(self._host_count, device=self._device_count.device) if (
                self._device_count is not None) else torch.tensor(self._host_count)
            return count + self._device_count if self._device_count is not None else count
        return self.seen_tokens

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.rollback = None

    # ------------------------------------------------------------------------------------------------ rollback

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can put the layer back as it was: while it records its past (transformers asks after the
        prefill of assisted decoding, having called `activate_past_recording`)."""
        return self.record_past

    def window_plan(self, tokens: int, packed: bool) -> str | None:
        """How a forward of `tokens` onto this layer keeps its tokens (state_rollback.py): None (not at all; a window
        kept before is dropped), "new" (a window from the state before it), "append" (onto the window, which it
        continues) or "split" (more than MAX_ROLLBACK_TOKENS: a window of its last ones)."""
        if torch.compiler.is_compiling():
            return None
        held = self.seen_tokens
        if not keeps_window(self.record_past, held, tokens, torch.is_grad_enabled(), packed):
            self.rollback = None
            return None
        if tokens > MAX_ROLLBACK_TOKENS:
            return "split"
        window = self.rollback
        return "new" if window is None or window.restart or window.end != held else "append"

    def keep_window(self, window: RollbackWindow, plan: str) -> None:
        """Keeps the window of the forward just stored, planned by `window_plan`; it ends at the layer's count."""
        window.start = self.seen_tokens - window.tokens
        if plan == "append":
            self.rollback.append(window)
        else:
            self.rollback = window

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last -tokens_to_remove tokens (a negative count, as transformers' layers take it): the conv
        window and the recurrent state restored from the kept window. crop(0) removes nothing."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass the negative count of tokens to remove (crop(-2) drops the last 2), as "
                "transformers' cache layers take it.")
        window = self.rollback
        if tokens_to_remove == 0:
            if window is not None:
                window.restart = True
            return
        held = self.seen_tokens
        target = held + tokens_to_remove
        if window is None or window.end != held or target < window.start:
            raise ValueError(crop_error(held, window, tokens_to_remove))
        kept = target - window.start
        state = window.state_after(kept)
        if state is None:
            self.recurrent_states[0].zero_()
        else:
            self.recurrent_states[0].copy_(state)
        self.conv_states[0][..., 1:].copy_(window.conv_state_after(kept))
        window.keep_first(kept)
        window.restart = True
        self.seen_tokens = target

    def _select(self, fn) -> None:
        self.rollback = None  # (kept for the rows in their old order)
        for states, initialized in ((self.conv_states, self.is_conv_states_initialized),
                                    (self.recurrent_states, self.is_recurrent_states_initialized)):
            if initialized[0]:
                states[0] = fn(states[0])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda x: x[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda x: x.index_select(0, beam_idx.to(x.device)))


def layer_bytes_per_token(layer: CacheLayerMixin) -> int:
    """Bytes a KV cache layer holds per cached token and batch row (0 before its first update): for a latent
    attention layer, its latent and shared key slice (the values are empty)."""
    if not layer.is_initialized:
        return 0
    return sum(t.shape[1] * t.shape[-1] * t.element_size() for t in (layer.keys, layer.values))


def _is_transformers_linear_layer(layer: object) -> bool:
    """A linear-attention cache layer of transformers' (not a hybrid one that also holds keys, nor ours)."""
    return (isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)
            and not isinstance(layer, LinearStateLayer))


def adopt_linear_layers(cache: Cache | None) -> None:
    """Takes each empty linear-attention layer transformers built in `cache` (its `LinearAttentionLayer`, for the
    "linear_attention" entries of `config.layer_types`) as a `LinearStateLayer`, in place; a cache is looked at once.
    A layer of transformers' that already holds a state is refused: its conv state has another layout. The empty
    static sliding-window layers are taken as ones a crop restores (static_window_rollback.py), recording their past
    where the cache does."""
    if cache is None or getattr(cache, "_linear_layers_adopted", False) or not hasattr(cache, "layers"):
        return
    records = any(getattr(layer, "record_past", False) for layer in cache.layers)
    adopt_static_window_layers(cache, records)
    for index, layer in enumerate(cache.layers):
        if not _is_transformers_linear_layer(layer):
            continue
        if any(layer.is_conv_states_initialized.values()) or any(layer.is_recurrent_states_initialized.values()):
            raise ValueError(
                f"Layer {index}'s cache ({type(layer).__name__}) already holds a state written by another model; "
                "pass a fresh cache built from this model's config: DynamicCache(config=model.config).")
        cache.layers[index] = LinearStateLayer()
        cache.layers[index].record_past = layer.record_past  # (activate_past_recording may come first)
    cache._linear_layers_adopted = True


def past_length(cache: Cache | None) -> int:
    """Tokens already in the cache. Attention layers count them; a model with only GDN/KDA layers counts them in its
    linear layers (transformers' Cache.get_seq_length refuses caches without attention layers)."""
    if cache is None:
        return 0
    if any(not isinstance(layer, LinearStateLayer) for layer in cache.layers):
        return cache.get_seq_length()
    return cache.layers[0].get_seq_length() if len(cache.layers) else 0


class LinearOnlyDynamicCache(DynamicCache):
    """`generate`'s dynamic cache for a model of GDN/KDA layers alone, whose length its linear layers give:
    transformers' `Cache.get_seq_length` reads attention layers and refuses a cache without one, which assisted
    generation asks of its assistant model's cache (to crop it after each round)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx == 0 and len(self.layers) and all(self.is_linear):
            first = self.layers[0]  # (transformers' own layer until the model's first forward: nothing yet)
            return first.get_seq_length() if isinstance(first, LinearStateLayer) else 0
        return super().get_seq_length(layer_idx)


def generation_cache(cache: Cache | None) -> Cache | None:
    """The cache `generate` built, as a `LinearOnlyDynamicCache` where it is a plain dynamic cache of linear layers
    alone (its offloading and past recording kept); any other cache as it is."""
    if type(cache) is not DynamicCache or not len(cache.layers) or not all(cache.is_linear):
        return cache
    linear_only = LinearOnlyDynamicCache(offloading=cache.offloading,
                                         offload_only_non_sliding=getattr(cache, "only_non_sliding", True))
    linear_only.layers, linear_only.layer_class_to_replicate = cache.layers, cache.layer_class_to_replicate
    return linear_only


def linear_layer_cache(cache: Cache | None, layer_idx: int) -> LinearStateLayer | None:
    """The cache layer of a GDN/KDA layer, with a clear error when the cache was not built for this model."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    if not isinstance(layer, LinearStateLayer):
        raise ValueError(
            f"Layer {layer_idx} is a GDN/KDA layer but the cache holds {type(layer).__name__} there. Build the cache "
            "from the model's config: DynamicCache(config=model.config) or StaticCache(config=model.config, ...)."
        )
    return layer

"""The cache storage captured CUDA graphs read and write, one per cache shape, shared by every graph of that shape.

A captured graph reads and writes fixed addresses. `generate(..., cache_implementation="static")` builds a new cache
per call, so before a replay the cache is bound to the storage the graph was captured with: its values are copied in
and its tensors pointed at that storage (`bind_to_storage`). Tensors bound to it before (an earlier cache, a user's
reference) that are still alive get storage of their own first, so no cache ever shares memory with another.

The storage of one cache shape (batch, key slots, device: `StorageKey`) is shared by all the graphs of that shape,
the decoding step's and every prompt bucket's (`CacheStorages`): a prompt replayed from its graph leaves the cache
where the decoding graph reads it (no copy between the two), and the memory is one cache per shape however many
prompt buckets are captured. The registry holds its storages weakly: a storage lives while a graph holds it.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import StaticCache

from .cache_hybrid_linear import LinearStateLayer

StorageKey = tuple  # (batch, key slots or None, device)


def cache_tensors(cache: StaticCache) -> list[torch.Tensor]:
    """Every tensor of `cache` a captured graph reads or writes, in layer order."""
    tensors = []
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            tensors += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            tensors += [layer.keys, layer.values, layer.cumulative_length]
    return tensors


def allocated(layer) -> bool:
    """Whether a cache layer holds its tensors (transformers' static layers and ours allocate on the first update)."""
    if isinstance(layer, LinearStateLayer):
        return layer.is_conv_states_initialized[0] and layer.is_recurrent_states_initialized[0]
    return layer.is_initialized


def initialize_like(cache: StaticCache, buffers: list[torch.Tensor]) -> None:
    """Gives the layers of a new cache that have not allocated their tensors yet tensors shaped as `buffers`
    (`cache_tensors` order), so they can be bound. A cache of another layer layout is left as it is (the binding
    then fails)."""
    if len(buffers) != sum(2 if isinstance(layer, LinearStateLayer) else 3 for layer in cache.layers):
        return
    tensors = iter(buffers)
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            conv, recurrent = next(tensors), next(tensors)
            if not allocated(layer):
                layer.lazy_initialization(conv_states=conv[..., 1:], recurrent_states=recurrent)
        else:
            keys, values, _ = next(tensors), next(tensors), next(tensors)
            if not allocated(layer):
                layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])


def bind_to_storage(tensors: list[torch.Tensor], buffers: list[torch.Tensor],
                    bound: list[weakref.ref]) -> list[weakref.ref] | None:
    """Points a cache's `tensors` (`cache_tensors`) at `buffers`: each tensor elsewhere has its values copied in and
    is set to that storage, and the tensors `bound` to it before that are still alive and not among `tensors` keep
    their values in storage of their own. Returns the new bound references; None when the tensors do not fit the
    buffers (another layout)."""
    if len(tensors) != len(buffers) or any(
            t.shape != b.shape or t.stride() != b.stride() or t.dtype != b.dtype or t.device != b.device
            for t, b in zip(tensors, buffers)):
        return None
    current = {id(t) for t in tensors}
    try:
        for ref, buffer in zip(bound, buffers):
            earlier = ref()
            if earlier is not None and id(earlier) not in current and earlier.data_ptr() == buffer.data_ptr():
                earlier.set_(earlier.clone())
        for tensor, buffer in zip(tensors, buffers):
            if tensor.data_ptr() != buffer.data_ptr():
                buffer.copy_(tensor)
                tensor.set_(buffer)
    except RuntimeError:  # (e.g. inference tensors outside inference mode) a capture binds it instead
        return None
    return [weakref.ref(t) for t in tensors]


class CacheStorage:
    """The tensors of one cache, kept as the storage graphs read and write, and the cache tensors bound to it."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.buffers = [t.detach() for t in tensors]  # (views: the storage stays while a graph holds this)
        self.bound = [weakref.ref(t) for t in tensors]

    def bind(self, cache: StaticCache) -> bool:
        """Points `cache` at this storage (its layers allocated like it first); False when it does not fit."""
        initialize_like(cache, self.buffers)
        tensors = cache_tensors(cache)
        if len(tensors) == len(self.bound) and all(ref() is t for ref, t in zip(self.bound, tensors)):
            return True  # bound already
        bound = bind_to_storage(tensors, self.buffers, self.bound)
        if bound is None:
            return False
        self.bound = bound
        return True


class CacheStorages:
    """One `CacheStorage` per `StorageKey`, shared by a model's decoding and prompt graphs (held weakly)."""

    def __init__(self):
        self._storages: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __reduce__(self):
        return CacheStorages, ()

    def bind(self, cache: StaticCache, key: StorageKey) -> CacheStorage | None:
        """The storage of `key` with `cache` bound to it, or None (none kept, or the cache does not fit it)."""
        storage = self._storages.get(key)
        return storage if storage is not None and storage.bind(cache) else None

    def adopt(self, cache: StaticCache, key: StorageKey) -> CacheStorage:
        """The allocated tensors of `cache` as the storage of `key` (replacing one it did not fit)."""
        storage = CacheStorage(cache_tensors(cache))
        self._storages[key] = storage
        return storage

    def storage_for(self, cache: StaticCache, key: StorageKey) -> CacheStorage:
        """`cache` bound to the storage of `key`, its own tensors becoming it where none fits (allocated first)."""
        return self.bind(cache, key) or self.adopt(cache, key)

"""The checks a forward (and `generate`) runs on the cache it is given, before any work: one clear line instead of an
AttributeError, an index error inside transformers' cache update (on a GPU, a device-side assertion that leaves the
process's CUDA context unusable) or an allocation of tens of gigabytes.

- The cache is a transformers `Cache`: the legacy tuple of (key, value) pairs holds no GDN/KDA state.
- A cache that holds rows holds as many as the inputs have (its buffers and states are per row).
- A static cache's key slots, allocated at its first forward as [batch, kv heads, max_cache_len, head dim] per
  attention layer, are refused up front when they pass the model's positions (`position_limit`: max_position_embeddings,
  extended by the rope scaling; no limit without a rotary full-attention layer) or the memory
  available on the layer's device: `generate(cache_implementation="static", max_new_tokens=10**9)` would otherwise
  try to allocate them. Each full-attention mixer says what it caches per token (`cache_values_per_token`); a sliding
  layer holds at most its window.
- A forward into a static cache fits its slots: the tokens it holds plus the new ones, at most max_cache_len. The
  tokens it holds are read from a host-side counter (the GDN/KDA layers' or the sliding layers'); a cache of
  full-attention layers alone keeps its count on the device, read where that costs no synchronisation (not on CUDA,
  not under torch.compile: there the captured decoding step's own check applies, cuda_graph_decoding).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer

from .cache_hybrid_linear import LinearStateLayer
from .position_limit import model_position_limit

_GIB = 2**30


def check_cache(model: nn.Module, cache: Any, batch: int, seq_len: int) -> None:
    """Refuses a cache this forward cannot use (see the module docstring). model: the HybridLinearModel."""
    if cache is None:
        return
    if not isinstance(cache, Cache):
        raise TypeError(
            f"past_key_values (cache) must be a transformers Cache, got {type(cache).__name__} (the legacy tuple format holds "
            "no GDN/KDA state); pass DynamicCache(config=model.config), StaticCache(config=model.config, "
            "max_cache_len=...) or None."
        )
    for layer in cache.layers:
        rows = _rows_of(layer)
        if rows is not None and rows != batch:
            raise ValueError(
                f"the cache holds {rows} rows but the inputs have {batch}; continue it with inputs of {rows} rows, or "
                "start a new cache for this batch (cache.reset() keeps a static cache's buffers, sized for its rows)."
            )
    check_static_cache_size(model, cache, batch)
    _check_room(cache, seq_len)


def check_static_cache_size(model: nn.Module, cache: Cache, batch: int) -> None:
    """Refuses a static cache whose full-attention key slots pass the model's positions, or whose buffers not yet
    allocated would not fit in the memory available on their devices, naming what was asked and what fits."""
    full = [layer for layer in cache.layers if _is_full(layer)]
    if not full:
        return
    slots = max(layer.max_cache_len for layer in full)
    reach = model_position_limit(model)  # (None: no full-attention layer takes positions)
    if reach is not None and slots > reach[0]:
        positions, made_up = reach
        raise ValueError(
            f"the static cache has {slots} key slots per row (max_cache_len; generate sizes it as the prompt plus "
            f"max_new_tokens, less the last token, never fed back), more than the model's {positions} positions "
            f"({made_up}): ask for at most {positions + 1} tokens in all (prompt plus max_new_tokens), extend the "
            "positions (rope_parameters with rope_type 'yarn' and a factor), or use the dynamic cache."
        )
    needed: dict[torch.device, int] = defaultdict(int)
    per_slot: dict[torch.device, int] = defaultdict(int)
    for layer, mixer in zip(cache.layers, _kv_mixers(model)):
        if mixer is None or not isinstance(layer, StaticLayer) or layer.is_initialized:
            continue
        parameter = next(mixer.parameters(), None)
        if parameter is None:
            continue
        slot_bytes = batch * mixer.cache_values_per_token() * parameter.element_size()
        needed[parameter.device] += slot_bytes * layer.max_cache_len
        if _is_full(layer):
            per_slot[parameter.device] += slot_bytes
    for device, wanted in needed.items():
        available = available_memory(device)
        if available is not None and wanted > available:
            fits = max((available - (wanted - per_slot[device] * slots)) // max(per_slot[device], 1), 0)
            raise ValueError(
                f"the static cache's key/value buffers ({batch} rows x {slots} slots) need {_size(wanted)} on "
                f"{device}, more than the {_size(available)} available there: at most {fits} slots per row "
                "fit; ask for fewer tokens (prompt plus max_new_tokens) or a smaller batch, or use the dynamic cache."
            )


def _size(count: int) -> str:
    return f"{count / _GIB:.2f} GiB" if count >= _GIB else f"{count / 2**20:.2f} MiB"


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (None where unknown): on CUDA the driver's free memory plus what
    torch's allocator holds unused; on the CPU the kernel's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _kv_mixers(model: nn.Module) -> list[nn.Module | None]:
    """The mixer of each decoder layer that caches keys and values (None for the others)."""
    return [getattr(layer, layer.mixer_attribute) if layer.mixer_state == "kv" else None for layer in model.layers]


def _is_full(layer: Any) -> bool:
    return isinstance(layer, StaticLayer) and not isinstance(layer, StaticSlidingWindowLayer)


def _rows_of(layer: Any) -> int | None:
    """The batch rows a cache layer holds (None before its first update)."""
    if isinstance(layer, LinearStateLayer):
        initialized = layer.is_recurrent_states_initialized[0]
        return layer.recurrent_states[0].shape[0] if initialized else None
    keys = getattr(layer, "keys", None)
    if getattr(layer, "is_initialized", False) and isinstance(keys, torch.Tensor) and keys.dim() > 0:
        return keys.shape[0]
    return None


def _host_token_count(cache: Cache) -> int | None:
    """The tokens the cache holds, read without a device synchronisation (None where only the device knows)."""
    if torch.compiler.is_compiling():  # (a host read of a count would be a guard on it)
        return None
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            return layer.seen_tokens
        if isinstance(layer, StaticSlidingWindowLayer):
            return layer.cumulative_length_int
    for layer in cache.layers:
        if _is_full(layer):
            count = layer.cumulative_length
            if not isinstance(count, torch.Tensor):
                return int(count)
            if count.device.type != "cuda" and not torch.compiler.is_compiling():
                return int(count)
    return None


def _check_room(cache: Cache, seq_len: int) -> None:
    full = [layer for layer in cache.layers if _is_full(layer)]
    if not full:
        return
    held = _host_token_count(cache)
    slots = min(layer.max_cache_len for layer in full)
    if held is not None and held + seq_len > slots:
        raise ValueError(
            f"the static cache holds {slots} tokens per row, {held} of them written, and this forward adds "
            f"{seq_len}: {held + seq_len - slots} have no slot. {static_cache_room_fix(held + seq_len)}"
        )


def static_cache_room_fix(tokens: int) -> str:
    """The fix named where a static cache has no slot left: a static cache does not grow, and it is the one
    `generate` returns on a GPU unless asked for another (`_chooses_static_cache`)."""
    return (f"A static cache does not grow: pass one with a larger max_cache_len (at least {tokens} tokens), pass "
            "no cache and let generate size a new one, or generate with cache_implementation=\"dynamic\" for a "
            "cache that grows (generate's default on a GPU is static).")


__all__ = ["available_memory", "check_cache", "check_static_cache_size", "static_cache_room_fix"]

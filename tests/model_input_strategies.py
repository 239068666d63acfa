"""Hypothesis strategies for hostile model inputs, for the model-input fuzzer (test_fuzz_model_inputs.py).

- `hostile_tensor(shape, low, high, dtype)`: a model input meant to be a tensor of that shape, dtype and value range:
  mostly that, else another dtype (every torch dtype a tensor can hold), another shape (0-4 dims, sizes 0-8), values
  out of range (negative, past `high`, huge, NaN/inf), or not a tensor at all (a list, a number, a string);
- `model_inputs(vocab, hidden)`: the keyword arguments of a model call drawn from it (ids or embeddings, mask,
  positions, labels, packed-sequence boundaries), with a cache kind to pass (`CACHE_KINDS`).

Settings: fuzz_strategies.FUZZ_SETTINGS (fixed seed, no example database).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st

TENSOR_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                 torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
_HOSTILE_NUMBERS = [-1, -100, 2**31, 2**40, -(2**40), math.nan, math.inf, -math.inf, 0.5]
# the caches a fuzzed call passes: none, empty or holding tokens (of the call's rows, or of others), too small, or
# not a transformers Cache at all
CACHE_KINDS = ["none", "none", "dynamic", "dynamic holding tokens", "dynamic of other rows", "static",
               "static too small", "static holding tokens", "legacy tuple", "list"]


@st.composite
def hostile_tensor(draw: st.DrawFn, shape: tuple[int, ...], low: float, high: float,
                   dtype: torch.dtype) -> tuple[str, Any]:
    """(how it was drawn: "valid", "dtype", "shape", "values" or "not a tensor", the value): a tensor of `shape` and
    `dtype` with values in [low, high), or one of those changed."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "dtype", "shape", "values", "not a tensor"]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 8), max_size=4)))
    if dtype.is_floating_point:
        values = low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64)
    else:
        values = torch.randint(int(low), int(high), shape, generator=generator)
    if kind == "values" and values.numel():
        values = values.to(torch.float64 if dtype.is_floating_point else torch.int64)
        bad = draw(st.sampled_from(_HOSTILE_NUMBERS if dtype.is_floating_point else
                                   [n for n in _HOSTILE_NUMBERS if isinstance(n, int)] + [int(high)]))
        values.view(-1)[draw(st.integers(0, values.numel() - 1))] = bad
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in TENSOR_DTYPES if d != dtype]))
    tensor = values.to(dtype)
    if kind == "not a tensor":
        return kind, draw(st.sampled_from([tensor.tolist(), 3, "input", None if tensor.dim() else 1.5]))
    return kind, tensor


@st.composite
def model_inputs(draw: st.DrawFn, vocab: int, hidden: int, max_batch: int = 3,
                 max_length: int = 6) -> tuple[dict[str, Any], str, bool]:
    """(keyword arguments of a model call, the cache kind to pass with it (CACHE_KINDS), whether every part was drawn
    valid and they agree, so that the call must run)."""
    batch, length = draw(st.integers(1, max_batch)), draw(st.integers(1, max_length))
    kinds, inputs = [], {}

    def add(name: str, strategy) -> None:
        kind, value = draw(strategy)
        kinds.append(kind)
        inputs[name] = value

    if draw(st.integers(0, 3)):
        add("input_ids", hostile_tensor((batch, length), 0, vocab, torch.int64))
    else:
        add("inputs_embeds", hostile_tensor((batch, length, hidden), -1.0, 1.0, torch.float32))
    mask = draw(st.sampled_from(["none", "ones", "left padding", "right padding", "hostile"]))
    if mask == "hostile":
        add("attention_mask", hostile_tensor((batch, length), 0, 2, torch.int64))
    elif mask != "none":
        pads = torch.tensor(draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch)))
        columns = torch.arange(length)
        real = columns >= pads[:, None] if mask == "left padding" else columns < (length - pads)[:, None]
        inputs["attention_mask"] = real.to(draw(st.sampled_from([torch.int64, torch.bool, torch.float32, torch.int8])))
    if draw(st.booleans()):
        add("position_ids", hostile_tensor((draw(st.sampled_from([1, batch])), length), 0, 64, torch.int64))
    if draw(st.booleans()):
        add("labels", hostile_tensor((batch, length), 0, vocab, torch.int64))
    packed = draw(st.integers(0, 4)) == 0
    if packed:
        starts = sorted(set(draw(st.lists(st.integers(1, max(length - 1, 1)), max_size=3))) - {length})
        boundaries = torch.tensor([0, *starts, length])
        kind, value = draw(st.sampled_from([("valid", boundaries), ("valid", boundaries.int())]) | hostile_tensor(
            tuple(boundaries.shape), 0, length + 1, torch.int32))
        kinds.append(kind)
        inputs["cu_seq_lens_q"] = value
    cache = draw(st.sampled_from(CACHE_KINDS))
    must_run = (all(kind == "valid" for kind in kinds) and not packed and "attention_mask" not in inputs
                and cache in ("none", "dynamic", "static"))
    return inputs, cache, must_run


__all__ = ["CACHE_KINDS", "TENSOR_DTYPES", "hostile_tensor", "model_inputs"]

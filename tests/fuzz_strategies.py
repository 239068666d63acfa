"""Hypothesis strategies for hostile checkpoint files, shared by the fuzzers (readers here, configs elsewhere).

- `hostile_values()`: JSON/YAML values of every kind a file can hold where a number, a name or a flag is expected
  (bools, strings such as "false" or "1e-5", huge and negative integers, non-finite floats, nested junk);
- `mutated(document)`: a nested document (a fixture's metadata, a config.json, a safetensors header, an index) with
  1-3 mutations: a key dropped, a value replaced by a hostile one, a junk key added;
- `safetensors_file(header, data)`: the bytes of a safetensors file from a (mutated) header, with the 8-byte length
  field sometimes lying;
- `per_tensor_dtypes(count)`: a floating dtype for each of `count` stored tensors (experts included), mostly mixed;
- `FUZZ_SETTINGS`: fixed seed (`derandomize=True`) and no example database, so that CI runs the same examples every
  time; a deadline per example that only ends a runaway one (a loaded 2-core machine stretches a 0.1 s example
  many times over, and a tight deadline would fail it).
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_SETTINGS = settings(max_examples=100, derandomize=True, database=None, deadline=timedelta(seconds=60),
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_WORDS = st.sampled_from(["false", "true", "null", "1e-5", "1.0e-05", "", "0", "-1", "nan", "inf", "weights",
                          "../x.safetensors", "/etc/passwd", "model_0.safetensors", "F32", "I64", "BOOL",
                          "attention", "gdn", "kda", "pattern", "fixed", "silu", "x" * 300])
_HUGE_INTEGERS = st.sampled_from([2**31, 2**63, 2**64 + 1, 10**12, 10**18, -(10**12), 10**400])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), _HUGE_INTEGERS, st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), _WORDS, st.text(max_size=20),
)


def hostile_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Any JSON/YAML value: scalars, and lists/mappings of them, a few levels deep."""
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=max_leaves)


def paths(document: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path into a nested document (dict keys and list indices)."""
    items = document.items() if isinstance(document, dict) else enumerate(document) if isinstance(
        document, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def _apply(document: Any, path: tuple, operation: str, value: Any) -> None:
    node = document
    for key in path[:-1]:
        node = node[key]
    key = path[-1]
    if operation == "drop":
        del node[key]
    elif operation == "replace":
        node[key] = value
    elif isinstance(node, dict):  # "add": a junk key beside it
        node[f"junk_{len(node)}"] = value
    else:
        node.append(value)


@st.composite
def mutated(draw: st.DrawFn, document: Any, max_mutations: int = 3) -> Any:
    """A deep copy of `document` with 1..max_mutations random mutations."""
    result = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, max_mutations))):
        candidates = list(paths(result))
        if not candidates:
            break
        path = draw(st.sampled_from(candidates))
        operation = draw(st.sampled_from(["drop", "replace", "replace", "add"]))
        _apply(result, path, operation, draw(hostile_values()))
    return result


@st.composite
def safetensors_file(draw: st.DrawFn, header: dict, data: bytes) -> bytes:
    """A safetensors file: `header` (JSON-encoded, maybe cut short), a length field that is right or lies, `data`
    (maybe truncated)."""
    raw = json.dumps(header, allow_nan=True).encode()
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    length = draw(st.one_of(st.just(len(raw)), st.just(len(raw)), st.just(len(raw)),
                            st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 100 * 2**20 + 1])))
    if draw(st.integers(0, 9)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return struct.pack("<Q", length) + raw + data


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def per_tensor_dtypes(count: int) -> st.SearchStrategy[list[torch.dtype]]:
    """A floating dtype for each of `count` stored tensors: all one dtype, or each its own."""
    return st.one_of(st.sampled_from(FLOAT_DTYPES).map(lambda dtype: [dtype] * count),
                     st.lists(st.sampled_from(FLOAT_DTYPES), min_size=count, max_size=count))


def split_safetensors(blob: bytes) -> tuple[dict, bytes]:
    """A valid safetensors file's (header, data area)."""
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length]), blob[8 + length:]


__all__ = [
    "FUZZ_SETTINGS",
    "hostile_values",
    "mutated",
    "paths",
    "per_tensor_dtypes",
    "safetensors_file",
    "scalars",
    "split_safetensors",
]

"""Name maps: which tensors of a format make which tensors of the canonical layout (our Hugging Face model), as
tables of (format names, converter, canonical names). A table is data; `build_*_rows(config)` only instantiates it
for the layers of a given config (each layer's entries bound to that layer's own config). Fast-LLM's tables live in
`fast_llm/parameters.py`. Every converter knows its inverse, so the same rows serve reading and writing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..configuration_hybrid_linear import HybridLinearConfig
from .converters import IDENTITY, Converter
from .hf_layout import hf_tensor_shapes


@dataclass(frozen=True)
class MapRow:
    """`converter.forward(format tensors) == canonical tensors`, `converter.inverse` the way back."""

    format_keys: tuple[str, ...]
    converter: Converter
    canonical_keys: tuple[str, ...]


@dataclass(frozen=True)
class Entry:
    """A table entry, with names relative to a prefix; `when` restricts it to some configs."""

    format_names: str | tuple[str, ...]
    converter: Converter
    canonical_names: str | tuple[str, ...]
    when: Callable[[HybridLinearConfig], bool] | None = None


def _names(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def instantiate(entries: Sequence[Entry], config: HybridLinearConfig, format_prefix: str = "",
                canonical_prefix: str = "") -> list[MapRow]:
    return [
        MapRow(tuple(format_prefix + n for n in _names(e.format_names)), e.converter.bind(config),
               tuple(canonical_prefix + n for n in _names(e.canonical_names)))
        for e in entries if e.when is None or e.when(config)
    ]


# ------------------------------------------------------------------------------------------ HF <-> canonical


def build_hf_rows(config: HybridLinearConfig) -> list[MapRow]:
    """Our HF format is the canonical layout: one identity row per tensor."""
    return [MapRow((name,), IDENTITY, (name,)) for name in hf_tensor_shapes(config)]


__all__ = ["MapRow", "Entry", "instantiate", "build_hf_rows"]

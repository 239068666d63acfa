"""Fast-LLM's mixers, one record each (`FastLlmMixer`), registered in one table keyed by Fast-LLM's `mixer.type`.

A record holds everything this project knows about one Fast-LLM mixer: the layer types it becomes, its config reader
(Fast-LLM's mixer config -> our per-layer fields, refusing whatever our model cannot express, naming the field) and
writer (a layer's resolved config -> Fast-LLM's mixer config), what of our settings Fast-LLM cannot express, its
parameter table (Fast-LLM names, converters, canonical names, stage flags), how its fields choose their defaults,
and which of its settings the `distributed` layout has not been verified for. The config mapping (`config.py`), the
parameter tables (`parameters.py`) and the `distributed` reader read this table; adding a Fast-LLM mixer is one
module `mixer_<name>.py` ending in `register(FastLlmMixer(...))` and its import at the bottom of this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from .metadata_fields import MetadataFields
from .parameter_spec import Parameter


def _nothing(layer: HybridLinearConfig) -> list[str]:
    return []


def _verified(layer: HybridLinearConfig) -> str | None:
    return None


@dataclass(frozen=True)
class FastLlmMixer:
    """One Fast-LLM mixer type and the layer types of ours it stands for."""

    type_name: str  # Fast-LLM's `mixer.type`
    description: str  # in messages ("Gated DeltaNet")
    block_names: Mapping[str, str]  # our layer type -> the name of the Fast-LLM block the writer gives it
    # Fast-LLM's mixer config -> (our layer type, our per-layer fields); reads every key it accepts and `finish`es
    read: Callable[[MetadataFields], tuple[str, dict[str, Any]]]
    write: Callable[[HybridLinearConfig, str], dict[str, Any]]  # (a layer's resolved config, its type) -> mixer config
    parameters: tuple[Parameter, ...]  # under `decoder.{i}.`, in Fast-LLM's definition order
    # each of our fields its reader sets -> the Fast-LLM key it comes from, under the block (for messages)
    field_sources: Mapping[str, str] = field(default_factory=dict)
    # a layer's settings that Fast-LLM's mixer cannot express, one phrase each (the writer refuses them)
    unsupported: Callable[[HybridLinearConfig], list[str]] = _nothing
    # Fields whose default (the flat config value) is chosen alone; the mixer's other fields take theirs together,
    # from one and the same layer, so that the defaults are themselves a valid setting (heads and KV heads, ...).
    checked_alone: tuple[str, ...] = ()
    # why the `distributed` layout of a layer's settings is not verified (the reader refuses it), naming the
    # Fast-LLM key under the block ("mixer.heads is 1, and ..."), or None
    distributed_unverified: Callable[[HybridLinearConfig], str | None] = _verified
    # model-wide fields a model read from Fast-LLM gets unless its layers set them: the values when no layer has
    # this mixer, and settings our mixer has but Fast-LLM's lacks (always off)
    config_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.block_names)

    def field_group(self, field: str) -> str:
        """The group of one of its fields whose defaults are chosen together."""
        return field if field in self.checked_alone else self.type_name


FAST_LLM_MIXERS: dict[str, FastLlmMixer] = {}  # Fast-LLM's mixer type -> its record
_BY_LAYER_TYPE: dict[str, FastLlmMixer] = {}


def register(mixer: FastLlmMixer) -> FastLlmMixer:
    if mixer.type_name in FAST_LLM_MIXERS:
        raise ValueError(f"Fast-LLM mixer type {mixer.type_name!r} is registered twice")
    taken = [t for t in mixer.layer_types if t in _BY_LAYER_TYPE]
    if taken:
        raise ValueError(f"Fast-LLM mixer {mixer.type_name!r}: layer type(s) {taken} already have a Fast-LLM mixer")
    FAST_LLM_MIXERS[mixer.type_name] = mixer
    _BY_LAYER_TYPE.update(dict.fromkeys(mixer.layer_types, mixer))
    return mixer


def mixer_of_layer_type(layer_type: str) -> FastLlmMixer | None:
    """The Fast-LLM mixer our layer type is written as (None: Fast-LLM has none)."""
    record = _BY_LAYER_TYPE.get(layer_type)
    # a record replaced in the table (tests do) is the one that counts
    return FAST_LLM_MIXERS.get(record.type_name, record) if record is not None else None


__all__ = ["FastLlmMixer", "FAST_LLM_MIXERS", "register", "mixer_of_layer_type"]

# The registrations: one import per Fast-LLM mixer module.
from . import mixer_attention, mixer_gdn, mixer_kda  # noqa: E402, F401

"""The registry of token mixers: one record per mixer, declared by the mixer's own module.

A mixer module declares everything about itself in one `MixerSpec` and calls `register`; the configuration (its
dataclass fields with their defaults and docs, which fields a layer of that mixer reads, how each is checked, the
relations between them, the weight-count bound), the modeling code (which module, how it is called, how its weights
start), the tensor-parallel plan, LoRA and the model card all read the registry. What mixers and MLPs share
(`ConfigField`, `ComponentSpec`) is in `component_registry`; the MLPs' registry is `mlp_registry`. The one line that
registers a new mixer module is its import in `registered_components` (a relative import, so a saved model folder
ships the module with its remote code); this registry imports none of its mixers, which import it.

Two names per layer, each in its own config field: `mixer_types[i]`, this family's own (which mixer runs: the key of
this registry), and `layer_types[i]`, transformers' word for what the layer is (`full_attention`,
`sliding_attention`, `linear_attention`: `configuration_utils.ALLOWED_ATTN_LAYER_TYPES`). transformers' own machinery
reads the latter: `DynamicCache(config=...)` and `StaticCache(config=...)` build each layer's cache from it (a KV layer
for attention, `LinearAttentionLayer` for a recurrent state), the mask builders and the generic config that
`AutoTokenizer` loads check it. A mixer declares its transformers layer type, which must be one that transformers'
cache tables know with a cache layer of the mixer's kind; the tables are read, never written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .component_registry import (
    FIELD_KINDS,
    ComponentSpec,
    ConfigField,
    Registry,
    add_spec,
    lora_targets_of,
    plan_of,
    remove_spec,
)


@dataclass(frozen=True, kw_only=True)
class MixerSpec(ComponentSpec):
    """Everything the rest of the package needs to know about one mixer."""

    mixer_type: str  # the `mixer_types` entry (this registry's key)
    # transformers' layer type of its layers (the `layer_types` entry): "full_attention", "sliding_attention" or
    # "linear_attention"; transformers builds the layer's cache from it
    layer_type: str
    attribute: str  # the decoder layer's attribute holding it ("self_attn", "linear_attn": the checkpoint names)
    state: str  # "kv": softmax attention, called (x, position_embeddings, mask, cache=...) with a KV cache layer;
    #             "recurrent": called (x, sequence_info, cache_layer) with a linear-attention cache layer
    # the settings its rotary embedding is built from (head_dim * rope_parameters["partial_rotary_factor"] dims
    # rotated), from the layer's settings; None: the layer takes no position embeddings. Read for "kv" mixers only.
    rotary_settings: Callable[[Any], Any] = lambda settings: settings


MIXERS: Registry = Registry("mixer_types")


def _layer_type_problem(spec: MixerSpec) -> str | None:
    """Why `spec.layer_type` does not fit its state (None when it does): transformers must build, for that layer type,
    a KV cache layer for a "kv" mixer and a linear-attention one for a "recurrent" mixer."""
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        STATIC_LAYER_TYPE_MAPPING,
        CacheLayerMixin,
        LinearAttentionCacheLayerMixin,
    )

    def holds_state(layer: type | None) -> bool:
        linear, kv = (layer is not None and issubclass(layer, base)
                      for base in (LinearAttentionCacheLayerMixin, CacheLayerMixin))
        return (linear and not kv) if spec.state == "recurrent" else (kv and not linear)

    fits = [name for name in DYNAMIC_LAYER_TYPE_MAPPING
            if holds_state(DYNAMIC_LAYER_TYPE_MAPPING[name]) and holds_state(STATIC_LAYER_TYPE_MAPPING.get(name))]
    if spec.layer_type not in fits:
        return (f"layer_type must be a transformers layer type whose cache holds a {spec.state} state, one of "
                f"{tuple(fits)}, got {spec.layer_type!r}")
    return None


def register(spec: MixerSpec) -> MixerSpec:
    """Adds the mixer `spec.mixer_type` (its fields join the config)."""
    if spec.state not in ("kv", "recurrent"):
        raise ValueError(f"MixerSpec of {spec.mixer_type!r}: state must be 'kv' or 'recurrent', got {spec.state!r}.")
    if problem := _layer_type_problem(spec):
        raise ValueError(f"MixerSpec of {spec.mixer_type!r}: {problem}.")
    add_spec(MIXERS, spec.mixer_type, spec)
    return spec


def unregister(mixer_type: str) -> MixerSpec:
    """Undoes `register` (its fields leave the config): for tests and plugins."""
    return remove_spec(MIXERS, mixer_type)


def default_mixer(layer_type: str) -> str | None:
    """The mixer a layer of transformers' `layer_type` runs when the config names none: the first registered for it
    (full_attention: softmax attention; linear_attention: Gated DeltaNet, as in Qwen3-Next); None if no mixer is."""
    return next((name for name, spec in MIXERS.items() if spec.layer_type == layer_type), None)


def mixer_types(state: str | None = None) -> tuple[str, ...]:
    """The registered mixers (those that keep `state`, if given), in registration order."""
    return tuple(t for t, spec in MIXERS.items() if state is None or spec.state == state)


def tensor_parallel_plan() -> dict[str, str]:
    """Every mixer's plan entries under the decoder layers ("layers.*.self_attn.q_proj": "colwise", ...)."""
    return plan_of(MIXERS, lambda spec: spec.attribute)


def lora_targets() -> tuple[str, ...]:
    """The projection names LoRA adapts in every mixer."""
    return lora_targets_of(MIXERS)


__all__ = ["FIELD_KINDS", "MIXERS", "ConfigField", "MixerSpec", "default_mixer", "lora_targets", "mixer_types",
           "register", "tensor_parallel_plan", "unregister"]

"""The registry of token mixers: one record per layer type, declared by the mixer's own module.

Adding a mixer used to touch a dozen tables (the config's layer-type tuples, fields and validation tables, the
modeling file's dispatch and weight init, the cache's layer-type tables, the tensor-parallel plan, the LoRA targets).
Now a mixer module declares everything about itself in one `MixerSpec` and calls `register`; the configuration (its
dataclass fields with their defaults and docs, which fields a layer type reads, how each is checked, the relations
between them, the weight-count bound), the modeling code (which module, how it is called, how its weights start),
transformers' cache tables (which cache layer holds its state), the tensor-parallel plan, LoRA and the model card all
read the registry. What mixers and MLPs share (`ConfigField`, `ComponentSpec`) is in `component_registry`; the MLPs'
registry is `mlp_registry`. The one line that registers a new mixer module is the import at the bottom of this file:
a relative import, so a saved model folder ships the module with its remote code.
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
    """Everything the rest of the package needs to know about the mixer of one layer type."""

    layer_type: str  # the `layer_types` entry
    attribute: str  # the decoder layer's attribute holding it ("self_attn", "linear_attn": the checkpoint names)
    state: str  # "kv": softmax attention, called (x, position_embeddings, mask, cache=...) with a KV cache layer;
    #             "recurrent": called (x, sequence_info, cache_layer) with `cache_layer` below
    # the transformers cache layer of its state: required for "recurrent"; for "kv", None means transformers' own
    # table already knows the layer type (full and sliding attention), else the dynamic cache's layer class, with
    # `static_cache_layer` the static cache's (a KV layer's two differ; unset: the same class)
    cache_layer: type | None = None
    static_cache_layer: type | None = None
    # the settings its rotary embedding is built from (head_dim * rope_parameters["partial_rotary_factor"] dims
    # rotated), from the layer's settings; None: the layer takes no position embeddings. Read for "kv" mixers only.
    rotary_settings: Callable[[Any], Any] = lambda settings: settings


MIXERS: Registry = Registry("layer_types")


def register(spec: MixerSpec) -> MixerSpec:
    """Adds the mixer of `spec.layer_type` (its fields join the config); a recurrent mixer's cache layer joins
    transformers' layer-type tables, so DynamicCache(config=...) and StaticCache(config=...) hold it for that layer
    type."""
    recurrent = spec.state == "recurrent"
    if spec.state not in ("kv", "recurrent") or (recurrent and spec.cache_layer is None):
        raise ValueError(f"MixerSpec of {spec.layer_type!r}: state must be 'kv' or 'recurrent', a recurrent one with "
                         "a cache_layer.")
    if spec.static_cache_layer is not None and (recurrent or spec.cache_layer is None):
        raise ValueError(f"MixerSpec of {spec.layer_type!r}: static_cache_layer is for a 'kv' mixer that also gives "
                         "cache_layer (its dynamic cache layer).")
    add_spec(MIXERS, spec.layer_type, spec)
    if spec.cache_layer is not None:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING

        DYNAMIC_LAYER_TYPE_MAPPING.setdefault(spec.layer_type, spec.cache_layer)
        STATIC_LAYER_TYPE_MAPPING.setdefault(spec.layer_type, spec.static_cache_layer or spec.cache_layer)
    _allow_in_generic_configs(spec.layer_type)
    return spec


def unregister(layer_type: str) -> MixerSpec:
    """Undoes `register` (its fields leave the config, its cache layer transformers' tables): for tests and plugins."""
    spec = remove_spec(MIXERS, layer_type)
    if spec.cache_layer is not None:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING

        for mapping, layer in ((DYNAMIC_LAYER_TYPE_MAPPING, spec.cache_layer),
                               (STATIC_LAYER_TYPE_MAPPING, spec.static_cache_layer or spec.cache_layer)):
            if mapping.get(layer_type) is layer:
                del mapping[layer_type]
    if layer_type in _ADDED_TO_GENERIC_CONFIGS:
        from transformers import configuration_utils

        _ADDED_TO_GENERIC_CONFIGS.discard(layer_type)
        for table in ("ALLOWED_ATTN_LAYER_TYPES", "ALLOWED_LAYER_TYPES"):
            kept = tuple(t for t in getattr(configuration_utils, table) if t != layer_type)
            setattr(configuration_utils, table, kept)
    return spec


_ADDED_TO_GENERIC_CONFIGS: set[str] = set()  # the layer types that _allow_in_generic_configs added (not theirs)


def _allow_in_generic_configs(layer_type: str) -> None:
    """Adds `layer_type` to the layer types transformers' generic `PreTrainedConfig` accepts. Its check, written for
    transformers' own models, refuses other names, and transformers reads our config.json with that generic class in
    places: Trainer resuming from a checkpoint (to compare versions) and AutoTokenizer's fallback when the model's own
    config class is not at hand. Like the cache tables above, the names join transformers' table here."""
    from transformers import configuration_utils

    if layer_type not in configuration_utils.ALLOWED_ATTN_LAYER_TYPES:
        configuration_utils.ALLOWED_ATTN_LAYER_TYPES += (layer_type,)
        configuration_utils.ALLOWED_LAYER_TYPES += (layer_type,)
        _ADDED_TO_GENERIC_CONFIGS.add(layer_type)


def layer_types(state: str | None = None) -> tuple[str, ...]:
    """The registered layer types (those whose mixer keeps `state`, if given), in registration order."""
    return tuple(t for t, spec in MIXERS.items() if state is None or spec.state == state)


def tensor_parallel_plan() -> dict[str, str]:
    """Every mixer's plan entries under the decoder layers ("layers.*.self_attn.q_proj": "colwise", ...)."""
    return plan_of(MIXERS, lambda spec: spec.attribute)


def lora_targets() -> tuple[str, ...]:
    """The projection names LoRA adapts in every mixer."""
    return lora_targets_of(MIXERS)


# The registrations: one import per mixer module (each calls `register` when imported). Last, so that the modules
# find MixerSpec and register defined; `from .module import name` lines, the form transformers follows when it
# copies a saved folder's remote code (it does not follow `from . import module`).
from .mixer_attention import HybridLinearAttention  # noqa: E402,F401
from .mixer_gated_deltanet import HybridLinearGatedDeltaNet  # noqa: E402,F401
from .mixer_kimi_delta import HybridLinearKimiDeltaAttention  # noqa: E402,F401
from .mixer_mla import HybridLinearMultiHeadLatentAttention  # noqa: E402,F401

__all__ = ["FIELD_KINDS", "MIXERS", "ConfigField", "MixerSpec", "layer_types", "lora_targets", "register",
           "tensor_parallel_plan", "unregister"]

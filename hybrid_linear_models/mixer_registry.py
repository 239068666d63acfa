"""The registry of token mixers: one record per layer type, declared by the mixer's own module.

Adding a mixer used to touch a dozen tables (the config's layer-type tuples and validation tables, the modeling file's
dispatch and weight init, the cache's layer-type tables, the tensor-parallel plan, the LoRA targets). Now a mixer
module declares everything about itself in one `MixerSpec` and calls `register`; the configuration (which fields a
layer type reads, how each is checked, the relations between them, the weight-count bound), the modeling code (which
module, how it is called, how its weights start), transformers' cache tables (which cache layer holds its state) and
the tensor-parallel plan all read the registry. The one line that registers a new mixer module is the import at the
bottom of this file: a relative import, so a saved model folder ships the module with its remote code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How the configuration checks a field a mixer reads (configuration_hybrid_linear._field_problems):
# "size" a positive integer (bounded), "epsilon" a finite number > 0, "bool" True/False, "gate_activation" one of
# GATE_ACTIVATIONS, "window" None or a positive integer, "rope" a rope_parameters dict the rotary embedding runs.
FIELD_KINDS = ("size", "epsilon", "bool", "gate_activation", "window", "rope")


@dataclass(frozen=True)
class MixerSpec:
    """Everything the rest of the package needs to know about the mixer of one layer type."""

    layer_type: str  # the `layer_types` entry
    fields: dict[str, str]  # the config fields it reads (each may vary per layer) -> their kind (FIELD_KINDS)
    module_class: type  # built as module_class(config, layer_idx); reads config.per_layer_config[layer_idx]
    attribute: str  # the decoder layer's attribute holding it ("self_attn", "linear_attn": the checkpoint names)
    state: str  # "kv": softmax attention, called (x, position_embeddings, mask, cache=...) with a KV cache layer;
    #             "recurrent": called (x, sequence_info, cache_layer) with `cache_layer` below
    parameter_count: Callable[[Any], int]  # weights of the mixer for a layer's settings (bounds sizes before torch)
    relation_problems: Callable[[Any, str], list[str]] = lambda settings, prefix: []  # checks between its fields
    # the initialisation of the parameters it holds directly (A_log, dt_bias); its submodules (Linear, norms,
    # convolutions) get the model's generic initialisation
    init_weights: Callable[[Any], None] | None = None
    cache_layer: type | None = None  # the transformers cache layer of its state ("recurrent"; "kv" uses theirs)
    tensor_parallel_plan: dict[str, str] = field(default_factory=dict)  # submodule -> transformers TP style
    lora_targets: tuple[str, ...] = ()  # its projections that LoRA adapts


MIXERS: dict[str, MixerSpec] = {}


def register(spec: MixerSpec) -> MixerSpec:
    """Adds the mixer of `spec.layer_type`; a recurrent mixer's cache layer joins transformers' layer-type tables, so
    DynamicCache(config=...) and StaticCache(config=...) hold it for that layer type."""
    unknown = set(spec.fields.values()) - set(FIELD_KINDS)
    recurrent = spec.state == "recurrent"
    if unknown or spec.state not in ("kv", "recurrent") or recurrent != (spec.cache_layer is not None):
        raise ValueError(f"MixerSpec of {spec.layer_type!r}: field kinds must be among {FIELD_KINDS} (got "
                         f"{sorted(unknown)}), state 'kv' or 'recurrent', and a cache_layer exactly when recurrent.")
    MIXERS[spec.layer_type] = spec
    if spec.cache_layer is not None:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING

        DYNAMIC_LAYER_TYPE_MAPPING.setdefault(spec.layer_type, spec.cache_layer)
        STATIC_LAYER_TYPE_MAPPING.setdefault(spec.layer_type, spec.cache_layer)
    return spec


def layer_types(state: str | None = None) -> tuple[str, ...]:
    """The registered layer types (those whose mixer keeps `state`, if given), in registration order."""
    return tuple(t for t, spec in MIXERS.items() if state is None or spec.state == state)


def tensor_parallel_plan() -> dict[str, str]:
    """Every mixer's plan entries under the decoder layers ("layers.*.self_attn.q_proj": "colwise", ...)."""
    return {f"layers.*.{spec.attribute}.{name}": style
            for spec in MIXERS.values() for name, style in spec.tensor_parallel_plan.items()}


def lora_targets() -> tuple[str, ...]:
    """The projection names LoRA adapts in every mixer."""
    return tuple(dict.fromkeys(name for spec in MIXERS.values() for name in spec.lora_targets))


# The registrations: one import per mixer module (each calls `register` when imported). Last, so that the modules
# find MixerSpec and register defined; `from .module import name` lines, the form transformers follows when it
# copies a saved folder's remote code (it does not follow `from . import module`).
from .mixer_attention import HybridLinearAttention  # noqa: E402,F401
from .mixer_gated_deltanet import HybridLinearGatedDeltaNet  # noqa: E402,F401
from .mixer_kimi_delta import HybridLinearKimiDeltaAttention  # noqa: E402,F401

__all__ = ["FIELD_KINDS", "MIXERS", "MixerSpec", "layer_types", "lora_targets", "register", "tensor_parallel_plan"]

"""Configuration of the hybrid linear-attention model family.

A decoder of `num_hidden_layers` blocks, each with one token mixer picked by `mixer_types`:

- "full_attention":       softmax attention (GQA, optional per-head q/k RMSNorm, partial rotary, optional sigmoid
                          output gate as in Qwen3-Next);
- "sliding_attention":    the same within a window of `sliding_window` tokens;
- "gated_deltanet":       Gated DeltaNet (Qwen3-Next's linear attention);
- "kimi_delta_attention": Kimi Delta Attention (per-channel decay);
- "mla_attention":        multi-head latent attention (Kimi-Linear, DeepSeek-V3);

followed by an MLP picked by `mlp_types` (default: every layer "dense", the gated MLP), each sub-block pre-normed
with RMSNorm and added to the residual stream.

Beside these lists of this family's own names, config.json holds transformers' words for the same layers, which its
generic machinery reads (the cache each layer gets, the masks, the generic config a tokenizer loads with):
`layer_types` ("full_attention", "sliding_attention", "linear_attention": each mixer's registration declares its
own) and `mlp_layer_types` ("dense", "sparse"). Each follows from the other list of its pair: a config may give
either or both (they must agree). Given transformers' words alone, a layer runs the first mixer (MLP) registered for
its type: Gated DeltaNet for "linear_attention", the sparse MoE for "sparse". A config that names mixers in
`layer_types` (`["gated_deltanet", "full_attention"]`) loads as the same model and saves both lists.

The mixers and MLPs are registered components (`mixer_registry`, `mlp_registry`), and each owns its settings: its
spec declares every config field it reads once (`component_registry.ConfigField`: kind, default, one-line doc,
optionally `default_from` another field, resolved here when the value is None). This class takes those fields from
the registries rather than from lines written here. transformers makes every `PreTrainedConfig` subclass a dataclass
when the class statement runs (`PreTrainedConfig.__init_subclass__`), so the fields must exist then: the class
inherits a dataclass generated from the registered declarations (`_fields_dataclass`: fields only, no methods), whose
fields the dataclass machinery collects as it does any dataclass base's (defaults, `dataclasses.fields`, the
generated `__init__` signature and `__eq__`, transformers' `to_diff_dict`). A component registered later (a plugin, a
test) adds its fields when it registers (`_sync_registered_fields`: Field records made by the same generator, entered
in `__dataclass_fields__`, which transformers' keyword `__init__`, defaults and serialisation read at each call; only
the generated `__eq__` and signature, fixed at class creation, do not list them); removing it takes them out. The
docstring's Args for these fields is built from their docs, so `help(HybridLinearConfig)` lists every setting. Only
the fields the whole model shares (embeddings, the layer lists, norms, ...) are written in the class. This module
imports no torch itself (the registrations it reads live in the component modules).

Every switch that changes the math is a field, written explicitly into config.json (defaults are resolved here, never
left for the modeling code to guess).

Every such field is validated (`HybridLinearConfig.validate`), at construction, at load (overrides included) and before
config.json is written, with one ValueError naming each bad field, the problem and the fix: a bad value must fail
here, in words, not later as a NaN in the logits (a zero epsilon, a NaN rope_theta), a crash inside a mixer (a rope
type the rotary embedding cannot run, a string where a bool belongs: "false" is truthy), or an allocation of
terabytes (sizes are bounded before any tensor exists). Messages show user-supplied values through a bounded repr,
so a hostile config.json cannot make them huge.

Heterogeneous layers use transformers' own mechanism, `per_layer_config` ({layer index: {field: value}}): sparse
overrides of the flat fields, which stay the defaults (a config without it is the homogeneous model it always was, and
saves unchanged). `config.per_layer_config[i]` is layer i's resolved config; reading a field that varies between
layers from the global config raises transformers' AmbiguousGlobalPerLayerAttributeError, so no reader can miss it.
Only fields that shape one layer may vary (`PER_LAYER_FIELDS`): the mixer's (`MIXER_FIELDS`, by layer type), the
MLP's (`MLP_FIELDS`, by MLP type) and the block norms' (`BLOCK_FIELDS`). Everything the layers share (hidden_size,
vocab_size, embeddings and their tying, the norm parametrisation, position range, init and dropout, the layer lists
themselves) has one value per model and is refused per layer, as is a field the layer's mixer or MLP does not read
(gdn_* on an attention layer: it would be silently ignored). Each layer's resolved settings are validated like the
global ones, the messages naming the layer: "per_layer_config[3].num_key_value_heads ...". A per-layer
`rope_parameters` replaces the global dict; its missing rope_type, rope_theta and partial_rotary_factor are filled
from the global one at construction (so config.json shows every layer's full rotary settings). The final norm uses
the flat `rms_norm_eps`; GDN/KDA norm epsilons default to the flat `rms_norm_eps`, not to a layer's override of it.
A field declared with `per_layer_default_from` and left unset follows its source in each layer too:
`attention_output_bias` is a layer's own `attention_bias` unless given (a config written before the field existed,
where `attention_bias` switched all four projections, keeps its meaning layer by layer).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import textwrap
from typing import Any

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig

from .transformers_requirement import check_transformers_version  # noqa: F401 (checks on import)

from .component_registry import ConfigField, declarations_of, declared_fields, on_change
from .fp8_settings import QUANTIZATION_KEY, BlockFp8Settings, read_block_fp8_settings
from .mixer_registry import MIXERS, default_mixer
from .mixer_registry import mixer_types as registered_mixer_types
from .mixer_registry import tensor_parallel_plan as mixers_tensor_parallel_plan
from .mlp_registry import MLPS, default_mlp
from .mlp_registry import expert_parallel_plan as mlps_expert_parallel_plan
from .mlp_registry import tensor_parallel_plan as mlps_tensor_parallel_plan
from .registered_components import HybridLinearAttention  # noqa: F401  (fills the registries)
from .shown_values import brief, clip


def config_value(config: PreTrainedConfig, name: str, stored_as: str | None = None) -> Any:
    """`config.<name>`, read from the config's own `__dict__` (under `stored_as` where a property keeps it, as
    transformers' `_attn_implementation` does in `_attn_implementation_internal`), else from its class: the value the
    attribute would give, without transformers' attribute hooks (a few microseconds a read, on the host path that a
    captured decoding step waits for); None for a plain name set nowhere. Anything else is read the usual way."""
    stored = object.__getattribute__(config, "__dict__")
    key = stored_as or name
    if key in stored:
        return stored[key]
    cls = type(config)
    if stored_as is None and name not in cls.attribute_map and not hasattr(cls, name):
        return None  # what getattr(config, name, None) gives
    return getattr(config, name, None)


GATE_ACTIVATIONS = ("silu", "sigmoid")

# The mixers, MLP types and the fields each one's component reads (and may set per layer) come from the registrations
# (mixer_registry, mlp_registry; these tuples as registered at import, validation reads the registries themselves);
# every layer also reads BLOCK_FIELDS (its block norms). LAYER_TYPES: transformers' layer types they declare.
MIXER_TYPES = registered_mixer_types()


def _registered_layer_types() -> tuple[str, ...]:
    """transformers' layer types of the registered mixers, in registration order."""
    return tuple(dict.fromkeys(spec.layer_type for spec in MIXERS.values()))


LAYER_TYPES = _registered_layer_types()
MLP_TYPES = tuple(MLPS)
MIXER_FIELDS = {layer_type: tuple(spec.fields) for layer_type, spec in MIXERS.items()}
MLP_FIELDS = {mlp_type: tuple(spec.fields) for mlp_type, spec in MLPS.items()}
BLOCK_FIELDS = ("rms_norm_eps",)
PER_LAYER_FIELDS = tuple(dict.fromkeys(f for fields in (*MIXER_FIELDS.values(), *MLP_FIELDS.values(), BLOCK_FIELDS)
                                       for f in fields))
# At most this many per-layer problems are listed in one error (a hostile config could have one per layer).
_MAX_LAYER_PROBLEMS = 4

_DEFAULT_MIXER_TYPES = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "full_attention"] * 2
DEFAULT_MLP_TYPE = "dense"  # every layer's MLP unless mlp_types says otherwise

# Generous bounds that no real model reaches, so that a hostile config fails in validate(), before any allocation.
MAX_LAYERS = 100_000
MAX_PARAMETERS = 2**40  # in the embeddings, or in one decoder layer

# The rope types the rotary embedding runs (transformers' ROPE_INIT_FUNCTIONS, "default" computed here), each with the
# keys its init function reads without a default. "proportional" is left out: it rotates the whole head with zero
# frequencies on the pass-through dims, pairing dims differently from this model's partial rotary.
ROPE_REQUIRED_KEYS = {
    "default": ("rope_theta",),
    "linear": ("rope_theta", "factor"),
    "dynamic": ("rope_theta", "factor"),
    "yarn": ("rope_theta", "factor"),
    "longrope": ("rope_theta", "short_factor", "long_factor"),
    "llama3": ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"),
}

# How each field is checked: the shared ones here, the components' as their registrations declare them
# (component_registry.FIELD_KINDS)
_SHARED_FIELD_KINDS = {
    "vocab_size": "size", "hidden_size": "size", "max_position_embeddings": "size",
    "rms_norm_eps": "epsilon", "initializer_range": "initializer_range", "attention_dropout": "dropout",
    **dict.fromkeys(("zero_centered_norms", "tie_word_embeddings", "fuse_linear_cross_entropy", "use_cache",
                     "output_router_logits"), "bool"),
    "router_aux_loss_coef": "coefficient", "num_mtp_layers": "size_or_zero", "mtp_loss_weight": "coefficient",
}


def _field_kinds() -> dict[str, str]:
    """Every checked field and its kind, the registered components' included (read at each validation, so a
    component registered later is validated too)."""
    return {**_SHARED_FIELD_KINDS, **{name: declared.kind for name, declared in declared_fields().items()}}


def _layer_size_fields(layer_type: str, mlp_type: str) -> tuple[str, ...]:
    """The fields a layer's weight count grows with (named when the count is over MAX_PARAMETERS)."""
    sizes = (name for spec in (MLPS[mlp_type], MIXERS[layer_type]) for name, declared in spec.fields.items()
             if declared.kind in ("size", "size_or_zero"))
    return ("hidden_size", *dict.fromkeys(sizes))


_SIZE_FIELDS = tuple(name for name, kind in _field_kinds().items() if kind == "size")  # as registered at import


def _distinct(values: list) -> list:
    """The distinct values in order of appearance (unhashable ones compared by repr), a few at most."""
    seen, kept = set(), []
    for value in values:
        key = brief(value)
        if key not in seen:
            seen.add(key)
            kept.append(value)
        if len(kept) == 6:
            break
    return kept


def _is_int(value: Any, allow_none: bool = False) -> bool:
    return (value is None and allow_none) or (isinstance(value, int) and not isinstance(value, bool))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return _is_number(value) and (isinstance(value, int) or math.isfinite(value))  # (huge ints overflow isfinite)


def _positive_int_problem(name: str, value: Any, limit: int | None = None) -> str | None:
    if not _is_int(value) or value <= 0:
        return f"{name} must be a positive integer, got {brief(value)}"
    if limit is not None and value > limit:
        return f"{name} must be at most {brief(limit)}, got {brief(value)}"
    return None


def _number_problems(name: str, value: Any, low: float | None = None, high: float | None = None,
                     low_inclusive: bool = True) -> list[str]:
    """[] when value is a finite real number in [low, high) (or (low, high) without low_inclusive), else the problem."""
    if not _is_finite_number(value):
        return [f"{name} must be a finite number, got {brief(value)}"]
    too_low = low is not None and (value < low or (value == low and not low_inclusive))
    if too_low or (high is not None and value >= high):
        interval = f"{'[' if low_inclusive else '('}{low if low is not None else '-inf'}, {high or 'inf'})"
        return [f"{name} must be in {interval}, got {brief(value)}"]
    return []


class _Settings:
    """A config's fields as one layer sees them: `overrides` over the global values, which are read without
    transformers' per-layer guard (validation reads the defaults of fields that vary between layers on purpose)."""

    def __init__(self, config: PreTrainedConfig, overrides: dict | None = None):
        self._config, self._overrides = config, overrides or {}

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return self._config._getattr_without_heterogeneous_validation(name)


def _is_mixer_name(value: Any) -> bool:
    return isinstance(value, str) and value in MIXERS


def _layer_index(key: Any) -> int | None:
    """A per_layer_config key as a layer index: an int, or its decimal string (JSON keys are strings)."""
    if _is_int(key):
        return key
    if isinstance(key, str) and 0 < len(key) <= 8 and key.isascii() and key.isdigit():
        return int(key)
    return None


def _completed_rope(config: PreTrainedConfig, rope: Any) -> Any:
    """A layer's rope_parameters with rope_type, rope_theta and partial_rotary_factor filled from the global dict and
    original_max_position_embeddings as the base class fills it (left as given when not a dict: validation names it)."""
    if not isinstance(rope, dict):
        return rope
    defaults = config._getattr_without_heterogeneous_validation("rope_parameters")
    rope = {"rope_type": "default", **{key: defaults[key] for key in ("rope_theta", "partial_rotary_factor")}, **rope}
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return rope


def _followed_defaults(fields: dict[str, Any], unset: frozenset[str], readable: tuple[str, ...]) -> dict[str, Any]:
    """A layer's overrides plus, for each unset field it reads (`readable`) declared `per_layer_default_from` whose
    source the layer overrides (and not the field), the source's value: attention_output_bias follows the layer's
    attention_bias."""
    followed = {}
    for name in unset:
        declared = declared_fields().get(name)
        if (declared and declared.per_layer_default_from and name in readable and declared.default_from in fields
                and name not in fields):
            followed[name] = fields[declared.default_from]
    return {**fields, **followed}


def _window_fields(layer_type: str) -> tuple[str, ...]:
    """The "window" fields of a layer type's mixer: None globally, but required on its layers (sliding_window)."""
    return tuple(name for name, declared in MIXERS[layer_type].fields.items() if declared.kind == "window")


def _layer_problems(settings: _Settings, index: int, layer_type: str, mlp_type: str, fields: dict) -> list[str]:
    """Problems of layer `index`'s overridden fields, then of the relations and sizes they take part in."""
    prefix = f"per_layer_config[{index}]."
    problems = _field_problems(settings, prefix, tuple(name for name in _field_kinds() if name in fields))
    for name in _window_fields(layer_type):
        if getattr(settings, name) is None:
            problems.append(f"{prefix}{name} must be a positive integer for this {layer_type!r} layer, got None")
    if not problems:
        specs = (MIXERS[layer_type], MLPS[mlp_type])
        problems = _relation_problems(settings, prefix, specs) + _size_problems(settings, prefix,
                                                                               ((layer_type, mlp_type),))
    return problems


def _field_problems(s: _Settings, p: str, names: tuple[str, ...]) -> list[str]:
    """Each of `names` checked alone, as its kind says; p prefixes the names in the messages ("per_layer_config[3]."
    or "")."""
    problems, kinds = [], _field_kinds()
    for name in names:
        value, kind = getattr(s, name), kinds[name]
        if kind == "size":
            problems += [problem] if (problem := _positive_int_problem(p + name, value, MAX_PARAMETERS)) else []
        elif kind in ("epsilon", "positive_number"):
            problems += _number_problems(p + name, value, low=0.0, low_inclusive=False)
        elif kind in ("initializer_range", "coefficient"):
            problems += _number_problems(name, value, low=0.0)
        elif kind == "size_or_zero":
            if value != 0 and (problem := _positive_int_problem(p + name, value, MAX_PARAMETERS)):
                problems.append(problem.replace("a positive integer", "a positive integer or 0 (none)"))
        elif kind == "dropout":
            problems += _number_problems(name, value, low=0.0, high=1.0)
        elif kind == "bool":
            if not isinstance(value, bool):
                problems.append(f"{p}{name} must be True or False (a bool), got {brief(value)}")
        elif kind == "window":
            if value is not None and (problem := _positive_int_problem(p + name, value)):
                problems.append(problem + " (or None when no layer is 'sliding_attention')")
        elif kind == "gate_activation":
            if not isinstance(value, str) or value not in GATE_ACTIVATIONS:
                problems.append(f"{p}{name} must be one of {GATE_ACTIVATIONS}, got {brief(value)}")
        elif kind == "activation":
            if not isinstance(value, str) or value not in ACT2FN:
                problems.append(f"{p}{name}={brief(value)} is not a known activation; use e.g. 'silu'")
        elif kind == "rope":
            problems += _rope_problems(value, p)
    return problems


def _windowed_layers(per_layer: Any) -> set[int]:
    """The layers that a (not yet validated) per_layer_config gives a window of their own (sliding_window)."""
    if not isinstance(per_layer, dict):
        return set()
    windows = {name for name, declared in declared_fields().items() if declared.kind == "window"}
    return {_layer_index(key) for key, fields in per_layer.items()
            if isinstance(fields, dict) and any(fields.get(name) is not None for name in windows)}


def _layer_types_problems(s: _Settings, windowed_layers: set[int]) -> list[str]:
    """mixer_types (one registered mixer per layer) and layer_types (transformers' word for each, the one its mixer
    declares)."""
    layers, mixer_types = s.num_hidden_layers, s.mixer_types
    if isinstance(mixer_types, list) and len(mixer_types) > MAX_LAYERS:
        return [f"mixer_types has {len(mixer_types)} entries, more than the limit of {MAX_LAYERS} layers"]
    if layers is not None and (problem := _positive_int_problem("num_hidden_layers", layers, MAX_LAYERS)):
        return [problem]
    if not isinstance(mixer_types, list) or not mixer_types:
        return [f"mixer_types (or layer_types) must be a non-empty list of {tuple(MIXERS)}, got {brief(mixer_types)}"]
    problems = []
    unknown = [i for i, t in enumerate(mixer_types) if not isinstance(t, str) or t not in MIXERS]
    if unknown:  # named in the list it came from (an unknown entry of layer_types is kept in both)
        given_as_layer_types = isinstance(s.layer_types, list) and len(s.layer_types) == len(mixer_types) and all(
            s.layer_types[i] is mixer_types[i] for i in unknown)
        if given_as_layer_types:
            problems.append(f"layer_types has unknown entries {brief(_distinct([mixer_types[i] for i in unknown]))}; "
                            f"each entry must be one of transformers' layer types {_registered_layer_types()} or a "
                            f"mixer of "
                            f"{tuple(MIXERS)}")
        else:
            problems.append(f"mixer_types has unknown entries {brief(_distinct([mixer_types[i] for i in unknown]))}; "
                            f"each entry must be one of {tuple(MIXERS)}")
    if layers is not None and layers != len(mixer_types):
        problems.append(f"num_hidden_layers={layers} but layer_types has {len(mixer_types)} entries; "
                        "give one layer type per layer (or leave num_hidden_layers unset)")
    if not problems:
        problems += _generic_names_problems(s.layer_types, mixer_types, MIXERS, "layer_types", "mixer_types",
                                            lambda spec: spec.layer_type)
    for mixer in dict.fromkeys(t for t in mixer_types if isinstance(t, str) and t in MIXERS):
        for name in _window_fields(mixer):
            if getattr(s, name) is None and any(t == mixer and i not in windowed_layers
                                                for i, t in enumerate(mixer_types)):
                problems.append(f"mixer_types has {mixer!r} layers, so {name} must be a positive integer, got None")
    return problems


def _generic_names_problems(generic: Any, ours: list, registry: dict, generic_name: str, our_name: str,
                            generic_of) -> list[str]:
    """transformers' list (`layer_types`, `mlp_layer_types`) against ours (`mixer_types`, `mlp_types`): one entry
    per layer, each the word our component's registration declares (`generic_of(spec)`)."""
    if not isinstance(generic, list) or len(generic) != len(ours):
        return [(f"{generic_name} must be a list of one entry per layer ({len(ours)}, as {our_name}), got "
                 f"{brief(generic)}; leave it unset to take it from {our_name}")]
    for index, (word, name) in enumerate(zip(generic, ours)):
        if isinstance(name, str) and name in registry and word != generic_of(registry[name]):
            return [(f"{generic_name}[{index}]={brief(word)} but {our_name}[{index}]={name!r} is a "
                     f"{generic_of(registry[name])!r} layer; leave {generic_name} unset to take it from {our_name}, "
                     f"or change {our_name}[{index}]")]
    return []


def _mlp_types_problems(s: _Settings) -> list[str]:
    """mlp_types: one registered MLP type per layer, and mlp_layer_types (transformers' word for each) to match
    (checked once mixer_types is sound)."""
    mlp_types, layers = s.mlp_types, len(s.mixer_types)
    if not isinstance(mlp_types, list) or not mlp_types:
        return [f"mlp_types must be a non-empty list of {tuple(MLPS)}, one per layer, got {brief(mlp_types)}"]
    problems = []
    if len(mlp_types) != layers:
        problems.append(f"mlp_types has {len(mlp_types)} entries but layer_types has {layers}; give one MLP type per "
                        f"layer (or leave mlp_types unset: every layer {DEFAULT_MLP_TYPE!r})")
    unknown = [t for t in mlp_types[:MAX_LAYERS] if not isinstance(t, str) or t not in MLPS]
    if unknown:
        problems.append(f"mlp_types has unknown entries {brief(_distinct(unknown))}; each entry must be one of "
                        f"{tuple(MLPS)}")
    if not problems:
        problems += _generic_names_problems(s.mlp_layer_types, mlp_types, MLPS, "mlp_layer_types", "mlp_types",
                                            lambda spec: spec.mlp_layer_type)
    return problems


# The kinds of multi-token-prediction head (`mtp_type`; the modules: mtp_heads.MTP_HEADS): Qwen3-Next's layers that
# chain the next token's embedding into the last hidden state (mtp_head.py), Fast-LLM's heads that each run a copy
# of the last decoder block on the input of that block, in parallel (mtp_parallel_heads.py)
MTP_TYPES = ("qwen3_next", "fast_llm")
PARALLEL_MTP_TYPE = "fast_llm"  # the kind whose layers copy the last decoder layer (its mixer, MLP and settings)


def _mtp_problems(s: _Settings) -> list[str]:
    """mtp_type: a known kind; mtp_mlp_type: a registered MLP when the model has MTP layers, None (or one) without,
    the last layer's for Fast-LLM's heads (copies of that layer)."""
    kind = s.mtp_type
    if not isinstance(kind, str) or kind not in MTP_TYPES:
        return [f"mtp_type must be one of {MTP_TYPES}, got {brief(kind)}"]
    value = s.mtp_mlp_type
    if value is not None and (not isinstance(value, str) or value not in MLPS):
        return [(f"mtp_mlp_type must be one of {tuple(MLPS)} (or None: the first layer's MLP, the last layer's for "
                 f"mtp_type 'fast_llm'), got {brief(value)}")]
    count = s.num_mtp_layers
    if _is_int(count) and count > MAX_LAYERS:  # (the layers are built one by one, as the decoder's)
        return [f"num_mtp_layers must be at most {MAX_LAYERS}, got {brief(count)}"]
    if value is None and _is_int(count) and count > 0:
        return ["mtp_mlp_type is None but num_mtp_layers > 0; name the MTP layers' MLP, one of " + str(tuple(MLPS))]
    last = s.mlp_types[-1] if isinstance(s.mlp_types, list) and s.mlp_types else None
    if kind == PARALLEL_MTP_TYPE and _is_int(count) and count > 0 and value != last:
        return [(f"mtp_mlp_type is {brief(value)} but mtp_type={kind!r} heads are copies of the last decoder layer, "
                 f"whose MLP is {brief(last)}; leave mtp_mlp_type unset (or set it to {brief(last)})")]
    return []


def _rope_problems(rope: Any, p: str = "") -> list[str]:
    name = f"{p}rope_parameters"
    if not isinstance(rope, dict):
        return [f"{name} must be a dict with rope_type and rope_theta, got {brief(rope)}"]
    rope_type = rope.get("rope_type")
    if not isinstance(rope_type, str) or rope_type not in ROPE_REQUIRED_KEYS:
        known = tuple(ROPE_REQUIRED_KEYS)
        return [(f"{name}['rope_type'] must be one of {known} (the types this model's rotary embedding runs), got "
                 f"{brief(rope_type)}")]
    missing = [key for key in ROPE_REQUIRED_KEYS[rope_type] if key not in rope]
    if missing:
        return [f"{name} with rope_type {rope_type!r} needs the keys {missing}"]
    problems = []
    for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
        if key in rope and not (key == "attention_factor" and rope[key] is None):
            problems += _number_problems(f"{name}['{key}']", rope[key], low=0.0, low_inclusive=False)
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if rope.get(key) is not None:
            problems += _number_problems(f"{name}['{key}']", rope[key])
    if rope.get("original_max_position_embeddings") is not None:
        problem = _positive_int_problem(f"{name}['original_max_position_embeddings']",
                                        rope["original_max_position_embeddings"])
        problems += [problem] if problem else []
    factor = rope.get("partial_rotary_factor")
    if not _is_number(factor) or not 0 < factor <= 1:
        problems.append(f"{name}['partial_rotary_factor'] must be in (0, 1], got {brief(factor)}")
    return problems


def _relation_problems(s: _Settings, p: str, specs) -> list[str]:
    """Checks between the fields that the components `specs` read (each field already known to be well typed), as
    their registrations define them."""
    checks = dict.fromkeys(spec.relation_problems for spec in specs)  # full and sliding attention share one
    return [problem for check in checks for problem in check(s, p)]


def _dtype_problems(dtype: Any) -> list[str]:
    """`dtype` is None, a torch dtype or the name of one: transformers' base config looks a name up in torch (an
    AttributeError for any other name) and loading uses the dtype as it stands."""
    if dtype is None:
        return []
    import torch  # here only: this module imports no torch at import time

    if isinstance(dtype, torch.dtype) or (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None),
                                                                               torch.dtype)):
        return []
    return [f"dtype must be the name of a torch dtype (float32, bfloat16, float16, ...), got {brief(dtype)}"]


def _token_id_problems(s: _Settings) -> list[str]:
    problems = []
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(s, name)
        ids = value if name == "eos_token_id" and isinstance(value, list) and value else [value]
        if value is not None and not all(_is_int(i) and 0 <= i < s.vocab_size for i in ids):
            kind = "an integer or a non-empty list of integers" if name == "eos_token_id" else "an integer"
            problems.append(f"{name} must be None or {kind} in [0, vocab_size={s.vocab_size}), got {brief(value)}")
    return problems


def _size_problems(s: _Settings, p: str, layers) -> list[str]:
    """Bounds the weights a model of these settings would allocate, so a hostile config fails here, not in torch.
    `layers`: the distinct (layer type, MLP type) pairs to bound."""
    counts = {}
    if not p:
        embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
        counts["the embeddings"] = (("vocab_size", "hidden_size"), embeddings)
    several_mlps = len({mlp_type for _, mlp_type in layers}) > 1
    for layer_type, mlp_type in layers:
        what = f"one {layer_type} layer" + (f" with a {mlp_type!r} MLP" if several_mlps else "")
        counts[what] = (_layer_size_fields(layer_type, mlp_type), _layer_parameter_count(s, layer_type, mlp_type))
    over = {what: (fields, count) for what, (fields, count) in counts.items() if count > MAX_PARAMETERS}
    if not over:
        return []
    fields = dict.fromkeys(p + field for names, _ in over.values() for field in names)
    holding = ", ".join(f"{what} {brief(count)}" for what, (_, count) in over.items())
    return [f"the sizes give more weights than the limit of 2**40 ({holding}): reduce {', '.join(fields)}"]


def _layer_parameter_count(s: _Settings, layer_type: str, mlp_type: str) -> int:
    """Weights of one decoder layer (norms and biases left out: they are small next to the projections)."""
    return MLPS[mlp_type].parameter_count(s) + MIXERS[layer_type].parameter_count(s)


# ----------------------------------------------------------------------------------- fields from the registries

_CLASS_DOC = """
    Args:
        vocab_size, hidden_size, max_position_embeddings, tie_word_embeddings, initializer_range, attention_dropout,
        rms_norm_eps, pad_token_id, bos_token_id, eos_token_id, use_cache:
            as in other transformers decoders. `rms_norm_eps` is the epsilon of the block, final and q/k RMSNorms (a
            layer may set its own).
        mixer_types (`list[str]`): one mixer per layer. Default: 3 Gated DeltaNet layers to 1 attention layer, 8
            layers (or the default mixer of each `layer_types` entry). Registered: {mixer_types}.
        layer_types (`list[str]`): transformers' layer type of each layer ({layer_types}), which its mixer
            declares: follows from `mixer_types` (or gives it).
        mlp_types (`list[str]`): one MLP per layer. Default: every layer "dense" (or the default MLP of each
            `mlp_layer_types` entry). Registered: {mlp_types}.
        mlp_layer_types (`list[str]`): transformers' word for each layer's MLP ("dense", "sparse"): follows from
            `mlp_types` (or gives it).
        num_hidden_layers (`int`, *optional*): follows from `mixer_types`; if given, must match its length.
        zero_centered_norms (`bool`): the block, final and q/k RMSNorms compute x_hat * (1 + w) with w initialised to 0
            (Qwen3-Next) instead of x_hat * w with w initialised to 1. The gated output norms of GDN/KDA are always
            x_hat * w.
        output_router_logits (`bool`, defaults to False): return each sparse MoE layer's router logits and the
            load-balancing loss `aux_loss`, added to the loss times `router_aux_loss_coef` (Qwen3-Next's names).
        router_aux_loss_coef (`float`, defaults to 0.001): the weight of the load-balancing loss in the loss.
        num_mtp_layers (`int`, defaults to 0): multi-token-prediction layers, tensors `mtp.*`, of the kind
            `mtp_type`; 0: none (transformers' name; Qwen3-Next's config.json says `mtp_num_hidden_layers` or
            `num_nextn_predict_layers`, Fast-LLM's `prediction_heads` counts the next-token head too).
        mtp_type (`str`, defaults to "qwen3_next"): "qwen3_next" (`mtp_head.py`: the token embedding and the last
            hidden state fused by `fc`, one decoder block of full attention, a final norm, the shared LM head) or
            "fast_llm" (`mtp_parallel_heads.py`: layer d runs a copy of the last decoder layer on that layer's input,
            then its own final norm and the shared LM head, predicting token t + d + 1).
        mtp_mlp_type (`str`, *optional*): the MLP of the MTP layers: for "qwen3_next", one of the registered MLPs,
            by default the first decoder layer's; for "fast_llm", the last layer's, which the heads copy (another
            is refused); None without MTP layers.
        mtp_loss_weight (`float`, defaults to 0.0): with labels, the MTP loss (the mean over the MTP layers of the
            cross-entropy of token t + 1 + d at depth d) times this weight is added to `loss` and returned apart as
            `mtp_loss`; 0: not computed (the forward's `mtp_loss_weight=` overrides it).
        fuse_linear_cross_entropy (`bool`): in training (`model.train()`, `labels` given, CUDA tensors, fla
            installed), compute the loss from the hidden states with fla's fused linear + cross-entropy, which does
            not keep the [tokens, vocab] logits for the backward (and holds at most 4 GiB of them at once): the
            same loss, less memory; `outputs.logits` is then None. Evaluation and inference always return logits.

    The settings of the registered mixers and MLPs (declared by their registrations; a layer may set those of its
    own mixer and MLP in `per_layer_config`):
{registered}
"""


def _registered_fields_doc() -> str:
    """One Args entry per registered field, from its declaration, naming the components that read it."""
    lines = []
    for name, declared in declared_fields().items():
        readers = ", ".join(key for _, key in declarations_of(name))
        default = f"defaults to {declared.default_from if declared.default_from else repr(declared.default)}"
        lines.append(textwrap.fill(f"{name} (`{declared.annotation}`, {default}; {readers}): {declared.doc}", 120,
                                   initial_indent=" " * 8, subsequent_indent=" " * 12))
    return "\n".join(lines)


def _class_doc() -> str:
    return _CLASS_DOC.format(mixer_types=", ".join(map(repr, MIXERS)),
                             layer_types=", ".join(map(repr, _registered_layer_types())), mlp_types=", ".join(map(repr, MLPS)),
                             registered=_registered_fields_doc())


def _fields_dataclass(declared: dict[str, ConfigField]) -> type:
    """A dataclass with one field per declared setting (its annotation and default) and nothing else (no __init__,
    __eq__ or __repr__ of its own): HybridLinearConfig inherits it, so the registered fields exist when transformers
    makes the config class a dataclass; a later registration takes its Field records from one too."""
    entries = [(name, declared_field.annotation, dataclasses.field(default=declared_field.default, kw_only=True))
               for name, declared_field in declared.items()]
    return dataclasses.make_dataclass("HybridLinearRegisteredFields", entries, init=False, repr=False, eq=False,
                                      match_args=False, namespace={"__module__": __name__})


class HybridLinearConfig(PreTrainedConfig, _fields_dataclass(declared_fields())):
    # __doc__: built from the registered fields' docs (_class_doc, at the end of this module)

    model_type = "hybrid_linear"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    # each MLP's and mixer's entries as its registration declares them (GDN and KDA split by heads, their conv
    # kernels, dt_bias, A_log and norm weight replicated: see tensor_parallel_heads.py)
    base_model_tp_plan = {**mlps_tensor_parallel_plan(), **mixers_tensor_parallel_plan()}
    # the MoE experts whole on each rank, E / ep_size of them (DistributedConfig(tp_size=n, ep_size=n): the rest
    # stays tensor parallel); see mlp_sparse_moe.py
    base_model_ep_plan = mlps_expert_parallel_plan()
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # The fields the whole model shares (plus rms_norm_eps, every block's); the mixers' and MLPs' come from their
    # registrations (the base class above).
    vocab_size: int = 32000
    hidden_size: int = 1024
    layer_types: list[str] | None = None
    mixer_types: list[str] | None = None
    mlp_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    num_hidden_layers: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    zero_centered_norms: bool = True
    fuse_linear_cross_entropy: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    num_mtp_layers: int = 0
    mtp_type: str = "qwen3_next"
    mtp_mlp_type: str | None = None
    mtp_loss_weight: float = 0.0
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        per_layer = kwargs.pop("per_layer_config", None)
        # config.json's quantization_config, kept under this family's own name so that transformers' quantizers never
        # take the model (fp8_layers.py says why); to_dict writes it back under its own name
        self.block_fp8 = kwargs.pop(QUANTIZATION_KEY, getattr(self, "block_fp8", None))
        read_block_fp8_settings(self.block_fp8)  # one line naming an unsupported setting, before any weight
        unset = self._resolve_defaults(kwargs)
        windows = _windowed_layers(per_layer)
        self.validate(windowed_layers=windows)  # before the base class, which rewrites some legacy layer-type names
        super().__post_init__(**kwargs)
        self.validate(windowed_layers=windows)  # again: the base class standardises rope_parameters
        if per_layer is not None:
            # checked before transformers applies it: it drops overrides equal to the default (1 == True included)
            overrides = self._per_layer_overrides(per_layer, unset)
            if overrides:
                self.per_layer_config = overrides
                self.validate()

    def _resolve_defaults(self, kwargs: dict) -> frozenset[str]:
        """Fills the fields whose defaults follow from others; leaves malformed values for validate() to name.
        Returns the fields it filled from another (`default_from`), which were left unset."""
        self._resolve_layer_lists()
        legacy = kwargs.pop("rope_scaling", None)  # transformers' older name, taken as the base class would
        if self.rope_parameters is None and legacy is not None:
            self.rope_parameters = legacy
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default"}
        if isinstance(self.rope_parameters, dict):  # (the missing keys as Qwen3-Next fills them: a quarter rotates)
            self.rope_parameters = dict(self.rope_parameters)
            self.rope_parameters.setdefault("rope_type", "default")
            self.rope_parameters.setdefault("rope_theta", kwargs.pop("rope_theta", 10_000.0))
            self.rope_parameters.setdefault("partial_rotary_factor", kwargs.pop("partial_rotary_factor", 0.25))
        for name, declared in declared_fields().items():  # (None: the part left out, as DeepSeek's q_lora_rank)
            if declared.kind == "size_or_zero" and getattr(self, name, 0) is None:
                setattr(self, name, 0)
        self._resolve_mtp_mlp_type()
        unset = set()
        for name, declared in declared_fields().items():  # defaults that follow another field (gdn_norm_eps)
            if declared.default_from is not None and getattr(self, name) is None:
                setattr(self, name, getattr(self, declared.default_from))
                unset.add(name)
        return frozenset(unset)

    def _resolve_mtp_mlp_type(self) -> None:
        """mtp_mlp_type left None for a model with MTP layers: layer 0's MLP (the one vLLM builds for Qwen3-Next's
        MTP layer), the last layer's for Fast-LLM's heads (copies of that layer)."""
        if (self.mtp_mlp_type is None and _is_int(self.num_mtp_layers) and self.num_mtp_layers > 0
                and isinstance(self.mlp_types, list) and self.mlp_types):
            self.mtp_mlp_type = self.mlp_types[-1 if self.mtp_type == PARALLEL_MTP_TYPE else 0]

    def _resolve_layer_lists(self) -> None:
        """Completes each pair of per-layer lists from what is given: `mixer_types` and transformers' `layer_types`,
        `mlp_types` and transformers' `mlp_layer_types` (see the module docstring). A mixer's name in `layer_types`
        (as configs that name no mixer elsewhere write it) is that layer's mixer. Entries that name nothing
        registered are kept for validate() to name."""
        for name in ("layer_types", "mixer_types", "mlp_types", "mlp_layer_types"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        mixers, given = self.mixer_types, self.layer_types
        if isinstance(given, list) and len(given) <= MAX_LAYERS:
            if mixers is None:  # each layer's mixer: the one layer_types names, else the default of its layer type
                self.mixer_types = mixers = [t if _is_mixer_name(t) else default_mixer(t) or t for t in given]
            self.layer_types = [MIXERS[t].layer_type if _is_mixer_name(t) else t for t in given]
        if mixers is None and _is_int(self.num_hidden_layers, allow_none=True):
            count = self.num_hidden_layers or len(_DEFAULT_MIXER_TYPES)
            if count <= MAX_LAYERS:  # never build a list for a hostile layer count
                self.mixer_types = mixers = [_DEFAULT_MIXER_TYPES[i % len(_DEFAULT_MIXER_TYPES)] for i in range(count)]
        if self.layer_types is None and isinstance(mixers, list):
            self.layer_types = [MIXERS[t].layer_type if _is_mixer_name(t) else None for t in mixers]
        if self.num_hidden_layers is None and isinstance(mixers, list) and mixers:
            self.num_hidden_layers = len(mixers)
        if self.mlp_types is None and isinstance(self.mlp_layer_types, list):
            self.mlp_types = [(default_mlp(t) if isinstance(t, str) else None) or t for t in self.mlp_layer_types]
        if self.mlp_types is None and isinstance(mixers, list):
            self.mlp_types = [DEFAULT_MLP_TYPE] * len(mixers)
        if self.mlp_layer_types is None and isinstance(self.mlp_types, list) and len(self.mlp_types) <= MAX_LAYERS:
            self.mlp_layer_types = [MLPS[t].mlp_layer_type if isinstance(t, str) and t in MLPS else t
                                    for t in self.mlp_types]

    def to_dict(self) -> dict[str, Any]:
        """As the base class, with the FP8 setting under config.json's name, `quantization_config` (when set)."""
        output = super().to_dict()
        fields = output.pop("block_fp8", None)
        if fields is not None:
            output[QUANTIZATION_KEY] = fields
        return output

    @property
    def block_fp8_settings(self) -> BlockFp8Settings | None:
        """The checked FP8 setting (`fp8_settings`), None for a model in floating point."""
        return read_block_fp8_settings(self.block_fp8)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As the base class, then validates again: keyword overrides are set after construction. A config.json of
        another model type (an unconverted Qwen3-Next or Kimi-Linear folder) is refused in one line: transformers
        would build this family's default model from it and fail on its weights."""
        model_type = config_dict.get("model_type") if isinstance(config_dict, dict) else None
        if model_type is not None and model_type != cls.model_type:
            raise ValueError(f"config.json's model_type is {brief(model_type)}, not {cls.model_type!r}: the folder is "
                             "another family's checkpoint; convert it first (hybrid-linear-convert --from FORMAT "
                             "--to hf SRC DST; hybrid-linear-convert --help lists the formats), or load it with its "
                             "own class.")
        stored_kind = config_dict.get("mtp_type", "qwen3_next") if isinstance(config_dict, dict) else None
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if "mtp_type" in kwargs and "mtp_mlp_type" not in kwargs and kwargs["mtp_type"] != stored_kind:
            config.mtp_mlp_type = None  # (the stored one was resolved for the other kind: resolved again below)
        config._resolve_mtp_mlp_type()  # (an override of num_mtp_layers adds MTP layers to a config without them)
        config.validate()
        return loaded

    # ------------------------------------------------------------------------------------------- per-layer settings

    def _per_layer_overrides(self, per_layer: Any, unset: frozenset[str] = frozenset()) -> dict[int, dict[str, Any]]:
        """per_layer_config as {layer index: {field: value}}, rope dicts completed, or one ValueError naming every
        bad layer and field (an index out of range, a field that cannot vary or that the layer's mixer does not read,
        a bad value). `unset`: the fields left unset that follow another; those declared `per_layer_default_from`
        take a layer's override of their source (once it is validated)."""
        if not isinstance(per_layer, dict):
            raise ValueError(f"Invalid HybridLinearConfig: per_layer_config must be a dict {{layer index: {{field: "
                             f"value}}}}, got {brief(per_layer)}.")
        overrides, problems = {}, []
        for key, fields in per_layer.items():
            index = _layer_index(key)
            if index is None or not 0 <= index < self.num_hidden_layers:
                problems.append(f"per_layer_config has the key {brief(key)}; its keys must be layer indices in "
                                f"[0, num_hidden_layers={self.num_hidden_layers})")
            elif index in overrides:
                problems.append(f"per_layer_config names layer {index} twice ({brief(key)}); merge its settings")
            elif not isinstance(fields, dict):
                problems.append(f"per_layer_config[{index}] must be a dict {{field: value}}, got {brief(fields)}")
            else:
                problems += self._override_name_problems(index, fields)
                overrides[index] = {name: _completed_rope(self, value) if name == "rope_parameters" else value
                                    for name, value in fields.items()}
            if len(problems) >= _MAX_LAYER_PROBLEMS:
                break
        if not problems:
            for index, fields in sorted(overrides.items()):
                problems += _layer_problems(_Settings(self, fields), index, self.mixer_types[index],
                                            self.mlp_types[index], fields)
                if len(problems) >= _MAX_LAYER_PROBLEMS:
                    break
        if problems:
            raise ValueError("Invalid HybridLinearConfig: " + "; ".join(problems[:_MAX_LAYER_PROBLEMS]) + ".")
        overrides = {index: _followed_defaults(fields, unset, self._layer_fields(index))
                     for index, fields in overrides.items()}
        # only what differs from the defaults (as transformers keeps it), and no layer without overrides: a config
        # whose overrides all equal the defaults is homogeneous, and saves as such
        defaults = _Settings(self)
        overrides = {index: {name: value for name, value in fields.items() if value != getattr(defaults, name)}
                     for index, fields in overrides.items()}
        return {index: fields for index, fields in overrides.items() if fields}

    def _layer_fields(self, index: int) -> tuple[str, ...]:
        """The fields layer `index` reads (its mixer's, its MLP's, its block norms'): those it may override."""
        layer_type, mlp_type = self.mixer_types[index], self.mlp_types[index]
        return tuple(dict.fromkeys((*MIXERS[layer_type].fields, *MLPS[mlp_type].fields, *BLOCK_FIELDS)))

    def _override_name_problems(self, index: int, fields: dict) -> list[str]:
        layer_type, mlp_type = self.mixer_types[index], self.mlp_types[index]
        own = self._layer_fields(index)
        mixer_fields = {name for spec in MIXERS.values() for name in spec.fields}
        mlp_fields = {name for spec in MLPS.values() for name in spec.fields}
        problems = []
        for name in fields:
            where = f"per_layer_config[{index}].{clip(str(name), 60)}"
            if name in own:
                continue
            if name in mixer_fields:
                problems.append(f"{where} is not read by layer {index}, a {layer_type!r} layer (it would be "
                                f"ignored); remove it, or change mixer_types[{index}]")
            elif name in mlp_fields:
                problems.append(f"{where} is not read by layer {index}, whose MLP is {mlp_type!r} (mlp_types[{index}]"
                                f"; it would be ignored); remove it, or change mlp_types[{index}]")
            elif name == "skip":
                problems.append(f"{where}: every layer of this model runs its mixer and its MLP (transformers' "
                                "'skip' is not supported); remove it")
            elif isinstance(name, str) and name in self.__dataclass_fields__:
                problems.append(f"{where} cannot differ between layers (one value per model); set it at the top "
                                f"level. Per-layer fields: {own}")
            else:
                problems.append(f"{where} is not a field of HybridLinearConfig; the fields a {layer_type!r} layer can "
                                f"set: {own}")
        return problems

    # ------------------------------------------------------------------------------------------------ validation

    def validate(self, windowed_layers: set[int] | None = None) -> None:
        """Raises one ValueError naming every invalid field, the problem and the fix.

        This overrides the hook of transformers' strict dataclass config, which calls `validate()` when a config is
        saved (so a config mutated after construction is not written invalid); `__post_init__` and `from_dict` call
        it too. The global fields (the defaults) are checked first, then every layer's overrides with the fields
        they combine with. Fields are checked one by one first; the relations between them only when the fields they
        read are sound, so one bad value gives one message, not a cascade. Fields that vary between layers are read
        without transformers' per-layer guard: their global values are the defaults, validated as such.
        `windowed_layers`: the layers given their own sliding window by a per_layer_config not yet applied."""
        settings = _Settings(self)
        if windowed_layers is None and self.is_heterogeneous:
            windowed_layers = _windowed_layers(self._heterogeneity_spec.per_layer_overrides)
        problems = _field_problems(settings, "", tuple(_field_kinds())) + _dtype_problems(self.dtype)
        layer_types_problems = _layer_types_problems(settings, windowed_layers or set())
        problems += layer_types_problems or _mlp_types_problems(settings)
        problems += _mtp_problems(settings)
        if not problems:
            specs = (*MIXERS.values(), *MLPS.values())
            problems = _relation_problems(settings, "", specs) + _token_id_problems(settings)
            problems += _size_problems(settings, "", dict.fromkeys(zip(self.mixer_types, self.mlp_types)))
        if not problems and self.is_heterogeneous:
            for index, fields in sorted(self._heterogeneity_spec.per_layer_overrides.items()):
                problems += _layer_problems(_Settings(self, fields), index, self.mixer_types[index],
                                            self.mlp_types[index], fields)
                if len(problems) >= _MAX_LAYER_PROBLEMS:
                    break
        if problems:
            raise ValueError("Invalid HybridLinearConfig: " + "; ".join(problems) + ".")

    # ------------------------------------------------------------------------------------------------- helpers

    def layers_of_type(self, *types: str) -> list[int]:
        """Indices of the layers whose mixer is one of `types`."""
        return [i for i, t in enumerate(self.mixer_types) if t in types]


def repeated_layer_config(config: HybridLinearConfig, index: int, count: int) -> HybridLinearConfig:
    """A copy of `config` whose `count` layers are all layer `index` (its mixer, its MLP and its per-layer settings),
    each with its own index: what a module of copies of one layer is built from (Fast-LLM's MTP heads copy the last
    layer), and the one-layer model that gives the tensors outside the layers (conversion.hf_layout)."""
    copied = copy.copy(config)
    copied.__dict__.pop("_heterogeneity_spec", None)
    for name in ("mixer_types", "layer_types", "mlp_types", "mlp_layer_types"):
        setattr(copied, name, [getattr(config, name)[index]] * count)
    copied.num_hidden_layers = count
    spec = config.__dict__.get("_heterogeneity_spec")
    overrides = spec.per_layer_overrides.get(index) if spec is not None else None
    if overrides:
        copied.per_layer_config = {layer: dict(overrides) for layer in range(count)}
    return copied


# The config's own fields, which no registration may declare (PreTrainedConfig's and those written above).
_OWN_FIELDS = frozenset(PreTrainedConfig.__dataclass_fields__) | frozenset(HybridLinearConfig.__annotations__)
_REGISTERED_FIELDS = set(declared_fields())  # the fields HybridLinearConfig holds from the registries


def _sync_registered_fields() -> None:
    """Makes HybridLinearConfig's registered fields, docstring and TP plan those of the components registered now
    (called by component_registry after every registration or removal)."""
    declared = declared_fields()
    clashes = sorted(set(declared) & _OWN_FIELDS)
    if clashes:
        owners = "; ".join(f"{name} (declared by {', '.join(key for _, key in declarations_of(name))})"
                           for name in clashes)
        raise ValueError(f"a registered component declares a field that HybridLinearConfig owns: {owners}; rename it "
                         "(prefix it with the component's name, as gdn_* and kda_* are).")
    cls, fields = HybridLinearConfig, HybridLinearConfig.__dataclass_fields__
    new = {name: declared_field for name, declared_field in declared.items() if name not in fields}
    for name, record in _fields_dataclass(new).__dataclass_fields__.items():
        fields[name] = record  # read by transformers' keyword __init__, to_diff_dict and dataclasses.fields
        setattr(cls, name, record.default)
    for name in _REGISTERED_FIELDS - set(declared):
        del fields[name]
        if name in cls.__dict__:
            delattr(cls, name)
    _REGISTERED_FIELDS.clear()
    _REGISTERED_FIELDS.update(declared)
    cls.__doc__ = _class_doc()
    cls.base_model_tp_plan = {**mlps_tensor_parallel_plan(), **mixers_tensor_parallel_plan()}
    cls.base_model_ep_plan = mlps_expert_parallel_plan()


_sync_registered_fields()  # the docstring, and the check that no registered field clashes with the config's own
on_change(_sync_registered_fields)

__all__ = ["HybridLinearConfig", "LAYER_TYPES", "MIXER_TYPES", "MLP_TYPES", "MTP_TYPES", "PARALLEL_MTP_TYPE",
           "PER_LAYER_FIELDS", "repeated_layer_config"]

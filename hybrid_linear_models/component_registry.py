"""What the two registries of block components (token mixers: `mixer_registry`; MLPs: `mlp_registry`) share: the
config fields a component declares (`ConfigField`), the record common to every component (`ComponentSpec`), and the
bookkeeping that keeps the configuration in step with what is registered.

A component owns its settings. Its spec declares each config field it reads once, with its kind (how the config
checks it), its default and a one-line doc; `HybridLinearConfig` takes its dataclass fields, their defaults and the
docstring lines of these settings from the registered specs (`configuration_hybrid_linear`), so a new component adds
its settings with no edit to the config module. A field read by several components (attention's head counts, read by
full and sliding attention) is declared once and referenced by each, or declared again identically: `register`
refuses two declarations of one name that differ.

Torch-free: the configuration imports this module (the registrations themselves live in the component modules, which
the two registries import at their end).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How the configuration checks a declared field (configuration_hybrid_linear._field_problems): "size" a positive
# integer (bounded), "size_or_zero" the same or 0 (the part it sizes left out), "epsilon" a finite number > 0, "bool"
# True/False, "gate_activation" one of GATE_ACTIVATIONS, "activation" a name in transformers' ACT2FN, "window" None
# or a positive integer (required on the layers whose component declares it), "rope" a rope_parameters dict the
# rotary embedding runs, "positive_number" a finite number > 0 (a scale factor).
FIELD_KINDS = ("size", "size_or_zero", "epsilon", "bool", "gate_activation", "activation", "window", "rope",
               "positive_number")
# The annotation of each kind's dataclass field (what `help(HybridLinearConfig)` and the signature show).
_ANNOTATIONS = {"size": "int", "size_or_zero": "int", "epsilon": "float", "bool": "bool", "gate_activation": "str",
                "activation": "str", "window": "int | None", "rope": "dict | None",
                "positive_number": "float"}
_IMMUTABLE_DEFAULTS = (type(None), bool, int, float, str)  # a dataclass default is shared by every instance


@dataclass(frozen=True)
class ConfigField:
    """One config field a component reads (and a layer of that component may set in `per_layer_config`)."""

    kind: str  # one of FIELD_KINDS
    default: Any  # an immutable value (None, bool, int, float, str); None is resolved by the config
    doc: str  # one line for the config's docstring
    default_from: str | None = None  # when the value is None: the value of this other (flat) field, e.g. rms_norm_eps
    # With default_from, while this field is left unset: a layer whose per_layer_config sets the default_from field
    # but not this one takes that value too (attention_output_bias follows a layer's attention_bias, as when one
    # switch covered all four projections). False: a layer's override of the other field does not carry over
    # (gdn_norm_eps follows the flat rms_norm_eps, not a layer's block-norm epsilon).
    per_layer_default_from: bool = False

    @property
    def annotation(self) -> str:
        base = _ANNOTATIONS.get(self.kind, "Any")
        return base if self.default is not None or base.endswith("| None") else f"{base} | None"

    def problems(self, name: str) -> list[str]:
        """What is wrong with this declaration (empty when sound)."""
        problems = []
        if self.kind not in FIELD_KINDS:
            problems.append(f"its kind {self.kind!r} must be one of {FIELD_KINDS}")
        if not isinstance(self.default, _IMMUTABLE_DEFAULTS):
            problems.append(f"its default must be None, a bool, int, float or str, got {type(self.default).__name__}")
        if not isinstance(self.doc, str) or not self.doc.strip() or "\n" in self.doc:
            problems.append("its doc must be one non-empty line")
        if self.default_from is not None and self.default is not None:
            problems.append("a field with default_from must default to None (resolved from that field)")
        if self.per_layer_default_from and self.default_from is None:
            problems.append("per_layer_default_from needs default_from (the field whose layer overrides it follows)")
        return [f"field {name!r}: {problem}" for problem in problems]


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """What every registered component declares; `MixerSpec` and `MlpSpec` add what is their own."""

    fields: dict[str, ConfigField]  # the config fields it reads (each may vary per layer)
    module_class: type  # built as module_class(config, layer_idx); reads config.per_layer_config[layer_idx]
    parameter_count: Callable[[Any], int]  # its weights for a layer's settings (bounds sizes before torch)
    title: str = ""  # its name for people ("Gated DeltaNet"), in model cards; empty: its registered name
    relation_problems: Callable[[Any, str], list[str]] = lambda settings, prefix: []  # checks between its fields
    # the initialisation of the parameters it holds directly (A_log, dt_bias); its submodules (Linear, norms,
    # convolutions) get the model's generic initialisation
    init_weights: Callable[[Any], None] | None = None
    tensor_parallel_plan: dict[str, str] = field(default_factory=dict)  # submodule -> transformers TP style
    lora_targets: tuple[str, ...] = ()  # its projections that LoRA adapts
    # a short description of one layer's component for the model card ("16 value heads of 64"), from its settings
    describe: Callable[[Any], str] = lambda settings: ""


class Registry(dict):
    """name -> spec of one kind of component; `selector` is the config field whose entries pick one per layer."""

    def __init__(self, selector: str):
        super().__init__()
        self.selector = selector
        REGISTRIES.append(self)


REGISTRIES: list[Registry] = []
_LISTENERS: list[Callable[[], None]] = []


def all_specs() -> list[ComponentSpec]:
    """Every registered component, mixers first."""
    return [spec for registry in REGISTRIES for spec in registry.values()]


def declared_fields() -> dict[str, ConfigField]:
    """Every field the registered components declare, in registration order (each name once)."""
    return {name: declared for spec in all_specs() for name, declared in spec.fields.items()}


def declarations_of(name: str) -> list[tuple[Registry, str]]:
    """(registry, component name) of every component that declares the field `name`."""
    return [(registry, key) for registry in REGISTRIES for key, spec in registry.items() if name in spec.fields]


def on_change(listener: Callable[[], None]) -> None:
    """Calls `listener` after every registration and removal (the config syncs its fields); a listener that raises
    undoes the registration."""
    _LISTENERS.append(listener)


def add_spec(registry: Registry, name: str, spec: ComponentSpec) -> None:
    """Adds `spec` as `name` after checking its field declarations, alone and against every other registered one."""
    problems = [problem for field_name, declared in spec.fields.items() for problem in declared.problems(field_name)]
    known = declared_fields()
    for field_name, declared in spec.fields.items():
        if field_name in known and known[field_name] != declared:
            owners = ", ".join(f"{registry_.selector} {key!r}" for registry_, key in declarations_of(field_name))
            problems.append(f"field {field_name!r} is declared differently by {owners}: declare it once and share the "
                            "declaration")
    if problems:
        raise ValueError(f"{type(spec).__name__} of {name!r}: " + "; ".join(problems) + ".")
    previous = registry.get(name)
    registry[name] = spec
    try:
        _notify()
    except Exception:
        if previous is None:
            del registry[name]
        else:
            registry[name] = previous
        _notify()
        raise


def remove_spec(registry: Registry, name: str) -> ComponentSpec:
    """Takes the component `name` out (its fields leave the config unless another component declares them)."""
    spec = registry.pop(name)
    _notify()
    return spec


def _notify() -> None:
    for listener in _LISTENERS:
        listener()


def plan_of(registry: Registry, attribute_of: Callable[[Any], str]) -> dict[str, str]:
    """The plan entries of every component of `registry` under the decoder layers ("layers.*.mlp.gate_proj")."""
    return {f"layers.*.{attribute_of(spec)}.{name}": style
            for spec in registry.values() for name, style in spec.tensor_parallel_plan.items()}


def lora_targets_of(registry: Registry) -> tuple[str, ...]:
    """The projection names LoRA adapts in every component of `registry`."""
    return tuple(dict.fromkeys(name for spec in registry.values() for name in spec.lora_targets))


__all__ = ["FIELD_KINDS", "REGISTRIES", "ComponentSpec", "ConfigField", "Registry", "add_spec", "all_specs",
           "declarations_of", "declared_fields", "lora_targets_of", "on_change", "plan_of", "remove_spec"]

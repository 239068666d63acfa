"""The registry of MLPs: one record per `mlp_types` entry, declared by the MLP's own module, as `mixer_registry` is
for token mixers (the shared parts, `ConfigField` and `ComponentSpec`, are in `component_registry`).

Each decoder layer's MLP is a per-layer choice, `config.mlp_types[i]` (default: every layer "dense", the gated MLP of
`mlp_dense`). The configuration (its fields with their defaults and docs, which fields a layer of that MLP reads, their
checks, the weight-count bound), the decoder layer (which module it builds as `self.mlp`, so checkpoints name its
tensors `mlp.*`), the weight initialisation, the tensor- and expert-parallel plans (entries under "layers.*.mlp."),
LoRA and the model card read this registry. The one line that registers a new MLP module is its import in
`registered_components` (a relative `from .module import Name` import, so a saved model folder ships the module with
its remote code); this registry imports none of its MLPs, which import it. Each MLP declares transformers' word for it (`mlp_layer_type`: "dense" or "sparse",
`configuration_utils.ALLOWED_MLP_LAYER_TYPES`), which the config writes in `mlp_layer_types` beside `mlp_types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .component_registry import ComponentSpec, ConfigField, Registry, add_spec, lora_targets_of, plan_of, remove_spec

MLP_ATTRIBUTE = "mlp"  # the decoder layer's attribute holding its MLP (checkpoint names: "model.layers.{i}.mlp.*")


@dataclass(frozen=True, kw_only=True)
class MlpSpec(ComponentSpec):
    """Everything the rest of the package needs to know about one MLP type. Its module is called (x) -> y, x and y
    [batch, tokens, hidden_size]."""

    mlp_type: str  # the `mlp_types` entry
    mlp_layer_type: str = "dense"  # transformers' word for it (the `mlp_layer_types` entry): "sparse" with experts
    # submodule -> transformers expert-parallel style (`DistributedConfig(ep_size=...)`): for MLPs with experts
    expert_parallel_plan: dict[str, str] = field(default_factory=dict)


MLPS: Registry = Registry("mlp_types")


def register(spec: MlpSpec) -> MlpSpec:
    """Adds the MLP of `spec.mlp_type` (its fields join the config)."""
    from transformers.configuration_utils import ALLOWED_MLP_LAYER_TYPES

    if spec.mlp_layer_type not in ALLOWED_MLP_LAYER_TYPES:
        raise ValueError(f"MlpSpec of {spec.mlp_type!r}: mlp_layer_type must be one of transformers' "
                         f"{ALLOWED_MLP_LAYER_TYPES}, got {spec.mlp_layer_type!r}.")
    add_spec(MLPS, spec.mlp_type, spec)
    return spec


def unregister(mlp_type: str) -> MlpSpec:
    """Undoes `register` (its fields leave the config): for tests and plugins."""
    return remove_spec(MLPS, mlp_type)


def default_mlp(mlp_layer_type: str) -> str | None:
    """The MLP a layer of transformers' `mlp_layer_type` runs when the config names none: the first registered for
    it ("dense": the gated MLP; "sparse": the sparse MoE, as in Qwen3-Next); None if no MLP is."""
    return next((name for name, spec in MLPS.items() if spec.mlp_layer_type == mlp_layer_type), None)


def mlp_types() -> tuple[str, ...]:
    """The registered MLP types, in registration order."""
    return tuple(MLPS)


def tensor_parallel_plan() -> dict[str, str]:
    """Every MLP's plan entries under the decoder layers ("layers.*.mlp.gate_proj": "colwise", ...)."""
    return plan_of(MLPS, lambda spec: MLP_ATTRIBUTE)


def expert_parallel_plan() -> dict[str, str]:
    """Every MLP's expert-parallel entries under the decoder layers ("layers.*.mlp.experts": "ep_dispatch_experts",
    ...): transformers applies them when `ep_size > 1`, in place of the tensor-parallel entries of those modules."""
    return {f"layers.*.{MLP_ATTRIBUTE}.{name}": style
            for spec in MLPS.values() for name, style in spec.expert_parallel_plan.items()}


def lora_targets() -> tuple[str, ...]:
    """The projection names LoRA adapts in every MLP."""
    return lora_targets_of(MLPS)


__all__ = ["MLPS", "MLP_ATTRIBUTE", "ConfigField", "MlpSpec", "default_mlp", "expert_parallel_plan", "lora_targets",
           "mlp_types",
           "register", "tensor_parallel_plan", "unregister"]

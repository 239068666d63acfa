"""What LoRA adapts in a model of this family, for peft's `LoraConfig`:

    from peft import LoraConfig, get_peft_model
    from hybrid_linear_models import lora_target_modules, lora_target_parameters

    config = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                        target_modules=lora_target_modules(model.config),
                        target_parameters=lora_target_parameters(model.config))
    model = get_peft_model(model, config)

`target_modules`: the linear projections of the mixers and MLPs the config's layers use, as their registrations name
them (`lora_targets` of each mixer and MLP spec), so a new component is adapted with no edit here.
`target_parameters`: the routed experts' stacked weights, (E, out, in) parameters that no `nn.Linear` holds, which
peft adapts one rank-r update per expert. Both are read off the model the config builds (on the meta device: no
memory, no initialisation), so they name exactly what exists: a dense model has no target parameters, and peft is
never handed a name it cannot match (it refuses a `target_parameters` entry that matches nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_hybrid_linear import HybridLinearConfig
from .mixer_registry import MIXERS
from .mlp_registry import MLPS


def _skeleton(config: HybridLinearConfig) -> nn.Module:
    """The decoder stack `config` builds, on the meta device."""
    from .modeling_hybrid_linear import HybridLinearModel

    with torch.device("meta"):
        return HybridLinearModel(config)


def _component_classes() -> tuple[type, ...]:
    return tuple(spec.module_class for registry in (MIXERS, MLPS) for spec in registry.values())


def lora_target_modules(config: HybridLinearConfig) -> list[str]:
    """The projection names (`target_modules`) LoRA adapts in the mixers and MLPs `config` uses."""
    wanted = {name for registry in (MIXERS, MLPS) for spec in registry.values() for name in spec.lora_targets}
    classes = _component_classes()
    present: dict[str, None] = {}
    for component in _skeleton(config).modules():
        if isinstance(component, classes):
            for name, module in component.named_modules():
                leaf = name.rpartition(".")[2]
                if leaf in wanted and isinstance(module, nn.Linear):
                    present[leaf] = None
    return list(present)


def lora_target_parameters(config: HybridLinearConfig) -> list[str]:
    """The routed experts' stacked (3-D) weights in the MLPs `config` uses, as `module.parameter` names for
    `target_parameters` ("experts.gate_up_proj", "experts.down_proj"); [] for a model without experts."""
    mlp_classes = tuple(spec.module_class for spec in MLPS.values())
    present: dict[str, None] = {}
    for component in _skeleton(config).modules():
        if isinstance(component, mlp_classes):
            for module_name, module in component.named_modules():
                for name, parameter in module.named_parameters(recurse=False):
                    if parameter.ndim == 3 and module_name:
                        present[f"{module_name.rpartition('.')[2]}.{name}"] = None
    return list(present)


__all__ = ["lora_target_modules", "lora_target_parameters"]

"""Fast-LLM's MLPs, one record each (`FastLlmMlp`), registered in one table keyed by Fast-LLM's `mlp.type`: the same
mechanism as the mixers' (`mixers.py`) for the other half of a block.

A record holds the MLP type of ours it stands for (a `mlp_types` entry), its config reader (Fast-LLM's `mlp` config
-> our per-layer fields, refusing what our MLP cannot express, naming the field) and writer, what of our settings
Fast-LLM cannot express, its parameter table, the Fast-LLM key of each field (for messages) and how its fields choose
their defaults. Adding a Fast-LLM MLP is one module `mlp_<name>.py` ending in `register(FastLlmMlp(...))` and its
import at the bottom of this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...configuration_hybrid_linear import DEFAULT_MLP_TYPE, HybridLinearConfig
from .metadata_fields import MetadataFields
from .parameter_spec import Parameter

# Fast-LLM's MLP activations and the transformers (ACT2FN) names of the same functions (Fast-LLM's own HF export
# table: its gelu is the tanh approximation).
ACTIVATION_TO_HF = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "relu": "relu", "squared_relu": "relu2"}
ACTIVATION_FROM_HF = {hf: fast_llm for fast_llm, hf in ACTIVATION_TO_HF.items()}
DENSE = DEFAULT_MLP_TYPE  # our `mlp_types` entry of the gated MLP ("dense")


def _nothing(layer: HybridLinearConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class FastLlmMlp:
    """One Fast-LLM MLP type and the MLP type of ours it stands for."""

    type_name: str  # Fast-LLM's `mlp.type`
    mlp_type: str  # our `mlp_types` entry
    description: str  # in messages ("gated MLP")
    read: Callable[[MetadataFields], dict[str, Any]]  # Fast-LLM's mlp config -> our per-layer fields; `finish`es it
    write: Callable[[HybridLinearConfig], dict[str, Any]]  # a layer's resolved config -> Fast-LLM's mlp config
    parameters: tuple[Parameter, ...]  # under `decoder.{i}.`, in Fast-LLM's definition order
    field_sources: Mapping[str, str]  # each of our fields its reader sets -> its Fast-LLM key under the block
    unsupported: Callable[[HybridLinearConfig], list[str]] = _nothing  # what Fast-LLM's MLP cannot express
    # fields whose default is chosen alone; the others take theirs together, from one layer (see mixers.py)
    checked_alone: tuple[str, ...] = ()

    def field_group(self, name: str) -> str:
        return name if name in self.checked_alone else self.type_name


FAST_LLM_MLPS: dict[str, FastLlmMlp] = {}  # Fast-LLM's mlp type -> its record


def register(mlp: FastLlmMlp) -> FastLlmMlp:
    if mlp.type_name in FAST_LLM_MLPS or any(m.mlp_type == mlp.mlp_type for m in FAST_LLM_MLPS.values()):
        raise ValueError(f"Fast-LLM MLP {mlp.type_name!r} ({mlp.mlp_type!r}) is registered twice")
    FAST_LLM_MLPS[mlp.type_name] = mlp
    return mlp


def our_mlp_type(config: HybridLinearConfig, index: int) -> str:
    """Layer `index`'s MLP type (its `mlp_types` entry)."""
    return config.mlp_types[index]


def mlp_of_type(mlp_type: str) -> FastLlmMlp | None:
    """The Fast-LLM MLP our `mlp_type` is written as (None: Fast-LLM has none)."""
    return next((mlp for mlp in FAST_LLM_MLPS.values() if mlp.mlp_type == mlp_type), None)


__all__ = ["ACTIVATION_TO_HF", "ACTIVATION_FROM_HF", "DENSE", "FastLlmMlp", "FAST_LLM_MLPS", "register",
           "our_mlp_type", "mlp_of_type"]

# The registrations: one import per Fast-LLM MLP module.
from . import mlp_dense, mlp_moe  # noqa: E402, F401

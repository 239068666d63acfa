"""Fast-LLM's dense MLP (`mlp.type: mlp`, fast_llm/layers/decoder/mlp/mlp.py) <-> our gated MLP ("dense").

Fast-LLM's MLP: `layer_1` (gate and up stacked on dim 0 when `gated`), the activation, `layer_2` stored TRANSPOSED
(intermediate, hidden); biases from each layer's `bias.enabled`, else `add_linear_biases` (default true). Ours is
always gated, with one `mlp_bias` switch for the three projections, so a non-gated MLP and layers that disagree on
their bias are refused.
"""

from __future__ import annotations

from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, SPLIT_HALVES, TRANSPOSE
from ..untrusted import brief
from .metadata_fields import MetadataFields, shared_bias
from .mlps import ACTIVATION_FROM_HF, ACTIVATION_TO_HF, DENSE, FastLlmMlp, register
from .parameter_spec import ALWAYS, NEVER, Parameter, Rule, bias


def read(mlp: MetadataFields) -> dict[str, Any]:
    mlp.expect("gated", (True,), False, "a non-gated MLP")
    activation = mlp.name("activation", tuple(ACTIVATION_TO_HF), "silu")
    fields = {"intermediate_size": mlp.size("intermediate_size"), "hidden_act": ACTIVATION_TO_HF[activation],
              "mlp_bias": shared_bias(mlp, ("layer_1", "layer_2"), "mlp_bias")}
    mlp.finish(frozenset({"type"}))
    return fields


def write(layer: HybridLinearConfig) -> dict[str, Any]:
    return {"type": "mlp", "intermediate_size": layer.intermediate_size, "gated": True,
            "activation": ACTIVATION_FROM_HF[layer.hidden_act], "add_linear_biases": bool(layer.mlp_bias)}


def unsupported(layer: HybridLinearConfig) -> list[str]:
    if layer.hidden_act not in ACTIVATION_FROM_HF:
        return [f"hidden_act={brief(layer.hidden_act)} (Fast-LLM's gated MLP takes {', '.join(ACTIVATION_FROM_HF)})"]
    return []


# Biases: tensor-parallel for layer_1 (its output, the intermediate dimension, is split), not for layer_2 (its
# output is the hidden size).
_BIAS: Rule = lambda config: bool(config.mlp_bias)  # noqa: E731
PARAMETERS = (
    Parameter("mlp.layer_1.weight", SPLIT_HALVES, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # gate, up rows
    bias("mlp.layer_1.bias", SPLIT_HALVES, ("mlp.gate_proj.bias", "mlp.up_proj.bias"), ALWAYS, _BIAS),
    Parameter("mlp.layer_2.weight", TRANSPOSE, "mlp.down_proj.weight"),  # stored (intermediate, hidden)
    bias("mlp.layer_2.bias", IDENTITY, "mlp.down_proj.bias", NEVER, _BIAS),
)

DENSE_MLP = register(FastLlmMlp(
    type_name="mlp",
    mlp_type=DENSE,
    description="gated MLP",
    read=read,
    write=write,
    parameters=PARAMETERS,
    field_sources={"intermediate_size": "mlp.intermediate_size", "hidden_act": "mlp.activation",
                   "mlp_bias": "mlp.add_linear_biases"},
    unsupported=unsupported,
    checked_alone=("intermediate_size", "hidden_act", "mlp_bias"),
))

__all__ = ["DENSE_MLP", "PARAMETERS"]

"""Fast-LLM's mixture-of-experts MLP (`mlp.type: moe`) <-> our Qwen3-Next sparse MoE MLP (`mlp_types` entry
"sparse_moe"): what is equal, what is refused, and the weight layout.

Fast-LLM's math (fast_llm/layers/decoder/mlp/mixture_of_experts.py, MixtureOfExpertMLP with `routing: aux_loss`, the
default "topk" routing), for a token x (the pre-MLP normed hidden state, width H), E = `experts`, k =
`experts_per_token`, I = `intermediate_size`:

    logits = W_router x                                         `router.weight` (E, H); no bias (a LinearConfig)
    (l, e) = top-k of logits                                    torch.topk on the logits
    w      = softmax(l) in float32                              over the k selected logits only
    y      = sum_j w_j * W2_e_j^T act(W1g_e_j x) * (W1u_e_j x)   gated experts, no biases (asserted by Fast-LLM)

Ours (Qwen3-Next's Qwen3NextSparseMoeBlock): p = softmax(logits) in float32 over all E, top-k of p, divided by their
sum when `norm_topk_prob`. Since softmax is monotonic the same experts are chosen, and softmax over the k selected
logits is p_j / sum_k p: Fast-LLM's top-k routing IS ours with norm_topk_prob=True (k = 1 included: a weight of 1),
up to float32 rounding (and ties between equal logits, which both break by index through torch.topk). Both cast
the weights to the hidden dtype before multiplying the expert outputs.

Settings that equal ours, and the fields they map to:
- `experts` -> num_experts; `experts_per_token` -> num_experts_per_tok; `intermediate_size` -> moe_intermediate_size;
  `activation` -> hidden_act (the dense MLP's table); norm_topk_prob = True; shared_expert_intermediate_size = 0.
- training-only: `auxiliary_loss_coefficient` (the load-balancing loss), `z_loss_coefficient`, `jitter_eps` (noise
  on the logits in training only), `implementation` (dropless/looped kernels), `dropless_dynamic_shape`,
  `recompute_level`, initialisation and learning-rate scales.

Settings refused (each names the block and the field):
- `shared_experts` > 0: Fast-LLM's shared experts are the last `shared_experts` of the stacked experts, appended to
  every token's routing with weight 1 (ungated, of the routed experts' width). Our shared expert (Qwen3-Next's) is
  multiplied by sigmoid(shared_expert_gate x), which is never 1, so no weights of ours reproduce them.
- `routing: sinkhorn` (Sinkhorn-balanced selection in training, sigmoid/softmax scores): not Qwen3-Next's routing.
- `gated: false` (our experts are gated), `add_linear_biases` not false or a `layer_1`/`layer_2` bias (Fast-LLM's MoE
  asserts there is none; its default add_linear_biases is true, so a real MoE config says false explicitly).
- `router_normalization`, `router_scale.enabled`, `router_input_scale` != 1, `router_per_expert_scale.enabled`,
  `pre_norm`, `post_norm`: extra norms and scales on the router or the experts that Qwen3-Next does not have.
- `type: hybrid_moe` (a dense MLP summed with routed experts, ungated): an unknown MLP type.
Writing to Fast-LLM refuses norm_topk_prob=False and a shared expert (shared_expert_intermediate_size > 0).

Weight layout (Fast-LLM's MLPBase/_get_intermediate_dims and its Mixtral converter, fast_llm/models/gpt/conversion/
mixtral.py): `layer_1.weight` is (E * 2I, H), expert-major, each expert's rows [gate (I) | up (I)] (the Mixtral
converter splits it into experts.{e}.w1, experts.{e}.w3 in that order); `layer_2.weight` is (E * I, H), each
expert's down projection stored transposed (TransposeSplitWeightConverter). Ours: `experts.gate_up_proj` (E, 2I, H),
gate rows first, and `experts.down_proj` (E, H, I). So layer_1 is gate_up_proj reshaped, and layer_2 is down_proj
transposed per expert then stacked: pure data movement, bit-exact both ways. `router.weight` is `gate.weight`.

The `distributed` format: the MLP's parameters in definition order are layer_1, layer_2 (created by MLPBase), then
the router (MixtureOfExpertMLP); layer_1 and layer_2 have weight decay and are tensor-parallel (their intermediate
dimension is split over heads as the dense MLP's is), the router has weight decay and is not tensor-parallel (its
output dimension, the experts, has no parallel dimension), so inside a block's stage it sorts before them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, Converter, Shape
from ..errors import ConversionError
from ..untrusted import brief
from .metadata_fields import MetadataFields
from .mlps import ACTIVATION_FROM_HF, ACTIVATION_TO_HF, FastLlmMlp, register
from .parameter_spec import NEVER, Parameter

MOE_TYPE = "moe"  # Fast-LLM's `mlp.type`
SPARSE_MOE = "sparse_moe"  # our `mlp_types` entry
_DEFAULTS = {"experts": 2, "experts_per_token": 1, "shared_experts": 0, "routing": "aux_loss"}  # MoEMLPConfig's


@dataclass(frozen=True)
class StackedExperts(Converter):
    """Fast-LLM's experts stacked along rows, (E * rows, H), <-> ours as a 3-D tensor: (E, rows, H) (`layer_1` <->
    `gate_up_proj`), or with each expert transposed, (E, H, rows) (`layer_2` <-> `down_proj`). Bound to the layer's
    number of experts."""

    transposed: bool
    experts: int = 0

    def bind(self, config: HybridLinearConfig) -> StackedExperts:
        return StackedExperts(self.transposed, config.num_experts)

    def forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        stacked = tensors[0]
        experts = stacked.reshape(self.experts, stacked.shape[0] // self.experts, stacked.shape[1])
        return [experts.transpose(1, 2).contiguous() if self.transposed else experts.contiguous()]

    def inverse(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        experts = tensors[0].transpose(1, 2) if self.transposed else tensors[0]
        return [experts.reshape(-1, experts.shape[2]).contiguous()]

    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        rows, hidden = shapes[0]
        if rows % self.experts:
            raise ConversionError(f"a stacked experts weight of shape {list(shapes[0])} does not split into "
                                  f"{self.experts} experts; the config does not match the weights.")
        per_expert = rows // self.experts
        return [(self.experts, hidden, per_expert) if self.transposed else (self.experts, per_expert, hidden)]

    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        experts, a, b = shapes[0]
        return [(experts * b, a) if self.transposed else (experts * a, b)]


# Fast-LLM's MoE parameters under `decoder.{i}.`, in definition order (see the module docstring for the flags).
PARAMETERS = (
    Parameter("mlp.layer_1.weight", StackedExperts(transposed=False), "mlp.experts.gate_up_proj"),
    Parameter("mlp.layer_2.weight", StackedExperts(transposed=True), "mlp.experts.down_proj"),
    Parameter("mlp.router.weight", IDENTITY, "mlp.gate.weight", tensor_parallel=NEVER),
)

# our per-layer fields -> the Fast-LLM key each comes from, under the block (for messages)
FIELD_SOURCES = {"num_experts": "mlp.experts", "num_experts_per_tok": "mlp.experts_per_token",
                 "moe_intermediate_size": "mlp.intermediate_size", "hidden_act": "mlp.activation",
                 "shared_expert_intermediate_size": "mlp.shared_experts", "norm_topk_prob": "mlp.routing"}


def _absent_or_disabled(mlp: MetadataFields, name: str, meaning: str) -> None:
    """An optional parameter (`router_scale`, ...): absent, or `enabled: false`."""
    parameter = mlp.sub(name)
    parameter.expect("enabled", (False, None), None, meaning)
    parameter.finish()


def read(mlp: MetadataFields) -> dict[str, Any]:
    """Fast-LLM's `moe` MLP config -> our per-layer fields of a "sparse_moe" layer."""
    mlp.expect("shared_experts", (0,), _DEFAULTS["shared_experts"],
               "Fast-LLM's shared experts are ungated, with weight 1; our shared expert is sigmoid-gated")
    mlp.expect("routing", ("aux_loss",), _DEFAULTS["routing"], "only top-k softmax routing equals ours; sinkhorn "
                                                                "does not")
    mlp.expect("gated", (True,), False, "experts without a gate")
    mlp.expect("add_linear_biases", (False,), True, "expert biases; Fast-LLM's MoE has none, so set it to false")
    for name in ("layer_1", "layer_2"):
        layer = mlp.sub(name)
        bias = layer.sub("bias")
        bias.expect("enabled", (False, None), None, "expert biases")
        bias.finish()
        layer.sub("weight").finish()
        layer.finish()
    router = mlp.sub("router")
    router.sub("weight").finish()
    router.finish()
    for name in ("router_normalization", "pre_norm", "post_norm"):
        mlp.expect(name, (None,), None, "a norm Qwen3-Next's sparse MoE does not have")
    mlp.expect("router_input_scale", (1.0,), 1.0, "a scaled router input")
    _absent_or_disabled(mlp, "router_scale", "a learned scale of the router input")
    _absent_or_disabled(mlp, "router_per_expert_scale", "a learned scale per expert")
    activation = mlp.name("activation", tuple(ACTIVATION_TO_HF), "silu")
    experts = mlp.size("experts", _DEFAULTS["experts"])
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": mlp.integer("experts_per_token", _DEFAULTS["experts_per_token"], minimum=1,
                                           maximum=experts, too_large=f"the {experts} experts"),
        "moe_intermediate_size": mlp.size("intermediate_size"),
        "shared_expert_intermediate_size": 0,
        "norm_topk_prob": True,
        "hidden_act": ACTIVATION_TO_HF[activation],
    }
    mlp.finish(frozenset({"type", "auxiliary_loss_coefficient", "z_loss_coefficient", "jitter_eps",
                          "dropless_dynamic_shape"}))
    return fields


def unsupported(layer: HybridLinearConfig) -> list[str]:
    """A sparse MoE layer's settings that Fast-LLM's MoE cannot express."""
    problems = [] if layer.hidden_act in ACTIVATION_FROM_HF else [
        f"hidden_act={brief(layer.hidden_act)} (Fast-LLM's experts take {', '.join(ACTIVATION_FROM_HF)})"]
    if not layer.norm_topk_prob:
        problems.append("norm_topk_prob=False (Fast-LLM normalises the top-k weights: a softmax over the selected "
                        "logits)")
    if layer.shared_expert_intermediate_size > 0:
        problems.append(f"shared_expert_intermediate_size={layer.shared_expert_intermediate_size} (Fast-LLM's "
                        "shared experts are ungated; ours is sigmoid-gated)")
    return problems


def write(layer: HybridLinearConfig) -> dict[str, Any]:
    """Fast-LLM's `moe` MLP config of a sparse MoE layer."""
    return {"type": MOE_TYPE, "experts": layer.num_experts, "experts_per_token": layer.num_experts_per_tok,
            "intermediate_size": layer.moe_intermediate_size, "gated": True,
            "activation": ACTIVATION_FROM_HF[layer.hidden_act], "add_linear_biases": False, "routing": "aux_loss"}


SPARSE_MOE_MLP = register(FastLlmMlp(
    type_name=MOE_TYPE,
    mlp_type=SPARSE_MOE,
    description="mixture of experts",
    read=read,
    write=write,
    parameters=PARAMETERS,
    field_sources=FIELD_SOURCES,
    unsupported=unsupported,
    checked_alone=("hidden_act",),  # the others are related (num_experts_per_tok <= num_experts): chosen together
))


__all__ = ["MOE_TYPE", "SPARSE_MOE", "StackedExperts", "PARAMETERS", "FIELD_SOURCES", "SPARSE_MOE_MLP", "read", "write",
           "unsupported"]

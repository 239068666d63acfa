"""The dense gated MLP ("dense" in `mlp_types`, every layer's default), as in Llama and Qwen3-Next's dense layers:

    y = down_proj(act(gate_proj(x)) * up_proj(x))

act is `hidden_act` (silu: SwiGLU, fused by fla on CUDA tensors). A decoding step (one token per row, no gradient), or a
speculative verify round's few rows (`fused_projections.stacks_projections`), runs gate_proj and up_proj as one GEMM,
with SwiGLU as `linear_swiglu` (in a captured step, one GEMV kernel that reads the stacked weight's rows in (gate, up)
pairs and stores their SwiGLU: `kernels_gemv`); FP8 layers (a released FP8 checkpoint's shared experts) at batch 1
run the stacked gate/up product, then a down projection that computes SwiGLU as it reads its input
(`FusedProjections.swiglu_down`). A long prompt without gradients runs a chunk of tokens at a time
(`token_chunks`: gate, up and their product, 3 x T x width values, are held for one chunk, not for the prompt). The
module (`GatedMLP`) is also the MoE blocks' shared experts (mlp_sparse_moe, mlp_kimi_moe), which so decode the same way.
Tensor names `mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj` (each Linear stores (out_features, in_features)), as every
checkpoint of this family has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from .block_ops import silu_and_mul
from .fused_projections import FusedProjections, stacks_projections
from .mlp_registry import ConfigField, MlpSpec, register
from .token_chunks import chunks_apply, token_chunked

if TYPE_CHECKING:
    from .configuration_hybrid_linear import HybridLinearConfig


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) of width `width`: the dense MLP, and the MoE blocks' shared experts. A decoding step
    (x of [batch, 1, hidden], no gradient) runs gate and up as one GEMM; silu runs as fla's fused SwiGLU on CUDA."""

    def __init__(self, hidden: int, width: int, hidden_act: str, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=bias)
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)
        self.act_fn = ACT2FN[hidden_act]
        self.swiglu = hidden_act == "silu"  # fused by fla on CUDA
        self._gate_up = FusedProjections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projections = (self.gate_proj, self.up_proj)
        if stacks_projections(x) and self._gate_up.applies(x, projections):  # a decoding step, or a few rows
            if self.swiglu:  # (gate and up have one width: `width`)
                fused = self._gate_up.swiglu_down(x, projections, self.down_proj)  # (FP8 layers)
                return fused if fused is not None else self.down_proj(self._gate_up.swiglu(x, projections))
            gate, up = self._gate_up(x, projections).split([self.gate_proj.out_features, self.up_proj.out_features], -1)
            return self.down_proj(silu_and_mul(gate, up) if self.swiglu else self.act_fn(gate) * up)
        if chunks_apply(x.numel() // x.shape[-1]):  # a long prompt without gradients: a chunk of tokens at a time
            return token_chunked(self._gated, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return self._gated(x)

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_and_mul(gate, up) if self.swiglu else self.act_fn(gate) * up)


class HybridLinearMLP(GatedMLP):
    """The dense layer's MLP: a GatedMLP of the layer's intermediate_size, hidden_act and mlp_bias."""

    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        settings = config.per_layer_config[layer_idx]  # this layer's settings
        super().__init__(settings.hidden_size, settings.intermediate_size, settings.hidden_act, settings.mlp_bias)


# ---------------------------------------------------------------------------------------------------- registration


def _parameter_count(s: Any) -> int:
    return 3 * s.hidden_size * s.intermediate_size


register(MlpSpec(
    mlp_type="dense", mlp_layer_type="dense", title="gated MLP",
    fields={
        "intermediate_size": ConfigField(kind="size", default=3072, doc="width of the gated MLP (dense layers)."),
        "hidden_act": ConfigField(
            kind="activation", default="silu",
            doc="activation of the gated MLP's gate (silu: SwiGLU; any transformers ACT2FN name)."),
        "mlp_bias": ConfigField(kind="bool", default=False, doc="biases in the gated MLP's projections."),
    },
    module_class=HybridLinearMLP, parameter_count=_parameter_count,
    tensor_parallel_plan={"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"},
    lora_targets=("gate_proj", "up_proj", "down_proj"),
    describe=lambda s: f"intermediate size {s.intermediate_size}",
))

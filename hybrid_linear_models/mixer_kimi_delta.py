"""Kimi Delta Attention mixer (Kimi Linear's layout and math): the delta rule with a per-channel decay.

    q, k, v = silu(conv(q_proj x)), silu(conv(k_proj x)), silu(conv(v_proj x))
    g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias)   (float32, one value per key channel)
    o = delta_rule(l2norm(q), l2norm(k), v, g, sigmoid(b_proj x));  out = o_proj(RMSNorm(o) * w * act(g_b(g_a(x))))

A_log and dt_bias are float32 whatever the model's dtype (`from_pretrained(..., dtype=torch.bfloat16)` included), as
transformers' Kimi-Linear keeps them (`_keep_in_fp32_modules_strict`) and the released checkpoints store them: they
set the decay, which the recurrence compounds over every token, and rounding them to bf16 would lose their stored
values.

act is sigmoid in Kimi Linear and silu in Fast-LLM: `kda_gate_activation`. fla's KDA gives g_b a bias
(`kda_gate_bias`): act(g_b(g_a(x)) + bias).

A decoding step (one token per row, no gradient) runs the six projections of x (q, k, v, f_a, g_a, b) as one GEMM
(`fused_projections`), whose first columns are the flat [q | k | v] the convolution reads (no concatenation; in a
captured step the GEMV kernel runs the convolution's step on them in its epilogue: `kernels_gemv.linear_conv_step`),
and beta's sigmoid runs inside the recurrent kernel. On CUDA a verify round's layer runs from the projections' output to
the rule's output in one kernel of this package, and its restore in another (`verify_delta_rule`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .cache_hybrid_linear import LinearStateLayer
from .derived_weights import DerivedWeight
from .fused_projections import FusedProjections, stacks_projections
from .mixer_linear import (
    DecayGate,
    convolve_and_recur,
    mask_padding,
    project_for_convolution,
)
from .mixer_registry import ConfigField, MixerSpec, register
from .norms import GatedRMSNorm
from .ops import kimi_delta_rule
from .sequence_info import SequenceInfo
from .short_convolution import ShortConvolution
from .tensor_parallel_heads import local_heads, sum_gradients_over_ranks
from .verify_delta_rule import delta_rule_round

if TYPE_CHECKING:
    from .configuration_hybrid_linear import HybridLinearConfig


class HybridLinearKimiDeltaAttention(nn.Module):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        config = config.per_layer_config[layer_idx]  # this layer's settings
        self.num_heads, self.head_dim = config.kda_num_heads, config.kda_head_dim
        P = self.num_heads * self.head_dim
        H, d, K = config.hidden_size, self.head_dim, config.kda_conv_kernel_size
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.q_conv1d = ShortConvolution(P, K)
        self.k_conv1d = ShortConvolution(P, K)
        self.v_conv1d = ShortConvolution(P, K)
        self.f_a_proj = nn.Linear(H, d, bias=False)
        self.f_b_proj = nn.Linear(d, P, bias=False)
        # the decay's parameters stay float32 in a bf16 model (module docstring)
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32).uniform_(1, 16).log_())
        self.b_proj = nn.Linear(H, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(H, d, bias=False)
        self.g_b_proj = nn.Linear(d, P, bias=config.kda_gate_bias)
        self.o_norm = GatedRMSNorm(d, config.kda_norm_eps, config.kda_gate_activation)
        self.o_proj = nn.Linear(P, H, bias=False)
        self._conv_weight = DerivedWeight()  # the three kernels side by side, as the flat [q | k | v] conv needs
        self._in_proj = FusedProjections()  # the projections of x, at decoding time

    def _input_projections(self, hidden_states: torch.Tensor, conv_weight: torch.Tensor, info: SequenceInfo,
                           cache: LinearStateLayer | None):
        """[q | k | v] (flat), f_a(x), g_a(x), b(x) and the conv weight for `convolve_and_recur`: one GEMM at
        decoding time and in a verify round (`stacks_projections`; None for the conv weight where the convolution ran
        with it: `project_for_convolution`), else one each."""
        linears = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj)
        if stacks_projections(hidden_states) and self._in_proj.applies(hidden_states, linears):
            mixed, rest, conv_weight = project_for_convolution(self._in_proj, hidden_states, linears, None,
                                                               conv_weight, info, cache)
            return mixed, *rest.split([m.out_features for m in linears[3:]], dim=-1), conv_weight
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        return (mixed, self.f_a_proj(hidden_states), self.g_a_proj(hidden_states), self.b_proj(hidden_states),
                conv_weight)

    def forward(self, hidden_states: torch.Tensor, info: SequenceInfo, cache: LinearStateLayer | None = None):
        hidden_states = mask_padding(hidden_states, info)
        B, T = hidden_states.shape[:2]
        # all of them unless tensor parallel
        heads = local_heads(self.q_proj, self.num_heads, self.layer_idx, "kda_num_heads")
        rows = heads.rows(self.head_dim)
        shape = (B, T, heads.count, self.head_dim)
        kernels = [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        conv_weight = self._conv_weight.get(kernels, lambda: torch.cat([w[rows] for w in kernels]), tag=rows)
        mixed, forget_a, gate_a, beta, conv_weight = self._input_projections(hidden_states, conv_weight, info, cache)
        forget = self.f_b_proj(forget_a).view(shape)
        gate = DecayGate(forget, self.A_log[heads.offset : heads.offset + heads.count], self.dt_bias[rows])
        decoding = T == 1  # beta's sigmoid then runs inside the recurrent kernel
        if not decoding:
            beta = beta.sigmoid()

        def split(x):  # x may be the packed [1, B * T, C]
            return tuple(part.unflatten(-1, (heads.count, self.head_dim)) for part in x.chunk(3, dim=-1))

        out = convolve_and_recur(mixed, conv_weight, split, gate, beta, kimi_delta_rule, info, cache,
                                 beta_logits=decoding, round_rule=None if heads.sharded else delta_rule_round)
        out = self.o_norm(out, self.g_b_proj(gate_a).view(shape))
        sum_gradients_over_ranks(
            self, [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.dt_bias, self.A_log,
                   self.o_norm.weight], self.q_proj)
        return self.o_proj(out.reshape(B, T, -1))


# ---------------------------------------------------------------------------------------------------- registration


def _parameter_count(s: Any) -> int:
    inner = s.kda_num_heads * s.kda_head_dim
    return s.hidden_size * 5 * inner + inner * s.hidden_size + 3 * inner * s.kda_conv_kernel_size


def _init_weights(module: HybridLinearKimiDeltaAttention) -> None:
    from transformers import initialization as init

    init.copy_(module.A_log, torch.empty_like(module.A_log, dtype=torch.float32).uniform_(1, 16).log_())
    # dt in [1e-3, 1e-1] log-uniformly, stored as softplus^-1(dt) (as fla initialises KDA)
    dt = torch.empty_like(module.dt_bias, dtype=torch.float32).uniform_(-6.907755, -2.302585).exp_()
    init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))


register(MixerSpec(
    mixer_type="kimi_delta_attention", layer_type="linear_attention", title="Kimi Delta Attention",
    fields={
        "kda_num_heads": ConfigField(kind="size", default=16, doc="Kimi Delta Attention heads."),
        "kda_head_dim": ConfigField(kind="size", default=64, doc="width of each Kimi Delta Attention head."),
        "kda_conv_kernel_size": ConfigField(kind="size", default=4,
                                            doc="width of Kimi Delta Attention's depthwise causal convolutions."),
        "kda_gate_activation": ConfigField(
            kind="gate_activation", default="sigmoid",
            doc="activation of Kimi Delta Attention's output gate, 'sigmoid' (Kimi Linear) or 'silu' (Fast-LLM)."),
        "kda_norm_eps": ConfigField(kind="epsilon", default=None, default_from="rms_norm_eps",
                                    doc="epsilon of Kimi Delta Attention's gated RMSNorm."),
        "kda_gate_bias": ConfigField(kind="bool", default=False,
                                     doc="a bias in the output-gate projection g_b_proj (fla's g_proj.1 has one; Kimi "
                                         "Linear's and Fast-LLM's have none)."),
    },
    module_class=HybridLinearKimiDeltaAttention, attribute="linear_attn", state="recurrent",
    parameter_count=_parameter_count, init_weights=_init_weights,
    tensor_parallel_plan={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "f_b_proj": "colwise",
                          "g_b_proj": "colwise", "b_proj": "colwise", "o_proj": "rowwise"},
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj"),
    describe=lambda s: f"{s.kda_num_heads} heads of {s.kda_head_dim}",
))

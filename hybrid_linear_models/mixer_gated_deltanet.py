"""Gated DeltaNet mixer, Qwen3-Next's layout and math.

    q, k, v = silu(conv([q | k | v]));  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)  (float32)
    o = delta_rule(l2norm(q), l2norm(k), v, g, beta);  out = out_proj(RMSNorm(o) * w * act(z))

A_log and dt_bias are float32 whatever the model's dtype (`from_pretrained(..., dtype=torch.bfloat16)` included), as the
KDA mixer's (and transformers' Kimi-Linear's) are: they set the decay, which the recurrence compounds over every
token, and a checkpoint that stores them in float32 keeps their values (a bf16 one loads exactly too).

`in_proj_qkvz` and `in_proj_ba` are grouped by key head (rows [q_h | k_h | v_h | z_h] and [b_h | a_h] for each key
head h, whose r = Hv / Hk value heads are contiguous), so a row shard holds whole heads: under tensor parallelism a
rank computes a block of key heads with their value heads (see `tensor_parallel_heads`).

A decoding step (one token per row, no gradient) and a speculative verify round (a few tokens per row:
`fused_projections.stacks_projections`) run both projections as one GEMM (`fused_projections`) whose outputs are
taken in the flat order [q | k | v | z | b | a] the convolution, the gated norm and the delta rule read as slices
(the grouped split would need a copy for z and for a): a gather after the GEMM, or none in a captured step or round,
whose GEMV kernel reads the weight rows in that order (`kernels_gemv.linear_rows`); a step's GEMV also runs the
convolution's step on the [q | k | v] outputs in its epilogue (`kernels_gemv.linear_conv_step`). In the released FP8
layout (in_proj_qkvz FP8, in_proj_ba bf16: they cannot stack) each runs as one launch in that flat order, the FP8
product reading its weight rows through a row index (`kernels_fp8.RowIndex`), in_proj_ba through
`kernels_gemv.linear_rows`; the convolution then runs on its own. beta's sigmoid runs inside the recurrent kernel. On
CUDA a verify round's layer runs from the projection's output to the rule's output in one kernel of this package,
and its restore in another (`verify_delta_rule`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .cache_hybrid_linear import LinearStateLayer
from .fused_projections import FusedProjections, is_plain_linear, stacks_projections
from .kernels_fp8 import RowIndex, fp8_row_index
from .kernels_gemv import linear_rows
from .mixer_linear import (
    DecayGate,
    convolve_and_recur,
    mask_padding,
    project_for_convolution,
)
from .mixer_registry import ConfigField, MixerSpec, register
from .norms import GatedRMSNorm
from .ops import gated_delta_rule
from .sequence_info import SequenceInfo
from .short_convolution import ShortConvolution
from .tensor_parallel_heads import LocalHeads, local_heads, sum_gradients_over_ranks
from .verify_delta_rule import delta_rule_round

if TYPE_CHECKING:
    from .configuration_hybrid_linear import HybridLinearConfig

# where an FP8 in_proj_qkvz's decoding step takes its outputs in the flat order (`_fp8_projections`; emptied: the
# unstacked path, as benchmarks/profile_decode_step.py --ab compares)
FLAT_FP8_PROJECTION_DEVICE_TYPES = ("cuda", "cpu")


class HybridLinearGatedDeltaNet(nn.Module):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        config = config.per_layer_config[layer_idx]  # this layer's settings
        self.num_k_heads, self.num_v_heads = config.gdn_num_key_heads, config.gdn_num_value_heads
        self.head_k_dim, self.head_v_dim = config.gdn_key_head_dim, config.gdn_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.values_per_key = self.num_v_heads // self.num_k_heads
        H = config.hidden_size
        self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * self.num_v_heads, bias=False)
        self.conv1d = ShortConvolution(2 * self.key_dim + self.value_dim, config.gdn_conv_kernel_size)
        # the decay's parameters stay float32 in a bf16 model (module docstring)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(self.head_v_dim, config.gdn_norm_eps, config.gdn_gate_activation)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self._channel_index: dict = {}
        self._in_proj = FusedProjections()  # in_proj_qkvz and in_proj_ba, at decoding time

    def _conv_weight(self, heads: LocalHeads) -> torch.Tensor:
        """Kernels of this rank's channels of the flat [Q | K | V] convolution."""
        weight = self.conv1d.weight
        if not heads.sharded:
            return weight
        q, k, v = weight.split([self.key_dim, self.key_dim, self.value_dim])
        rows_k, rows_v = heads.rows(self.head_k_dim), heads.rows(self.values_per_key * self.head_v_dim)
        return torch.cat([q[rows_k], k[rows_k], v[rows_v]])

    def _flat_qkv_channels(self, nk: int, device: torch.device) -> torch.Tensor:
        """Where the flat [Q | K | V] channels sit in in_proj_qkvz's output, grouped by key head."""
        key = (nk, device)
        if key not in self._channel_index:
            dk, rdv = self.head_k_dim, self.values_per_key * self.head_v_dim
            group = torch.arange(nk, device=device)[:, None] * (2 * dk + 2 * rdv)
            parts = [group + torch.arange(start, start + width, device=device)
                     for start, width in ((0, dk), (dk, dk), (2 * dk, rdv))]
            self._channel_index[key] = torch.cat([p.reshape(-1) for p in parts])
        return self._channel_index[key]

    def _flat_decoding_channels(self, device: torch.device) -> torch.Tensor:
        """Where [q | k | v | z | b | a] (each flat over its heads) sit in the output of the stacked
        [in_proj_qkvz; in_proj_ba] (all heads: the stacked GEMM runs without tensor parallelism)."""
        key = ("decoding", device)
        if key not in self._channel_index:
            nk, dk, r = self.num_k_heads, self.head_k_dim, self.values_per_key
            rdv = r * self.head_v_dim
            heads = torch.arange(nk, device=device)[:, None]
            qkvz, ba = heads * (2 * dk + 2 * rdv), self.in_proj_qkvz.out_features + heads * 2 * r
            parts = [base + torch.arange(start, start + width, device=device)
                     for base, start, width in ((qkvz, 0, dk), (qkvz, dk, dk), (qkvz, 2 * dk, rdv),
                                                (qkvz, 2 * dk + rdv, rdv), (ba, 0, r), (ba, r, r))]
            self._channel_index[key] = torch.cat([p.reshape(-1) for p in parts])
        return self._channel_index[key]

    def _fp8_decoding_rows(self, device: torch.device) -> tuple[RowIndex, torch.Tensor] | None:
        """For an FP8 in_proj_qkvz beside a plain in_proj_ba: the rows of each that give [q | k | v | z] and [b | a]
        (`_flat_decoding_channels` cut in two), the first as the FP8 kernel's row index; None where the heads do not
        keep the weight's blocks whole (the index not block-aligned: the kernel would scale per element)."""
        key = ("fp8", device)
        if key not in self._channel_index:
            flat = self._flat_decoding_channels(torch.device("cpu"))
            qkvz = self.in_proj_qkvz.out_features
            index = fp8_row_index(flat[flat < qkvz], self.in_proj_qkvz.block[0], device)
            self._channel_index[key] = (index, (flat[flat >= qkvz] - qkvz).to(device)) if index.aligned else None
        return self._channel_index[key]

    def _fp8_projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """A decoding step's input projections where in_proj_qkvz is FP8 (it cannot stack with the bf16 in_proj_ba):
        two launches taking their outputs in the flat order, (mixed, z, b, a); None where that does not apply."""
        from .fp8_layers import Fp8Linear

        if (hidden_states.device.type not in FLAT_FP8_PROJECTION_DEVICE_TYPES
                or not isinstance(self.in_proj_qkvz, Fp8Linear) or not is_plain_linear(self.in_proj_ba)):
            return None
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        rows = self._fp8_decoding_rows(hidden_states.device)
        if rows is None:
            return None
        qkvz = self.in_proj_qkvz.rows(hidden_states, rows[0])
        ba = linear_rows(hidden_states, self.in_proj_ba.weight, self.in_proj_ba.bias, rows[1])
        return (*qkvz.split([self.conv1d.weight.shape[0], self.value_dim], dim=-1),
                *ba.split([self.num_v_heads] * 2, dim=-1))

    def _stacked_forward(self, hidden_states: torch.Tensor, info: SequenceInfo, cache: LinearStateLayer | None,
                         fp8_projections: tuple[torch.Tensor, ...] | None = None):
        """A decoding step or a verify round (no gradient, all heads): the same math as `forward`, with one GEMM
        (and a gather) for the input projections (see the module docstring), or, with an FP8 in_proj_qkvz, the
        flat outputs of `_fp8_projections`."""
        B, T = hidden_states.shape[:2]
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if fp8_projections is not None:
            (mixed, z, b, a), conv_weight = fp8_projections, self.conv1d.weight
        else:
            mixed, rest, conv_weight = project_for_convolution(
                self._in_proj, hidden_states, (self.in_proj_qkvz, self.in_proj_ba),
                self._flat_decoding_channels(hidden_states.device), self.conv1d.weight, info, cache)
            z, b, a = rest.split([self.value_dim, nv, nv], dim=-1)

        def split(x):
            q, k, v = x.split([nk * dk, nk * dk, nv * dv], dim=-1)
            return q.unflatten(-1, (nk, dk)), k.unflatten(-1, (nk, dk)), v.unflatten(-1, (nv, dv))

        gate = DecayGate(a, self.A_log, self.dt_bias)
        out = convolve_and_recur(mixed, conv_weight, split, gate, b, gated_delta_rule, info, cache,
                                 beta_logits=True, round_rule=delta_rule_round)  # sigmoid(b) in the rule's kernel
        out = self.norm(out, z.unflatten(-1, (nv, dv)))
        return self.out_proj(out.reshape(B, T, nv * dv))

    def forward(self, hidden_states: torch.Tensor, info: SequenceInfo, cache: LinearStateLayer | None = None):
        hidden_states = mask_padding(hidden_states, info)
        B, T = hidden_states.shape[:2]
        r, dk, dv = self.values_per_key, self.head_k_dim, self.head_v_dim
        # key heads (all of them unless tensor parallel)
        heads = local_heads(self.in_proj_qkvz, self.num_k_heads, self.layer_idx, "gdn_num_key_heads")
        linears = (self.in_proj_qkvz, self.in_proj_ba)
        if not heads.sharded and stacks_projections(hidden_states):
            if self._in_proj.applies(hidden_states, linears):
                return self._stacked_forward(hidden_states, info, cache)
            fp8_projections = self._fp8_projections(hidden_states)
            if fp8_projections is not None:
                return self._stacked_forward(hidden_states, info, cache, fp8_projections)
        nk, nv = heads.count, heads.count * r
        projected, ba = self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        q, k, v, z = projected.view(B, T, nk, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(B, T, nk, 2 * r).split([r, r], dim=-1)
        if torch.is_grad_enabled():
            mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        else:  # one gather instead of three copies and a cat (training keeps the cat: index_select's backward is slow)
            mixed = projected.index_select(-1, self._flat_qkv_channels(nk, projected.device))
        beta = b.sigmoid().reshape(B, T, nv)
        value_rows = heads.rows(r)
        gate = DecayGate(a.reshape(B, T, nv), self.A_log[value_rows], self.dt_bias[value_rows])

        def split(x):  # x may be the packed [1, B * T, C]
            q, k, v = x.split([nk * dk, nk * dk, nv * dv], dim=-1)
            return q.unflatten(-1, (nk, dk)), k.unflatten(-1, (nk, dk)), v.unflatten(-1, (nv, dv))

        out = convolve_and_recur(mixed, self._conv_weight(heads), split, gate, beta, gated_delta_rule, info, cache,
                                 round_rule=None if heads.sharded else delta_rule_round)
        out = self.norm(out, z.reshape(B, T, nv, dv))
        sum_gradients_over_ranks(self, [self.conv1d.weight, self.dt_bias, self.A_log, self.norm.weight],
                                 self.in_proj_qkvz)
        return self.out_proj(out.reshape(B, T, nv * dv))


# ---------------------------------------------------------------------------------------------------- registration


def _relation_problems(s: Any, p: str) -> list[str]:
    if s.gdn_num_value_heads % s.gdn_num_key_heads:
        return [f"{p}gdn_num_value_heads={s.gdn_num_value_heads} must be a multiple of "
                f"{p}gdn_num_key_heads={s.gdn_num_key_heads}"]
    return []


def _parameter_count(s: Any) -> int:
    keys = s.gdn_num_key_heads * s.gdn_key_head_dim
    values = s.gdn_num_value_heads * s.gdn_value_head_dim
    projections = s.hidden_size * (2 * keys + 2 * values + 2 * s.gdn_num_value_heads) + values * s.hidden_size
    return projections + (2 * keys + values) * s.gdn_conv_kernel_size


def _init_weights(module: HybridLinearGatedDeltaNet) -> None:
    from transformers import initialization as init

    init.ones_(module.dt_bias)
    # sampled in float32 (A in [0.01, 16]) then cast: log A stays finite in any dtype
    init.copy_(module.A_log, torch.empty_like(module.A_log, dtype=torch.float32).uniform_(0.01, 16).log_())


register(MixerSpec(
    mixer_type="gated_deltanet", layer_type="linear_attention", title="Gated DeltaNet",
    fields={
        "gdn_num_key_heads": ConfigField(kind="size", default=8, doc="Gated DeltaNet key heads."),
        "gdn_num_value_heads": ConfigField(
            kind="size", default=16,
            doc="Gated DeltaNet value heads, a multiple of the key heads (value head j reads key head j // (values / "
                "keys))."),
        "gdn_key_head_dim": ConfigField(kind="size", default=64, doc="width of each Gated DeltaNet key head."),
        "gdn_value_head_dim": ConfigField(kind="size", default=64, doc="width of each Gated DeltaNet value head."),
        "gdn_conv_kernel_size": ConfigField(
            kind="size", default=4, doc="width of Gated DeltaNet's depthwise causal convolution over [q | k | v]."),
        "gdn_gate_activation": ConfigField(
            kind="gate_activation", default="silu",
            doc="activation of the output gate of Gated DeltaNet's gated RMSNorm, 'silu' (Qwen3-Next, Fast-LLM) or "
                "'sigmoid'."),
        "gdn_norm_eps": ConfigField(kind="epsilon", default=None, default_from="rms_norm_eps",
                                    doc="epsilon of Gated DeltaNet's gated RMSNorm."),
    },
    module_class=HybridLinearGatedDeltaNet, attribute="linear_attn", state="recurrent",
    parameter_count=_parameter_count, relation_problems=_relation_problems, init_weights=_init_weights,
    # split by heads; conv kernel, dt_bias, A_log and norm weight replicated (see tensor_parallel_heads)
    tensor_parallel_plan={"in_proj_qkvz": "colwise", "in_proj_ba": "colwise", "out_proj": "rowwise"},
    lora_targets=("in_proj_qkvz", "in_proj_ba", "out_proj"),
    describe=lambda s: (f"{s.gdn_num_key_heads} key heads of {s.gdn_key_head_dim}, {s.gdn_num_value_heads} value "
                        f"heads of {s.gdn_value_head_dim}"),
))

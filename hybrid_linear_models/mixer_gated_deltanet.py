"""Gated DeltaNet mixer, Qwen3-Next's layout and math.

    q, k, v = silu(conv([q | k | v]));  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)  (float32)
    o = delta_rule(l2norm(q), l2norm(k), v, g, beta);  out = out_proj(RMSNorm(o) * w * act(z))

`in_proj_qkvz` and `in_proj_ba` are grouped by key head (rows [q_h | k_h | v_h | z_h] and [b_h | a_h] for each key
head h, whose r = Hv / Hk value heads are contiguous), so a row shard holds whole heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache_hybrid_linear import LinearStateLayer
from .configuration_hybrid_linear import HybridLinearConfig
from .mixer_linear import convolve_and_recur, mask_padding
from .norms import GatedRMSNorm
from .ops import compute_dtype, gated_delta_rule
from .sequence_info import SequenceInfo
from .short_convolution import ShortConvolution


class HybridLinearGatedDeltaNet(nn.Module):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.gdn_num_key_heads, config.gdn_num_value_heads
        self.head_k_dim, self.head_v_dim = config.gdn_key_head_dim, config.gdn_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.values_per_key = self.num_v_heads // self.num_k_heads
        H = config.hidden_size
        self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * self.num_v_heads, bias=False)
        self.conv1d = ShortConvolution(2 * self.key_dim + self.value_dim, config.gdn_conv_kernel_size)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(self.head_v_dim, config.gdn_norm_eps, config.gdn_gate_activation)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def _split_qkv(self, mixed: torch.Tensor):
        B, T = mixed.shape[:2]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_k_heads, self.head_k_dim), k.reshape(B, T, self.num_k_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def forward(self, hidden_states: torch.Tensor, info: SequenceInfo, cache: LinearStateLayer | None = None):
        hidden_states = mask_padding(hidden_states, info)
        B, T = hidden_states.shape[:2]
        r, dk, dv = self.values_per_key, self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(hidden_states).view(B, T, self.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(hidden_states).view(B, T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        beta = b.reshape(B, T, self.num_v_heads).sigmoid()
        dtype = compute_dtype(a)  # the decay in float32 at least: A_log.exp() would overflow in half precision
        g = -self.A_log.to(dtype).exp() * F.softplus(a.reshape(B, T, self.num_v_heads).to(dtype) + self.dt_bias.to(dtype))
        out = convolve_and_recur(mixed, self.conv1d.weight, self._split_qkv, g, beta, gated_delta_rule, info, cache)
        out = self.norm(out, z.reshape(B, T, self.num_v_heads, dv))
        return self.out_proj(out.reshape(B, T, self.value_dim))

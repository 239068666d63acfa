"""Softmax attention mixer: GQA, optional per-head q/k RMSNorm, partial rotary embedding, optional sigmoid output
gate (Qwen3-Next's gated attention), optional sliding window, through transformers' attention interface."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_hybrid_linear import HybridLinearConfig
from .norms import HybridLinearRMSNorm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotates the first cos.shape[-1] dims of q and k ([B, heads, T, hd]); the rest pass through (partial rotary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)

    return rotate(q), rotate(k)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, T, hd] -> [B, kv_heads * groups, T, hd], each kv head serving `groups` consecutive query heads."""
    if groups == 1:
        return x
    B, kv, T, hd = x.shape
    return x[:, :, None].expand(B, kv, groups, T, hd).reshape(B, kv * groups, T, hd)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)  # float32 at least, float64 stays float64
    weights = nn.functional.softmax(weights, dim=-1, dtype=softmax_dtype).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class HybridLinearAttention(nn.Module):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.output_gate = config.attention_output_gate
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        bias = config.attention_bias
        q_out = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.attention_qk_norm:
            self.q_norm = HybridLinearRMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norms)
            self.k_norm = HybridLinearRMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norms)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = hidden_states.shape[:2]
        # head counts follow from the projections' sizes, so a tensor-parallel shard runs its local heads
        query = self.q_proj(hidden_states).view(B, T, -1, self.head_dim * (2 if self.output_gate else 1))
        gate = None
        if self.output_gate:  # per head [query | gate]
            query, gate = query.chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        key = self.k_proj(hidden_states).view(B, T, -1, self.head_dim)
        value = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rotary(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        output = output.reshape(B, T, -1)
        if gate is not None:
            output = output * torch.sigmoid(gate)
        return self.o_proj(output), weights

"""Softmax attention mixer: GQA, optional per-head q/k RMSNorm, partial rotary embedding, optional sigmoid output
gate (Qwen3-Next's gated attention), optional sliding window, through transformers' attention interface.

Biases: `attention_bias` on the q, k and v projections, `attention_output_bias` on o_proj (unset: the same as
attention_bias, the single switch of Llama and Qwen3-Next; Qwen2, Fast-LLM's Qwen2 import and fla's attention have
q/k/v biases and none on the output). With gate g and query heads i over keys j of head group i // (H / H_kv):
    q = x Wq + bq,  k = x Wk + bk,  v = x Wv + bv   (per head, then q/k norm and rotary)
    o_i = softmax_j(q_i k_j^T / sqrt(d) + mask) v_j,  y = (o * sigmoid(g)) Wo + bo.

Sliding-window attention in linear memory: for eager and sdpa, transformers expresses the window as a 4-D
[batch, 1, queries, keys] mask, T x T elements for a prefill of T tokens (5.5 GB at T=32768), though each query sees
at most `window` keys. The model hands such layers a `SlidingWindowMask` instead (a description of the mask, O(T)),
and `sliding_window_attention` runs the same attention function over blocks of queries, each against only the keys
its window can reach, with that block's slice of the mask: O(T * window) memory. The keys it skips are exactly those
the full mask hides, so the result is the same up to floating-point summation order. Full attention gets the same
description, with an unbounded window, for prompts of DESCRIBED_MASK_QUERIES tokens or more whose mask would be
materialised (padded rows, packed documents, keys cached before the prompt: sdpa's causal kernel needs no mask
otherwise): blocks of 1,024 queries against the keys before them, 1,024 x keys mask elements at a time instead of
T x keys.

A decoding step (one token per row, no gradient) runs q_proj, k_proj and v_proj as one GEMM (`fused_projections`; so
does a speculative verify round: `stacks_projections`), rotates q and k together (one concatenation, then x * cos +
swap(x) * sin over whole heads with the forward's tables, `RotaryTables.whole_head`, built once per forward: the same
products and sums, element for element, as `apply_rotary`, in 5 kernels for both instead of 6 for each; a verify
round's few tokens too), attends by two GEMMs on a GPU under sdpa (`attention_one_query`: the
fused SDPA kernels are slow for one query) and gates the output without copying the gate out of the projection. On a
GPU, a captured step's and a verify round's full-attention layers take all of that in three Triton kernels instead
(`attention_step`), where their cache lends its buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .attention_one_query import (
    few_queries_apply,
    one_query_applies,
    one_query_attention,
)
from .attention_step import MAX_STEP_TOKENS, fused_attention_step
from .fused_projections import FusedProjections, stacks_projections
from .mixer_registry import ConfigField, MixerSpec, register
from .norms import HybridLinearRMSNorm
from .prompt_attention_backend import attention_function
from .shown_values import brief
from .tensor_parallel_heads import local_heads

if TYPE_CHECKING:
    from .configuration_hybrid_linear import HybridLinearConfig


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, eager: bool) -> torch.Tensor:
    """A bool attention mask (True: attended) as the additive one the attention layers add: 0 where visible, else
    -inf, or for eager attention the dtype's lowest finite value (transformers' eager masks; sdpa gives the same scores
    either way)."""
    masked = torch.finfo(dtype).min if eager else -math.inf
    return torch.full(visible.shape, masked, dtype=dtype, device=visible.device).masked_fill_(visible, 0.0)


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


class RotaryTables:
    """The rotary tables of one forward, for the attention layers of one head width: iterates as (cos, sin)
    [B, T, rotary dims], as `apply_rotary` takes them, computed on first use by `compute`; `whole_head` gives them
    over whole heads for `rotate_together`, once per forward, from `direct` (straight from the positions, without
    (cos, sin): a decoding step's few kernels) where given, else from (cos, sin)."""

    def __init__(self, pair: tuple[torch.Tensor, torch.Tensor] | None = None,
                 compute: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 direct: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None] | None = None):
        self._pair, self._compute, self._direct = pair, compute, direct
        self._whole_head: dict = {}
        self._rotated: dict = {}  # head_dim -> the rotated dims of `whole_head`'s tables

    def __iter__(self):
        if self._pair is None:
            self._pair = self._compute()
        return iter(self._pair)

    def whole_head(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos', sin', swap), cos' and sin' [B, T, 1, head_dim]: x * cos' + x[..., swap] * sin' equals
        `apply_rotary`'s [x_rot * cos + rotate_half(x_rot) * sin | x_pass] element for element (cos' = [cos | 1],
        sin' = [-sin_1 | sin_2 | 0] with sin = [sin_1 | sin_2]: rotate_half's negation moved onto sin, which is
        exact; swap exchanges the rotated halves)."""
        if head_dim not in self._whole_head:
            tables = self._direct(head_dim) if self._direct is not None else None
            if tables is None:
                cos, sin = self
                rotary = cos.shape[-1]
                half, rest = rotary // 2, head_dim - rotary
                tables = (torch.nn.functional.pad(cos, (0, rest), value=1.0),
                          torch.cat([-sin[..., :half], torch.nn.functional.pad(sin[..., half:], (0, rest))], dim=-1),
                          rotary)
            cos_full, sin_full, rotary = tables
            swap = _swap_index(head_dim, rotary, cos_full.device)
            self._whole_head[head_dim] = (cos_full.unsqueeze(2), sin_full.unsqueeze(2), swap)
            self._rotated[head_dim] = rotary
        return self._whole_head[head_dim]

    def rotated_dims(self, head_dim: int) -> int:
        """How many leading dims of a head `whole_head`'s tables rotate (the rest pass through)."""
        self.whole_head(head_dim)
        return self._rotated[head_dim]


_SWAP_INDICES: dict = {}


def _swap_index(head_dim: int, rotary: int, device: torch.device) -> torch.Tensor:
    """[rotary/2 .. rotary) + [0 .. rotary/2) + [rotary .. head_dim): the rotated halves exchanged (kept per device)."""
    key = (head_dim, rotary, device)
    if key not in _SWAP_INDICES:
        half = rotary // 2
        _SWAP_INDICES[key] = torch.cat([torch.arange(half, rotary), torch.arange(half), torch.arange(rotary, head_dim)]
                                       ).to(device)
    return _SWAP_INDICES[key]


def rotate_together(query: torch.Tensor, key: torch.Tensor, tables: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` of query [B, T, H, hd] and key [B, T, H_kv, hd] in one pass; returned as [B, heads, T, hd]."""
    both = torch.cat([query, key], dim=2)
    cos, sin, swap = tables.whole_head(both.shape[-1])
    both = both * cos + both.index_select(-1, swap) * sin
    heads = query.shape[2]
    return both[:, :, :heads].transpose(1, 2), both[:, :, heads:].transpose(1, 2)


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


# A full-attention layer's window, as a described mask takes it: wider than any sequence (every earlier key is seen)
UNBOUNDED_WINDOW = 2**62
# Prompts of at least this many tokens whose full-attention mask would be materialised get it described instead
# (modeling's `_describes_full_mask`): a padded prompt of T tokens would otherwise hold [batch, 1, T, T] booleans
DESCRIBED_MASK_QUERIES = 4096


@dataclass
class SlidingWindowMask:
    """The mask of a sliding-window attention layer, described instead of materialised (see the module docstring);
    with UNBOUNDED_WINDOW, a full-attention layer's causal mask.

    Query i (absolute position q_offset + i) sees key j (absolute position kv_offset + j) when 0 <= q - k < window,
    the key is not padding, and both are in the same packed document: transformers' sliding-window mask, element for
    element."""

    window: int
    q_offset: int
    kv_offset: int
    kv_length: int
    key_padding: torch.Tensor | None = None  # [B, >= kv_offset + kv_length] bool, True for real tokens, by absolute key
    documents: torch.Tensor | None = None  # [B, T] packed-document index per token (packing: no cache, keys = queries)

    def key_range(self, q_start: int, q_end: int) -> tuple[int, int]:
        """The keys (local indices) that queries q_start..q_end-1 can see: from the window of the first to the last."""
        first = max(0, self.q_offset + q_start - self.window + 1 - self.kv_offset)
        return first, min(self.kv_length, self.q_offset + q_end - self.kv_offset)

    def block(self, q_start: int, q_end: int, k_start: int, k_end: int, device: torch.device) -> torch.Tensor:
        """[B or 1, 1, q_end - q_start, k_end - k_start] bool, True where the query sees the key."""
        q_abs = torch.arange(q_start, q_end, device=device) + self.q_offset
        k_abs = torch.arange(k_start, k_end, device=device) + self.kv_offset
        distance = q_abs[:, None] - k_abs[None, :]
        mask = ((distance >= 0) & (distance < self.window))[None, None]
        if self.key_padding is not None:
            mask = mask & self.key_padding[:, None, None, k_abs]
        if self.documents is not None:
            documents = self.documents
            mask = mask & (documents[:, None, q_start:q_end, None] == documents[:, None, None, k_start:k_end])
        # a query that sees no key at all (a left pad) would give NaN through sdpa; let it see its block instead (its
        # output is never read: pads are masked as keys and ignored by the recurrent mixers)
        return mask | ~mask.any(-1, keepdim=True)


# Queries per block: at least the window, so that a block reads at most twice its size in keys (few blocks, little
# recomputed), and at most 1024, so that a wide window's block holds 1024 x (1024 + window) scores, not window squared.
_MIN_QUERY_BLOCK, _MAX_QUERY_BLOCK = 256, 1024


def sliding_window_attention(module: nn.Module, attention: Callable, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, mask: SlidingWindowMask, additive: bool,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """`attention` (an eager/sdpa attention function) block by block over the queries; query [B, H, T, hd], key and
    value [B, kv_heads, keys, hd]. Returns the output [B, T, H, hd] (no attention weights: they would be T x keys)."""
    if key.shape[2] != mask.kv_length:
        raise RuntimeError(f"sliding-window attention got {key.shape[2]} keys, its mask describes {mask.kv_length}")
    length = query.shape[2]
    block = min(max(mask.window, _MIN_QUERY_BLOCK), _MAX_QUERY_BLOCK)
    outputs = []
    for q_start in range(0, length, block):
        q_end = min(q_start + block, length)
        k_start, k_end = mask.key_range(q_start, q_end)
        block_mask = mask.block(q_start, q_end, k_start, k_end, query.device)
        if additive:  # eager attention adds the mask to the scores, as transformers' eager mask does
            block_mask = torch.zeros(block_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~block_mask, torch.finfo(query.dtype).min)
        output, _ = attention(module, query[:, :, q_start:q_end], key[:, :, k_start:k_end],
                              value[:, :, k_start:k_end], block_mask, **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


class HybridLinearAttention(nn.Module):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        """config: the model's (its attention implementation can change after construction); the layer's own
        settings are config.per_layer_config[layer_idx]."""
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        settings = config.per_layer_config[layer_idx]
        self.head_dim = settings.head_dim
        self.num_heads = settings.num_attention_heads
        self.num_key_value_heads = settings.num_key_value_heads
        self.num_key_value_groups = settings.num_attention_heads // settings.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = settings.attention_dropout
        self.is_causal = True
        self.output_gate = settings.attention_output_gate
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = settings.sliding_window if is_sliding else None
        bias, H, kv_width = settings.attention_bias, settings.hidden_size, settings.num_key_value_heads * self.head_dim
        q_out = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(H, q_out, bias=bias)
        self.k_proj = nn.Linear(H, kv_width, bias=bias)
        self.v_proj = nn.Linear(H, kv_width, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=settings.attention_output_bias)
        if settings.attention_qk_norm:
            self.q_norm = HybridLinearRMSNorm(self.head_dim, settings.rms_norm_eps, settings.zero_centered_norms)
            self.k_norm = HybridLinearRMSNorm(self.head_dim, settings.rms_norm_eps, settings.zero_centered_norms)
        else:
            self.q_norm = self.k_norm = None
        self._qkv = FusedProjections()  # q_proj, k_proj and v_proj, at decoding time

    def cache_values_per_token(self) -> int:
        """Values its KV cache layer holds per token and batch row: a key and a value per KV head."""
        return 2 * self.num_key_value_heads * self.head_dim

    def _project(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        """query [B, heads, T, hd], key and value [B, kv_heads, T, hd] (normed and rotated), gate [B, T, heads, hd]
        or None."""
        B, T = hidden_states.shape[:2]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        stacked = stacks_projections(hidden_states) and self._qkv.applies(hidden_states, projections)
        together = stacked and isinstance(position_embeddings, RotaryTables)  # (a step's or a round's few rows)
        if stacked:
            widths = [m.out_features for m in projections]
            query, key, value = self._qkv(hidden_states, projections).split(widths, dim=-1)
            query = query.view(B, T, -1, self.head_dim * (2 if self.output_gate else 1))
        else:
            query = self.q_proj(hidden_states).view(B, T, -1, self.head_dim * (2 if self.output_gate else 1))
            key, value = self.k_proj(hidden_states), self.v_proj(hidden_states)
        gate = None
        if self.output_gate:  # per head [query | gate]
            query, gate = query.chunk(2, dim=-1)
        key = key.view(B, T, -1, self.head_dim)
        value = value.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if together:
            query, key = rotate_together(query, key, position_embeddings)
        else:
            query, key = apply_rotary(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)
        return query, key, value, gate

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = hidden_states.shape[:2]
        local_heads(self.k_proj, self.num_key_value_heads, self.layer_idx, "num_key_value_heads")  # TP: divisible
        # head counts follow from the projections' sizes, so a tensor-parallel shard runs its local heads
        if cache is not None and T <= MAX_STEP_TOKENS:  # a captured step or a verify round: three Triton kernels
            fused = fused_attention_step(self, hidden_states, position_embeddings, attention_mask, cache)
            if fused is not None:
                return self.o_proj(fused), None  # ([B, T, heads * hd])
        query, key, value, gate = self._project(hidden_states, position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        implementation = self.config._attn_implementation
        if not self.training and (T == 1 and one_query_applies(query, attention_mask, implementation)
                                  or few_queries_apply(query, attention_mask, implementation, cache)):
            attention: Callable = one_query_attention  # a decoding step or a verify round: two GEMMs
        else:
            attention = attention_function(implementation, eager_attention_forward)
        settings = dict(dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                        sliding_window=self.sliding_window, **kwargs)
        if isinstance(attention_mask, SlidingWindowMask):
            additive = self.config._attn_implementation == "eager"
            output, weights = sliding_window_attention(self, attention, query, key, value, attention_mask, additive,
                                                       **settings)
        else:
            output, weights = attention(self, query, key, value, attention_mask, **settings)
        output = output.reshape(B, T, -1)
        if gate is not None:  # (the gate is a strided view of the projection: sigmoid makes it contiguous)
            output = output * torch.sigmoid(gate).reshape(B, T, -1)
        return self.o_proj(output), weights


# ---------------------------------------------------------------------------------------------------- registration


def _relation_problems(s: Any, p: str) -> list[str]:
    """Checks between the attention fields of one layer's settings `s` (each already well typed); p prefixes the
    field names in the messages."""
    problems = []
    if s.num_attention_heads % s.num_key_value_heads:
        problems.append(f"{p}num_attention_heads={s.num_attention_heads} must be a multiple of "
                        f"{p}num_key_value_heads={s.num_key_value_heads}")
    rope = s.rope_parameters
    factor = rope["partial_rotary_factor"]
    rotated = int(s.head_dim * factor)
    least = 4 if rope["rope_type"] == "dynamic" else 2  # dynamic NTK scales the base by a power dim / (dim - 2)
    if rotated % 2 or rotated < least:
        problems.append(f"{p}head_dim * partial_rotary_factor = {s.head_dim} * {factor} must give an even number "
                        f"of rotated dims, at least {least} for rope_type {rope['rope_type']!r}")
    if rope["rope_type"] == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
        problems.append(f"{p}rope_parameters['high_freq_factor'] must be greater than ['low_freq_factor'] (llama3)")
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        finite = isinstance(values, list) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))
            for x in values)
        if key in rope and not (finite and len(values) == rotated // 2):
            problems.append(f"{p}rope_parameters['{key}'] must be a list of {rotated // 2} finite numbers (one per "
                            f"rotated pair), got {brief(values)}")
    return problems


def _parameter_count(s: Any) -> int:
    q = s.num_attention_heads * s.head_dim
    return s.hidden_size * (q * 2 + 2 * s.num_key_value_heads * s.head_dim) + q * s.hidden_size


_FIELDS = {  # read by full and sliding attention alike: one declaration, shared by both registrations
    "num_attention_heads": ConfigField(kind="size", default=8, doc="attention query heads."),
    "num_key_value_heads": ConfigField(kind="size", default=2,
                                       doc="attention key/value heads (GQA); num_attention_heads must be a multiple."),
    "head_dim": ConfigField(kind="size", default=128, doc="width of each attention head."),
    "rope_parameters": ConfigField(
        kind="rope", default=None,
        doc="the rotary embedding (rope_type, rope_theta, partial_rotary_factor: the fraction of each head's dims "
            "rotated, Qwen3-Next 0.25, Llama-style 1.0). Default: {'rope_type': 'default', 'rope_theta': 10000.0, "
            "'partial_rotary_factor': 0.25}."),
    "attention_output_gate": ConfigField(
        kind="bool", default=True, doc="Qwen3-Next's gated attention: q_proj also produces a gate per head, and the "
                                       "attention output is multiplied by sigmoid(gate)."),
    "attention_qk_norm": ConfigField(kind="bool", default=True,
                                     doc="per-head RMSNorm of queries and keys before the rotary embedding."),
    "attention_bias": ConfigField(
        kind="bool", default=False,
        doc="biases in the q, k and v projections (and in o_proj unless attention_output_bias says otherwise)."),
    "attention_output_bias": ConfigField(
        kind="bool", default=None, default_from="attention_bias", per_layer_default_from=True,
        doc="a bias in the output projection o_proj; unset: as attention_bias, also per layer (Llama, Qwen3-Next: "
            "all four; Qwen2 and fla: attention_bias=True, attention_output_bias=False)."),
}
_SLIDING_FIELDS = {**_FIELDS, "sliding_window": ConfigField(
    kind="window", default=None, doc="tokens each query of a 'sliding_attention' layer sees (itself included).")}
_TENSOR_PARALLEL_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise",
                         "q_norm": "replicated_with_grad_allreduce", "k_norm": "replicated_with_grad_allreduce",
                         "o_proj": "rowwise"}


def _describe(s: Any) -> str:
    return f"{s.num_attention_heads} heads of {s.head_dim}, {s.num_key_value_heads} KV heads"


for _layer_type, _title, _fields, _description in (
        ("full_attention", "full attention", _FIELDS, _describe),
        ("sliding_attention", "sliding-window attention", _SLIDING_FIELDS,
         lambda s: f"{_describe(s)}, window {s.sliding_window}")):
    register(MixerSpec(
        mixer_type=_layer_type, layer_type=_layer_type, title=_title, fields=_fields,
        module_class=HybridLinearAttention, attribute="self_attn", state="kv", parameter_count=_parameter_count,
        relation_problems=_relation_problems,
        tensor_parallel_plan=_TENSOR_PARALLEL_PLAN, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        describe=_description,
    ))

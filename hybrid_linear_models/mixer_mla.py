"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and Kimi-Linear's attention layers), layer type "mla_attention".

Keys and values come from one low-rank latent per token, shared by the heads; only that latent (and one shared key
slice) is cached. With h heads, latent rank r (kv_lora_rank), per-head query/key widths n (qk_nope_head_dim) and
p (qk_rope_head_dim), value width v (v_head_dim), for a token x:
    q = x Wq  (or, with q LoRA: RMSNorm(x Wqa) Wqb),        q_i = [qn_i | qp_i]  per head i, widths n and p
    [c | kp] = x Wkva  (kv_a_proj_with_mqa),  c = RMSNorm(c) (width r),  kp (width p) shared by all heads
    [kn_i | v_i] = c Wkvb_i  (kv_b_proj),     k_i = [kn_i | kp]
    o_i = softmax_j(q_i . k_ij / sqrt(n + p) + mask) v_ij,    y = [o_1 .. o_h] Wo.
`mla_use_nope` True (Kimi-Linear, whose released config says so with p = 64): no rotary embedding at all, kp is just
an unrotated shared key slice. False (DeepSeek): qp_i and kp are rotated by position (the model's rope_parameters;
all p dims of the slice rotate, so partial_rotary_factor does not apply; pairs (j, j + p/2) as transformers' Llama
rotates them: DeepSeek's interleaved pairs are a permutation of the rope rows of Wq and Wkva, a converter's job).
The softmax scale is 1/sqrt(n + p), times DeepSeek-V3's YaRN correction m^2 where the rope parameters give
`mscale_all_dim` with a rope type other than "default": m = 0.1 mscale_all_dim ln(factor) + 1 (factor > 1), as
transformers' DeepseekV3Attention scales it.
Parameter names are Kimi-Linear's (q_proj | q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj), so checkpoints map one to one; `attention_bias` puts biases where transformers' KimiLinearAttention
and DeepSeek-V3 put them, on q_a_proj, kv_a_proj_with_mqa and o_proj (never on q_proj, q_b_proj or kv_b_proj, so the
absorbed form below needs none; the released Kimi-Linear has none).

The cache (transformers' KV layers of a "full_attention" layer: DynamicLayer, StaticLayer) keeps per token only
[c | kp] as its keys and nothing as its values: r + p values (`cache_bytes_per_token`), against h * (n + p + v) for the
full keys and values (`full_kv_bytes_per_token`; Kimi-Linear 48B: 576 against 10240, 17.8x less).

Two ways to attend, the same math:
- expanded (training, prefill, any multi-token step, flash attention): every key's kn_i and v_i are computed from
  its latent by kv_b_proj, then ordinary multi-head attention through transformers' attention interface (eager,
  sdpa, flash: which pads v to the key width when they differ). Cost per step grows with T * r * h * (n + v). Only
  the keys the step can see are expanded: of a static cache's max_cache_len slots, the filled ones (`filled_slots`).
- absorbed (one-token decoding steps against a cache, eager or sdpa): kv_b_proj is folded into the query and the
  output instead, so attention runs in the latent space, against the cache as it is: with Wkvb_i = [Uk_i | Uv_i],
      q_i . k_ij = (qn_i Uk_i^T) . c_j + qp_i . kp_j,    o_i = (sum_j a_ij c_j) Uv_i^T,
  one key "head" [c | kp] of width r + p and one value "head" c (a view of the same cache tensor) for all h heads.
  The h queries of the step are the rows of a single query head (they share the step's mask), so the cache is read
  once per step, with no copy per head. Cost per step grows with T * h * (2r + p): decoding does not re-expand the
  context. The sums are regrouped, so it equals the expanded form up to rounding (float32: ~1e-6, checked in the
  tests against the uncached forward). A kv_b_proj that is no plain Linear (a LoRA adapter around it) is expanded.
  On a GPU under sdpa the absorbed step attends by two GEMMs (`attention_one_query`: the memory-efficient SDPA
  kernel, which a 576-wide key falls back to, is built for long query blocks). The query's first projection (q_proj,
  or q_a_proj) and kv_a_proj_with_mqa read the same hidden state: a decoding step runs them as one stacked GEMM
  (`fused_projections`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer

from .attention_one_query import one_query_applies, one_query_attention
from .fused_projections import FusedProjections, stacks_projections
from .mixer_attention import _FIELDS as ATTENTION_FIELDS
from .mixer_attention import (
    SlidingWindowMask,
    apply_rotary,
    eager_attention_forward,
    sliding_window_attention,
)
from .mixer_registry import ConfigField, MixerSpec, register
from .norms import HybridLinearRMSNorm
from .prompt_attention_backend import attention_function
from .tensor_parallel_heads import device_mesh

if TYPE_CHECKING:
    from .configuration_hybrid_linear import HybridLinearConfig

_ABSORBING_IMPLEMENTATIONS = ("eager", "sdpa")  # take a value narrower than the key and a broadcast mask


class LatentProjection(nn.Linear):
    """kv_a_proj_with_mqa, x -> [c | kp]: a Linear that gives tensor parallelism its own layer's rope width.

    Under tensor parallelism kv_b_proj is split by heads, and the gradient of c reaching it is summed over the ranks
    by its column-wise style; kp bypasses kv_b_proj, so transformers' "mla_kv_a_proj" style sums the gradient of the
    last `module.config.qk_rope_head_dim` outputs itself. It sets `module.config` to the model's config, whose
    qk_rope_head_dim is one value (refused as ambiguous when layers differ); read here, `config` is that config with
    this layer's width, so layers of different qk_rope_head_dim are each split at their own width."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rope_width: int):
        super().__init__(in_features, out_features, bias=bias)
        self.rope_width = rope_width

    @property
    def config(self) -> _LayerRopeWidth:
        assigned = self.__dict__.get("_assigned_config")
        if assigned is None:  # only transformers' tensor parallelism sets one
            raise AttributeError("config")
        return _LayerRopeWidth(assigned, self.rope_width)

    @config.setter
    def config(self, value: Any) -> None:
        self.__dict__["_assigned_config"] = value


class _LayerRopeWidth:
    """A config read through, except for qk_rope_head_dim: the layer's own."""

    def __init__(self, config: Any, qk_rope_head_dim: int):
        self._config, self.qk_rope_head_dim = config, qk_rope_head_dim

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_config":
            raise AttributeError(name)
        return getattr(self._config, name)



def yarn_softmax_correction(rope: dict) -> float:
    """DeepSeek-V3's YaRN factor m of the attention logits' scale (applied squared: queries and keys), 1 unless the
    rope type is not "default" and `mscale_all_dim` is given: m = 0.1 mscale_all_dim ln(factor) + 1 for factor > 1."""
    mscale_all_dim, factor = rope.get("mscale_all_dim"), rope.get("factor")
    if rope.get("rope_type", "default") == "default" or not mscale_all_dim or not factor or factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0

class HybridLinearMultiHeadLatentAttention(nn.Module):
    def __init__(self, config: HybridLinearConfig, layer_idx: int):
        """config: the model's (its attention implementation can change after construction); the layer's own
        settings are config.per_layer_config[layer_idx]."""
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        s = config.per_layer_config[layer_idx]
        self.num_heads = s.num_attention_heads
        self.kv_lora_rank, self.q_lora_rank = s.kv_lora_rank, s.q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = s.qk_nope_head_dim, s.qk_rope_head_dim
        self.v_head_dim = s.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.rotary = not s.mla_use_nope and self.qk_rope_head_dim > 0
        self.scaling = self.qk_head_dim**-0.5 * yarn_softmax_correction(s.rope_parameters) ** 2
        self.attention_dropout = s.attention_dropout
        self.is_causal = True
        self.num_key_value_groups = 1  # keys are per head (expanded) or one head for one query head (absorbed)
        H, heads = s.hidden_size, self.num_heads
        norm = lambda dim: HybridLinearRMSNorm(dim, s.mla_norm_eps, s.zero_centered_norms)  # noqa: E731
        bias = s.attention_bias  # on the projections transformers' KimiLinearAttention gives one (module docstring)
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(H, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = LatentProjection(H, self.kv_lora_rank + self.qk_rope_head_dim, bias,
                                                   self.qk_rope_head_dim)
        self.kv_a_layernorm = norm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, H, bias=bias)
        # the query's first projection and kv_a_proj_with_mqa read the same hidden state: one GEMM in a decoding
        # step (fused_projections)
        self._first_projections = FusedProjections()

    def cache_values_per_token(self) -> int:
        """Values its KV cache layer holds per token and batch row: the latent and the shared key slice."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _queries_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries [.., heads * (n + p)] and kv_a_proj_with_mqa's [c | kp]; in a decoding step the query's first
        projection (q_proj, or q_a_proj with a q LoRA) and kv_a_proj_with_mqa as one stacked GEMM."""
        first = self.q_a_proj if self.q_lora_rank else self.q_proj
        linears = [first, self.kv_a_proj_with_mqa]
        if stacks_projections(x) and self._first_projections.applies(x, linears):
            q_first, latent = self._first_projections(x, linears).split([m.out_features for m in linears], dim=-1)
        else:
            q_first, latent = first(x), self.kv_a_proj_with_mqa(x)
        return (self.q_b_proj(self.q_a_layernorm(q_first)) if self.q_lora_rank else q_first), latent

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = hidden_states.shape[:2]
        nope, rope, r = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        # head counts follow from the projections' sizes (-1), so a tensor-parallel shard runs its local heads
        queries, compressed_kv = self._queries_and_latent(hidden_states)
        query = queries.view(B, T, -1, self.qk_head_dim).transpose(1, 2)  # [B, h, T, n + p]
        latent, shared_key = compressed_kv.split([r, rope], dim=-1)
        shared_key = shared_key[:, None]  # [B, 1, T, p]
        if self.rotary:
            q_nope, q_rope = query.split([nope, rope], dim=-1)
            q_rope, shared_key = apply_rotary(q_rope, shared_key, *position_embeddings)
            query = torch.cat([q_nope, q_rope], dim=-1)
        compressed = torch.cat([self.kv_a_layernorm(latent)[:, None], shared_key], dim=-1)  # [B, 1, T, r + p]
        if cache is not None:
            compressed, _ = cache.update(compressed, compressed[..., :0], self.layer_idx)

        implementation = self.config._attn_implementation
        attention: Callable = attention_function(implementation, eager_attention_forward)
        settings = dict(dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, **kwargs)
        if (cache is not None and T == 1 and implementation in _ABSORBING_IMPLEMENTATIONS
                and type(self.kv_b_proj) is nn.Linear):
            output, weights = self._absorbed(attention, query, compressed, attention_mask, settings)
        else:
            slots = compressed.shape[2]
            if cache is not None:
                compressed, attention_mask = filled_slots(cache, self.layer_idx, compressed, attention_mask)
            output, weights = self._expanded(attention, query, compressed, attention_mask, settings,
                                             pad_value="flash" in implementation)
            if weights is not None and weights.shape[-1] < slots:
                # weights over every slot of the cache, as attention over the whole buffer returns them: the slots
                # left out are masked for every query, so their weights are zero
                weights = nn.functional.pad(weights, [0, slots - weights.shape[-1]])
        return self.o_proj(output.reshape(B, T, -1)), weights

    def _expanded(self, attention: Callable, query: torch.Tensor, compressed: torch.Tensor, attention_mask,
                  settings: dict, pad_value: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head keys and values from every cached latent, then multi-head attention. Returns [B, T, h, v]."""
        B, _, keys, _ = compressed.shape
        latent, shared_key = compressed.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        expanded = self.kv_b_proj(latent[:, 0]).view(B, keys, -1, self.qk_nope_head_dim + self.v_head_dim)
        key_nope, value = expanded.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat([key_nope, shared_key.expand(-1, key_nope.shape[1], -1, -1)], dim=-1)
        if pad_value and self.v_head_dim != self.qk_head_dim:  # flash attention wants one width for q, k and v
            value = nn.functional.pad(value, [0, self.qk_head_dim - self.v_head_dim])
        if isinstance(attention_mask, SlidingWindowMask):  # a long prompt's mask, described (mixer_attention)
            additive = self.config._attn_implementation == "eager"
            output, weights = sliding_window_attention(self, attention, query, key, value, attention_mask, additive,
                                                       **settings)
        else:
            output, weights = attention(self, query, key, value, attention_mask, **settings)
        return output[..., : self.v_head_dim], weights

    def _absorbed(self, attention: Callable, query: torch.Tensor, compressed: torch.Tensor, attention_mask,
                  settings: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row: attention in the latent space (see the module docstring). Returns [B, 1, h, v] and
        the attention weights [B, h, 1, keys] when the attention function gives them."""
        nope, r = self.qk_nope_head_dim, self.kv_lora_rank
        weight = self.kv_b_proj.weight
        if device_mesh(weight) is not None:  # tensor parallel: this rank's heads' rows (the queries are its heads)
            weight = weight.to_local()
        weight = weight.view(-1, nope + self.v_head_dim, r)  # [h, n + v, r]: [Uk_i | Uv_i] per head
        q_nope, q_rope = query[:, :, 0].split([nope, self.qk_rope_head_dim], dim=-1)  # [B, h, n], [B, h, p]
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, weight[:, :nope])
        rows = torch.cat([q_latent, q_rope], dim=-1)[:, None]  # [B, 1, h, r + p]: the heads as one head's rows
        settings = {**settings, "is_causal": False}  # the rows are heads, not positions: the mask alone applies
        if not self.training and one_query_applies(rows, attention_mask, self.config._attn_implementation):
            attention = one_query_attention  # every head under the step's one mask row: two GEMMs
        output, weights = attention(self, rows, compressed, compressed[..., :r], attention_mask, **settings)
        output = torch.einsum("bhr,hvr->bhv", output[:, :, 0], weight[:, nope:])  # output [B, h, 1, r] -> [B, h, v]
        return output[:, None], None if weights is None else weights.transpose(1, 2)


def filled_slots(cache: Cache, layer_idx: int, compressed: torch.Tensor,
                 attention_mask: Any) -> tuple[torch.Tensor, Any]:
    """The cached latents [B, 1, keys, r + p] an expanded step attends to, and its mask cut to match.

    A static cache returns its whole buffer (max_cache_len slots), of which only the first `cumulative_length` are
    written (one count for the whole batch: left padding and packing are masked inside the filled slots): no query of
    the step sees a later slot (the mask hides it), so expanding it through kv_b_proj would be wasted work and memory,
    max_cache_len / filled times the step's own. The count is read on the host, so not while a CUDA graph is captured
    or torch.compile traces (the buffer is expanded whole there); the captured one-token step is absorbed and
    expands nothing. A dynamic cache holds only written tokens: unchanged. The attention weights the layer returns
    still span every slot (zero on the unfilled ones), as they do where the buffer is expanded whole."""
    layer = cache.layers[layer_idx] if layer_idx < len(getattr(cache, "layers", ())) else None
    if (not isinstance(layer, StaticLayer) or layer.is_sliding or torch.compiler.is_compiling()
            or (compressed.is_cuda and torch.cuda.is_current_stream_capturing())):
        return compressed, attention_mask
    filled = int(layer.cumulative_length)  # slots 0 .. filled - 1 hold tokens (after this step's update)
    if filled >= compressed.shape[2]:
        return compressed, attention_mask
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] > filled:  # 2-D [B, keys] or 4-D
        attention_mask = attention_mask[..., :filled]
    return compressed[:, :, :filled], attention_mask


# ---------------------------------------------------------------------------------------------- cache size


def cache_bytes_per_token(settings: Any, dtype: torch.dtype) -> int:
    """Bytes an MLA layer of these settings caches per token and batch row: its latent and shared key slice."""
    return (settings.kv_lora_rank + settings.qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()


def full_kv_bytes_per_token(settings: Any, dtype: torch.dtype) -> int:
    """Bytes per token and row of the full keys and values of the same heads (what an expanded cache would hold)."""
    width = settings.qk_nope_head_dim + settings.qk_rope_head_dim + settings.v_head_dim
    return settings.num_attention_heads * width * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------------- registration


class _RopeSlice:
    """A layer's settings as the model's rotary embedding reads them: the whole rope slice rotated (head_dim = p,
    partial_rotary_factor 1), the rope type, theta and scaling of the layer's rope_parameters."""

    def __init__(self, settings: Any):
        self._settings = settings
        self.head_dim = settings.qk_rope_head_dim
        self.rope_parameters = {**settings.rope_parameters, "partial_rotary_factor": 1.0}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_settings":  # copy/pickle probe a bare instance: no recursion
            raise AttributeError(name)
        return getattr(self._settings, name)


def _rotary_settings(s: Any) -> _RopeSlice | None:
    return None if s.mla_use_nope or not s.qk_rope_head_dim else _RopeSlice(s)


def _relation_problems(s: Any, p: str) -> list[str]:
    """Checks between the MLA fields of one layer's settings `s`; p prefixes the field names in the messages."""
    problems = []
    rope = s.rope_parameters
    if not s.mla_use_nope and s.qk_rope_head_dim:
        least = 4 if rope["rope_type"] == "dynamic" else 2  # dynamic NTK scales the base by a power dim / (dim - 2)
        if s.qk_rope_head_dim % 2 or s.qk_rope_head_dim < least:
            problems.append(f"{p}qk_rope_head_dim={s.qk_rope_head_dim} is rotated (mla_use_nope=False), so it must be "
                            f"even and at least {least} for rope_type {rope['rope_type']!r}; or set mla_use_nope=True")
        if rope["rope_type"] == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
            problems.append(f"{p}rope_parameters['high_freq_factor'] must be greater than ['low_freq_factor'] "
                            "(llama3)")
        for key in ("short_factor", "long_factor"):
            values = rope.get(key)
            if key in rope and not (isinstance(values, list) and len(values) == s.qk_rope_head_dim // 2):
                problems.append(f"{p}rope_parameters['{key}'] must be a list of qk_rope_head_dim // 2 = "
                                f"{s.qk_rope_head_dim // 2} numbers (one per rotated pair)")
    return problems


def _parameter_count(s: Any) -> int:
    heads, H, qk = s.num_attention_heads, s.hidden_size, s.qk_nope_head_dim + s.qk_rope_head_dim
    q = (H + heads * qk) * s.q_lora_rank if s.q_lora_rank else H * heads * qk
    kv = H * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank * heads * (s.qk_nope_head_dim + s.v_head_dim)
    return q + kv + heads * s.v_head_dim * H


def _describe(s: Any) -> str:
    query = f"q LoRA rank {s.q_lora_rank}" if s.q_lora_rank else "full-rank q"
    position = "no rotary (NoPE)" if s.mla_use_nope or not s.qk_rope_head_dim else "rotary on the shared slice"
    return (f"{s.num_attention_heads} heads (q/k {s.qk_nope_head_dim} + {s.qk_rope_head_dim}, v {s.v_head_dim}), KV "
            f"latent rank {s.kv_lora_rank}, {query}, {position}")


_FIELDS = {
    "num_attention_heads": ATTENTION_FIELDS["num_attention_heads"],
    "attention_bias": ATTENTION_FIELDS["attention_bias"],
    "rope_parameters": ATTENTION_FIELDS["rope_parameters"],
    "kv_lora_rank": ConfigField(kind="size", default=512,
                                doc="MLA: rank of the KV latent each token's keys and values are computed from."),
    "q_lora_rank": ConfigField(kind="size_or_zero", default=0,
                               doc="MLA: rank of the low-rank query projection (q_a_proj, q_b_proj); 0: one q_proj."),
    "qk_nope_head_dim": ConfigField(kind="size", default=128,
                                    doc="MLA: per-head query/key width computed from the latent (never rotated)."),
    "qk_rope_head_dim": ConfigField(kind="size_or_zero", default=64,
                                    doc="MLA: width of the key slice all heads share (rotated unless mla_use_nope)."),
    "v_head_dim": ConfigField(kind="size", default=128, doc="MLA: per-head value width."),
    "mla_use_nope": ConfigField(
        kind="bool", default=True,
        doc="MLA without rotary embedding (Kimi-Linear); False: DeepSeek's rotary on the qk_rope_head_dim slice."),
    "mla_norm_eps": ConfigField(kind="epsilon", default=None, default_from="rms_norm_eps",
                                doc="MLA: epsilon of q_a_layernorm and kv_a_layernorm (default: rms_norm_eps)."),
}

register(MixerSpec(
    mixer_type="mla_attention", layer_type="full_attention", title="multi-head latent attention", fields=_FIELDS,
    module_class=HybridLinearMultiHeadLatentAttention, attribute="self_attn", state="kv",
    rotary_settings=_rotary_settings,
    parameter_count=_parameter_count, relation_problems=_relation_problems,
    # heads split as DeepSeek-V3's plan splits them; the shared key slice bypasses kv_b_proj, so its gradient is summed
    # over the ranks by transformers' "mla_kv_a_proj" style (which reads each layer's own qk_rope_head_dim through
    # LatentProjection.config: layers may differ)
    tensor_parallel_plan={"q_proj": "colwise", "q_b_proj": "colwise", "kv_a_proj_with_mqa": "mla_kv_a_proj",
                          "kv_b_proj": "colwise", "o_proj": "rowwise"},
    lora_targets=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    describe=_describe,
))

"""The canonical layout: the parameter names and shapes of our Hugging Face model (`HybridLinearForCausalLM`) for a
given config. Every format is converted to and from this layout; the tests check it against the model's own
`state_dict()`."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..configuration_hybrid_linear import HybridLinearConfig

Shape = tuple[int, ...]

EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def _block_shapes(config: HybridLinearConfig) -> dict[str, Shape]:
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    if config.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)})
    return shapes


def _attention_shapes(config: HybridLinearConfig) -> dict[str, Shape]:
    h, hd = config.hidden_size, config.head_dim
    q_rows = config.num_attention_heads * hd * (2 if config.attention_output_gate else 1)
    kv_rows = config.num_key_value_heads * hd
    o_cols = config.num_attention_heads * hd
    shapes = {"self_attn.q_proj.weight": (q_rows, h), "self_attn.k_proj.weight": (kv_rows, h),
              "self_attn.v_proj.weight": (kv_rows, h), "self_attn.o_proj.weight": (h, o_cols)}
    if config.attention_qk_norm:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if config.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                       "self_attn.v_proj.bias": (kv_rows,), "self_attn.o_proj.bias": (h,)})
    return shapes


def _gated_deltanet_shapes(config: HybridLinearConfig) -> dict[str, Shape]:
    h = config.hidden_size
    hk, hv = config.gdn_num_key_heads, config.gdn_num_value_heads
    dk, dv, k = config.gdn_key_head_dim, config.gdn_value_head_dim, config.gdn_conv_kernel_size
    return {"linear_attn.in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, h),
            "linear_attn.in_proj_ba.weight": (2 * hv, h),
            "linear_attn.conv1d.weight": (2 * hk * dk + hv * dv, 1, k),
            "linear_attn.dt_bias": (hv,), "linear_attn.A_log": (hv,), "linear_attn.norm.weight": (dv,),
            "linear_attn.out_proj.weight": (h, hv * dv)}


def _kimi_delta_shapes(config: HybridLinearConfig) -> dict[str, Shape]:
    h, heads, d, k = config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel_size
    p = heads * d
    shapes: dict[str, Shape] = {}
    for name in ("q", "k", "v"):
        shapes[f"linear_attn.{name}_proj.weight"] = (p, h)
    for name in ("q", "k", "v"):
        shapes[f"linear_attn.{name}_conv1d.weight"] = (p, 1, k)
    shapes.update({"linear_attn.f_a_proj.weight": (d, h), "linear_attn.f_b_proj.weight": (p, d),
                   "linear_attn.dt_bias": (p,), "linear_attn.A_log": (heads,), "linear_attn.b_proj.weight": (heads, h),
                   "linear_attn.g_a_proj.weight": (d, h), "linear_attn.g_b_proj.weight": (p, d),
                   "linear_attn.o_norm.weight": (d,), "linear_attn.o_proj.weight": (h, p)})
    return shapes


MIXER_SHAPES = {
    "full_attention": _attention_shapes,
    "sliding_attention": _attention_shapes,
    "gated_deltanet": _gated_deltanet_shapes,
    "kimi_delta_attention": _kimi_delta_shapes,
}


def hf_tensor_shapes(config: HybridLinearConfig, layers: Iterable[int] | None = None) -> dict[str, Shape]:
    """Every tensor of the model in `config`, in a stable order: embeddings, layers (only `layers` if given), final
    norm, LM head (absent when the embeddings are tied)."""
    shapes: dict[str, Shape] = {EMBEDDINGS: (config.vocab_size, config.hidden_size)}
    for index in range(len(config.layer_types)) if layers is None else layers:
        layer_type = config.layer_types[index]
        prefix = layer_prefix(index)
        for name, shape in {**MIXER_SHAPES[layer_type](config), **_block_shapes(config)}.items():
            shapes[prefix + name] = shape
    shapes[FINAL_NORM] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, config.hidden_size)
    return shapes


def one_layer_per_type(config: HybridLinearConfig) -> dict[str, Shape]:
    """The shapes of the model's tensors with one layer of each mixer type: every distinct tensor shape, cheaply."""
    first_of_type = {layer_type: index for index, layer_type in reversed(list(enumerate(config.layer_types)))}
    return hf_tensor_shapes(config, sorted(first_of_type.values()))


def elements_per_layer_type(config: HybridLinearConfig) -> dict[str, int]:
    """Weight elements of one layer of each mixer type present (all layers of a type have the same shapes)."""
    return {layer_type: sum(math.prod(shape) for shape in {**MIXER_SHAPES[layer_type](config),
                                                            **_block_shapes(config)}.values())
            for layer_type in dict.fromkeys(config.layer_types)}


__all__ = ["hf_tensor_shapes", "one_layer_per_type", "elements_per_layer_type", "layer_prefix", "EMBEDDINGS", "FINAL_NORM", "LM_HEAD", "MIXER_SHAPES"]

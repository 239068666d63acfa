"""Name maps: which tensors of a format make which tensors of the canonical layout (our Hugging Face model), as
tables of (format names, converter, canonical names). A table is data; `build_*_rows(config)` only instantiates it
for the layers of a given config. Every converter knows its inverse, so the same rows serve reading and writing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..configuration_hybrid_linear import HybridLinearConfig
from .converters import IDENTITY, SPLIT_HALVES, TRANSPOSE, Converter, GdnKeyHeadGrouping
from .hf_layout import EMBEDDINGS, FINAL_NORM, LM_HEAD, hf_tensor_shapes, layer_prefix


@dataclass(frozen=True)
class MapRow:
    """`converter.forward(format tensors) == canonical tensors`, `converter.inverse` the way back."""

    format_keys: tuple[str, ...]
    converter: Converter
    canonical_keys: tuple[str, ...]


@dataclass(frozen=True)
class Entry:
    """A table entry, with names relative to a prefix; `when` restricts it to some configs."""

    format_names: str | tuple[str, ...]
    converter: Converter
    canonical_names: str | tuple[str, ...]
    when: Callable[[HybridLinearConfig], bool] | None = None


def _names(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def instantiate(entries: Sequence[Entry], config: HybridLinearConfig, format_prefix: str = "",
                canonical_prefix: str = "") -> list[MapRow]:
    return [
        MapRow(tuple(format_prefix + n for n in _names(e.format_names)), e.converter.bind(config),
               tuple(canonical_prefix + n for n in _names(e.canonical_names)))
        for e in entries if e.when is None or e.when(config)
    ]


# ------------------------------------------------------------------------------------------ Fast-LLM <-> canonical
# Fast-LLM parameter names (the `fast_llm` format appends "/weights"; the `distributed` format has no names).

FAST_LLM_MODEL = (
    Entry("embeddings.word_embeddings_weight", IDENTITY, EMBEDDINGS),
    Entry("head.final_norm.weight", IDENTITY, FINAL_NORM),
    Entry("head.output_weights", IDENTITY, LM_HEAD, when=lambda c: not c.tie_word_embeddings),
)

FAST_LLM_BLOCK = (  # under decoder.{i}. <-> model.layers.{i}.
    Entry("norm_1.weight", IDENTITY, "input_layernorm.weight"),
    Entry("norm_2.weight", IDENTITY, "post_attention_layernorm.weight"),
    Entry("mlp.layer_1.weight", SPLIT_HALVES, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # gate rows, up rows
    Entry("mlp.layer_2.weight", TRANSPOSE, "mlp.down_proj.weight"),  # stored (intermediate, hidden)
)

FAST_LLM_ATTENTION = (
    Entry("mixer.query.weight", IDENTITY, "self_attn.q_proj.weight"),
    Entry("mixer.key_value.weight", SPLIT_HALVES, ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    Entry("mixer.dense.weight", IDENTITY, "self_attn.o_proj.weight"),
)

FAST_LLM_GATED_DELTANET = (
    Entry("mixer.in_proj_qkvz.weight", GdnKeyHeadGrouping("qkvz"), "linear_attn.in_proj_qkvz.weight"),
    Entry("mixer.in_proj_ba.weight", GdnKeyHeadGrouping("ba"), "linear_attn.in_proj_ba.weight"),
    Entry("mixer.convolution.weight", IDENTITY, "linear_attn.conv1d.weight"),  # flat [Q | K | V] on both sides
    Entry("mixer.out_proj.weight", IDENTITY, "linear_attn.out_proj.weight"),
    Entry("mixer.dt_bias", IDENTITY, "linear_attn.dt_bias"),
    Entry("mixer.A_log", IDENTITY, "linear_attn.A_log"),
    Entry("mixer.norm.weight", IDENTITY, "linear_attn.norm.weight"),
)

FAST_LLM_KIMI_DELTA = (
    Entry("mixer.q_proj.weight", IDENTITY, "linear_attn.q_proj.weight"),
    Entry("mixer.k_proj.weight", IDENTITY, "linear_attn.k_proj.weight"),
    Entry("mixer.v_proj.weight", IDENTITY, "linear_attn.v_proj.weight"),
    Entry("mixer.q_conv.weight", IDENTITY, "linear_attn.q_conv1d.weight"),
    Entry("mixer.k_conv.weight", IDENTITY, "linear_attn.k_conv1d.weight"),
    Entry("mixer.v_conv.weight", IDENTITY, "linear_attn.v_conv1d.weight"),
    Entry("mixer.f_a_proj.weight", IDENTITY, "linear_attn.f_a_proj.weight"),
    Entry("mixer.f_b_proj.weight", IDENTITY, "linear_attn.f_b_proj.weight"),
    Entry("mixer.g_a_proj.weight", IDENTITY, "linear_attn.g_a_proj.weight"),
    Entry("mixer.g_b_proj.weight", IDENTITY, "linear_attn.g_b_proj.weight"),
    Entry("mixer.beta_proj.weight", IDENTITY, "linear_attn.b_proj.weight"),
    Entry("mixer.o_proj.weight", IDENTITY, "linear_attn.o_proj.weight"),
    Entry("mixer.dt_bias", IDENTITY, "linear_attn.dt_bias"),
    Entry("mixer.A_log", IDENTITY, "linear_attn.A_log"),
    Entry("mixer.norm.weight", IDENTITY, "linear_attn.o_norm.weight"),
)

FAST_LLM_MIXERS = {
    "full_attention": FAST_LLM_ATTENTION,
    "sliding_attention": FAST_LLM_ATTENTION,
    "gated_deltanet": FAST_LLM_GATED_DELTANET,
    "kimi_delta_attention": FAST_LLM_KIMI_DELTA,
}


def fast_llm_block_prefix(index: int) -> str:
    return f"decoder.{index}."


def build_fast_llm_rows(config: HybridLinearConfig) -> list[MapRow]:
    """Fast-LLM parameter names <-> canonical names for `config`, layer by layer."""
    rows = instantiate(FAST_LLM_MODEL[:1], config)
    for index, layer_type in enumerate(config.layer_types):
        entries = FAST_LLM_MIXERS[layer_type] + FAST_LLM_BLOCK
        rows += instantiate(entries, config, fast_llm_block_prefix(index), layer_prefix(index))
    rows += instantiate(FAST_LLM_MODEL[1:], config)
    return rows


# ------------------------------------------------------------------------------------------ HF <-> canonical


def build_hf_rows(config: HybridLinearConfig) -> list[MapRow]:
    """Our HF format is the canonical layout: one identity row per tensor."""
    return [MapRow((name,), IDENTITY, (name,)) for name in hf_tensor_shapes(config)]


__all__ = ["MapRow", "Entry", "instantiate", "build_fast_llm_rows", "build_hf_rows", "fast_llm_block_prefix",
           "FAST_LLM_MODEL", "FAST_LLM_BLOCK", "FAST_LLM_MIXERS"]

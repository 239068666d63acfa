"""Apriel2's parameter names <-> the canonical layout (our Hugging Face model), as tables.

Apriel2 (Fast-LLM's exporter, `fast_llm/models/gpt/conversion/apriel2.py`) names block `i`'s tensors
`model.decoder.blocks.{i}.{input_layernorm,post_attention_layernorm}.weight`, `...mlp.{gate,up,down}_proj.weight`
(already split and in (out, in) layout) and the mixer's under `...mixer.`, or, for a stochastic (supernet) mixer,
under `...mixer.mixers.{name}.` for each of its mixers. Attention is split `q_proj/k_proj/v_proj/o_proj`. Gated
DeltaNet and Kimi Delta Attention keep Fast-LLM's own names and layouts (FLAT `in_proj_qkvz` = [Q | K | V | Z] and
`in_proj_ba` = [beta | alpha], regrouped per key head for Qwen3-Next's layout; `convolution` over [Q | K | V]). The
top-level tensors are `model.embed_tokens.weight`, `model.norm.weight` and `lm_head.weight` (absent when tied).
"""

from __future__ import annotations

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, GdnKeyHeadGrouping
from ..hf_layout import EMBEDDINGS, FINAL_NORM, LM_HEAD, layer_config, layer_prefix
from ..name_maps import Entry, MapRow, instantiate
from .config import BLOCK_PREFIX, StochasticChoice


def _same(name: str, canonical: str, when=None) -> Entry:
    return Entry(name, IDENTITY, canonical, when)


_ATTENTION_BIAS = lambda config: bool(config.attention_bias)  # noqa: E731  (q, k, v)
_OUTPUT_BIAS = lambda config: bool(config.attention_output_bias)  # noqa: E731  (o)

# Names relative to the mixer's prefix (format side) and to the layer's prefix (canonical side).
ATTENTION = tuple(
    entry for n in ("q", "k", "v", "o") for entry in (
        _same(f"{n}_proj.weight", f"self_attn.{n}_proj.weight"),
        _same(f"{n}_proj.bias", f"self_attn.{n}_proj.bias", _OUTPUT_BIAS if n == "o" else _ATTENTION_BIAS),
    )
)

GATED_DELTANET = (
    Entry("in_proj_qkvz.weight", GdnKeyHeadGrouping("qkvz"), "linear_attn.in_proj_qkvz.weight"),
    Entry("in_proj_ba.weight", GdnKeyHeadGrouping("ba"), "linear_attn.in_proj_ba.weight"),
    _same("convolution.weight", "linear_attn.conv1d.weight"),
    _same("out_proj.weight", "linear_attn.out_proj.weight"),
    _same("dt_bias", "linear_attn.dt_bias"),
    _same("A_log", "linear_attn.A_log"),
    _same("norm.weight", "linear_attn.norm.weight"),
)

KIMI_DELTA = (
    *(_same(f"{n}_proj.weight", f"linear_attn.{n}_proj.weight") for n in "qkv"),
    *(_same(f"{n}_conv.weight", f"linear_attn.{n}_conv1d.weight") for n in "qkv"),
    *(_same(f"{n}_proj.weight", f"linear_attn.{n}_proj.weight") for n in ("f_a", "f_b", "g_a", "g_b")),
    _same("beta_proj.weight", "linear_attn.b_proj.weight"),
    _same("o_proj.weight", "linear_attn.o_proj.weight"),
    _same("dt_bias", "linear_attn.dt_bias"),
    _same("A_log", "linear_attn.A_log"),
    _same("norm.weight", "linear_attn.o_norm.weight"),
)

MIXERS: dict[str, tuple[Entry, ...]] = {
    "full_attention": ATTENTION,
    "sliding_attention": ATTENTION,
    "gated_deltanet": GATED_DELTANET,
    "kimi_delta_attention": KIMI_DELTA,
}

BLOCK = (
    _same("input_layernorm.weight", "input_layernorm.weight"),
    _same("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    *(_same(f"mlp.{n}_proj.weight", f"mlp.{n}_proj.weight") for n in ("gate", "up", "down")),
)

TOP = (
    _same(EMBEDDINGS, EMBEDDINGS),
    _same(FINAL_NORM, FINAL_NORM),
    _same(LM_HEAD, LM_HEAD, lambda config: not config.tie_word_embeddings),
)


def block_prefix(index: int) -> str:
    return f"{BLOCK_PREFIX}{index}."


def mixer_prefix(index: int, choice: StochasticChoice | None) -> str:
    """Where block `index`'s converted mixer lives: `mixer.`, or `mixer.mixers.{main}.` in a supernet."""
    return block_prefix(index) + ("mixer." if choice is None else f"mixer.mixers.{choice.main}.")


def unused_mixer_prefixes(stochastic: tuple[StochasticChoice | None, ...]) -> tuple[str, ...]:
    """The tensor name prefixes of the supernet mixers that are not converted (not used at inference)."""
    return tuple(f"{block_prefix(index)}mixer.mixers.{name}." for index, choice in enumerate(stochastic)
                 if choice is not None for name in choice.others)


def build_apriel2_rows(config: HybridLinearConfig, stochastic: tuple[StochasticChoice | None, ...] | None = None
                       ) -> list[MapRow]:
    """Apriel2 names <-> canonical names for `config`, each layer's converters bound to that layer's config (its
    head counts decide the Gated DeltaNet row grouping). `stochastic`: per layer, the supernet choice (None: none)."""
    choices = stochastic or (None,) * config.num_hidden_layers
    rows = instantiate(TOP[:1], config)
    for index, layer_type in enumerate(config.mixer_types):
        layer = layer_config(config, index)
        rows += instantiate(MIXERS[layer_type], layer, mixer_prefix(index, choices[index]), layer_prefix(index))
        rows += instantiate(BLOCK, layer, block_prefix(index), layer_prefix(index))
    return rows + instantiate(TOP[1:], config)


__all__ = ["build_apriel2_rows", "unused_mixer_prefixes", "mixer_prefix", "block_prefix", "MIXERS"]

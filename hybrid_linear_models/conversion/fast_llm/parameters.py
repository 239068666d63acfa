"""Fast-LLM's parameters, written once: for each module of a Fast-LLM GPT model (embeddings, block norms, each
mixer, the MLP, the head), its parameters in Fast-LLM's definition order, each with

- the converter and canonical (our Hugging Face) names it maps to: the name map of both `fast_llm` readers and the
  writer (`name_map_entries`);
- whether Fast-LLM gives it weight decay and whether it is tensor-parallel (has a dimension Fast-LLM can split over
  heads, independent of the actual parallelism): the order of the `distributed` format's flat buffer, which sorts
  each stage's parameters by these two flags (`distributed.stage_layout`).

Names are relative to `decoder.{i}.` inside a block. A new mixer is one more table in `MIXERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, SPLIT_HALVES, TRANSPOSE, Converter, GdnKeyHeadGrouping
from ..hf_layout import EMBEDDINGS, FINAL_NORM, LM_HEAD, layer_config, layer_prefix
from ..name_maps import Entry, MapRow, instantiate

Rule = Callable[[HybridLinearConfig], bool]
ALWAYS: Rule = lambda config: True  # noqa: E731
NEVER: Rule = lambda config: False  # noqa: E731
_GDN_HEADS: Rule = lambda config: config.gdn_num_value_heads > 1  # noqa: E731
_KDA_HEADS: Rule = lambda config: config.kda_num_heads > 1  # noqa: E731


@dataclass(frozen=True)
class Parameter:
    """One Fast-LLM parameter: its name, how it maps to canonical tensors, and its flags in Fast-LLM's stage order.
    `when` restricts it to some configs (the output weight exists only when untied)."""

    name: str
    converter: Converter
    canonical: str | tuple[str, ...]
    weight_decay: bool = True
    tensor_parallel: Rule = ALWAYS
    when: Rule | None = None

    def present(self, config: HybridLinearConfig) -> bool:
        return self.when is None or self.when(config)


def _same(name: str, canonical: str, weight_decay: bool = True, tensor_parallel: Rule = ALWAYS) -> Parameter:
    return Parameter(name, IDENTITY, canonical, weight_decay, tensor_parallel)


EMBEDDINGS_PARAMETERS = (_same("embeddings.word_embeddings_weight", EMBEDDINGS),)

HEAD_PARAMETERS = (
    _same("head.final_norm.weight", FINAL_NORM, weight_decay=False, tensor_parallel=NEVER),
    Parameter("head.output_weights", IDENTITY, LM_HEAD, when=lambda config: not config.tie_word_embeddings),
)

BLOCK_NORMS = (
    _same("norm_1.weight", "input_layernorm.weight", weight_decay=False, tensor_parallel=NEVER),
    _same("norm_2.weight", "post_attention_layernorm.weight", weight_decay=False, tensor_parallel=NEVER),
)

# Biases (Fast-LLM's `{layer}.bias`, right after the layer's weight) have no weight decay and are tensor-parallel
# when the layer's output dimension is split: not for the output projections (dense, layer_2), whose output is the
# hidden size (fast_llm/layers/common/linear/config.py, AffineLinearConfig.get_layer).
_MLP_BIAS: Rule = lambda config: bool(config.mlp_bias)  # noqa: E731
_ATTENTION_BIAS: Rule = lambda config: bool(config.attention_bias)  # noqa: E731


def _bias(name: str, converter: Converter, canonical: str | tuple[str, ...], tensor_parallel: Rule,
          when: Rule) -> Parameter:
    return Parameter(name, converter, canonical, weight_decay=False, tensor_parallel=tensor_parallel, when=when)


MLP = (
    Parameter("mlp.layer_1.weight", SPLIT_HALVES, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # gate, up rows
    _bias("mlp.layer_1.bias", SPLIT_HALVES, ("mlp.gate_proj.bias", "mlp.up_proj.bias"), ALWAYS, _MLP_BIAS),
    Parameter("mlp.layer_2.weight", TRANSPOSE, "mlp.down_proj.weight"),  # stored (intermediate, hidden)
    _bias("mlp.layer_2.bias", IDENTITY, "mlp.down_proj.bias", NEVER, _MLP_BIAS),
)

_KV_HEADS: Rule = lambda config: config.num_key_value_heads > 1  # noqa: E731  (MQA: key_value is not split)
ATTENTION = (
    _same("mixer.query.weight", "self_attn.q_proj.weight"),
    _bias("mixer.query.bias", IDENTITY, "self_attn.q_proj.bias", ALWAYS, _ATTENTION_BIAS),
    Parameter("mixer.key_value.weight", SPLIT_HALVES, ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              tensor_parallel=_KV_HEADS),
    _bias("mixer.key_value.bias", SPLIT_HALVES, ("self_attn.k_proj.bias", "self_attn.v_proj.bias"), _KV_HEADS,
          _ATTENTION_BIAS),
    _same("mixer.dense.weight", "self_attn.o_proj.weight"),
    _bias("mixer.dense.bias", IDENTITY, "self_attn.o_proj.bias", NEVER, _ATTENTION_BIAS),
)

GATED_DELTANET = (
    Parameter("mixer.in_proj_qkvz.weight", GdnKeyHeadGrouping("qkvz"), "linear_attn.in_proj_qkvz.weight",
              tensor_parallel=_GDN_HEADS),
    Parameter("mixer.in_proj_ba.weight", GdnKeyHeadGrouping("ba"), "linear_attn.in_proj_ba.weight",
              tensor_parallel=_GDN_HEADS),
    _same("mixer.convolution.weight", "linear_attn.conv1d.weight", tensor_parallel=_GDN_HEADS),  # flat [Q | K | V]
    _same("mixer.out_proj.weight", "linear_attn.out_proj.weight", tensor_parallel=_GDN_HEADS),
    _same("mixer.dt_bias", "linear_attn.dt_bias", weight_decay=False, tensor_parallel=_GDN_HEADS),
    _same("mixer.A_log", "linear_attn.A_log", weight_decay=False, tensor_parallel=_GDN_HEADS),
    _same("mixer.norm.weight", "linear_attn.norm.weight", weight_decay=False, tensor_parallel=NEVER),
)

KIMI_DELTA = (
    *(_same(f"mixer.{n}_proj.weight", f"linear_attn.{n}_proj.weight", tensor_parallel=_KDA_HEADS) for n in "qkv"),
    *(_same(f"mixer.{n}_conv.weight", f"linear_attn.{n}_conv1d.weight", tensor_parallel=_KDA_HEADS) for n in "qkv"),
    _same("mixer.f_a_proj.weight", "linear_attn.f_a_proj.weight", tensor_parallel=NEVER),  # (head_dim, hidden)
    _same("mixer.f_b_proj.weight", "linear_attn.f_b_proj.weight", tensor_parallel=_KDA_HEADS),
    _same("mixer.g_a_proj.weight", "linear_attn.g_a_proj.weight", tensor_parallel=NEVER),
    _same("mixer.g_b_proj.weight", "linear_attn.g_b_proj.weight", tensor_parallel=_KDA_HEADS),
    _same("mixer.beta_proj.weight", "linear_attn.b_proj.weight", tensor_parallel=_KDA_HEADS),
    _same("mixer.o_proj.weight", "linear_attn.o_proj.weight", tensor_parallel=_KDA_HEADS),
    _same("mixer.dt_bias", "linear_attn.dt_bias", weight_decay=False, tensor_parallel=_KDA_HEADS),
    _same("mixer.A_log", "linear_attn.A_log", weight_decay=False, tensor_parallel=_KDA_HEADS),
    _same("mixer.norm.weight", "linear_attn.o_norm.weight", weight_decay=False, tensor_parallel=NEVER),
)

MIXERS: dict[str, tuple[Parameter, ...]] = {
    "full_attention": ATTENTION,
    "sliding_attention": ATTENTION,
    "gated_deltanet": GATED_DELTANET,
    "kimi_delta_attention": KIMI_DELTA,
}


def block_definition_order(layer_type: str) -> tuple[Parameter, ...]:
    """A block's parameters in Fast-LLM's definition order (norms, mixer, MLP): the distributed buffer's order
    before its stable sort."""
    return BLOCK_NORMS + MIXERS[layer_type] + MLP


def block_name_map_order(layer_type: str) -> tuple[Parameter, ...]:
    """A block's parameters in the order the name map lists them (mixer first; the written files' order)."""
    return MIXERS[layer_type] + BLOCK_NORMS + MLP


def name_map_entries(parameters: tuple[Parameter, ...]) -> tuple[Entry, ...]:
    return tuple(Entry(p.name, p.converter, p.canonical, p.when) for p in parameters)


def block_prefix(index: int) -> str:
    return f"decoder.{index}."


def build_fast_llm_rows(config: HybridLinearConfig) -> list[MapRow]:
    """Fast-LLM parameter names <-> canonical names for `config`, layer by layer, each layer's converters bound to
    that layer's own config (its head counts decide the Gated DeltaNet row grouping)."""
    rows = instantiate(name_map_entries(EMBEDDINGS_PARAMETERS), config)
    for index, layer_type in enumerate(config.layer_types):
        rows += instantiate(name_map_entries(block_name_map_order(layer_type)), layer_config(config, index),
                            block_prefix(index), layer_prefix(index))
    rows += instantiate(name_map_entries(HEAD_PARAMETERS), config)
    return rows


__all__ = ["Parameter", "MIXERS", "EMBEDDINGS_PARAMETERS", "HEAD_PARAMETERS", "BLOCK_NORMS", "MLP",
           "block_definition_order", "block_name_map_order", "name_map_entries", "block_prefix", "build_fast_llm_rows"]

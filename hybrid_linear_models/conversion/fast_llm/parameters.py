"""Fast-LLM's parameters, written once: for each module of a Fast-LLM GPT model (embeddings, block norms, the MLP,
the head; each mixer's table is in its record, `mixers.py`), its parameters in Fast-LLM's definition order, each with

- the converter and canonical (our Hugging Face) names it maps to: the name map of both `fast_llm` readers and the
  writer (`name_map_entries`);
- whether Fast-LLM gives it weight decay and whether it is tensor-parallel (`parameter_spec.Parameter`): the order
  of the `distributed` format's flat buffer, which sorts each stage's parameters by these two flags
  (`distributed.stage_layout`).

Names are relative to `decoder.{i}.` inside a block.
"""

from __future__ import annotations

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, SPLIT_HALVES, TRANSPOSE
from ..errors import ConversionError
from ..hf_layout import EMBEDDINGS, FINAL_NORM, LM_HEAD, layer_config, layer_prefix
from ..name_maps import Entry, MapRow, instantiate
from .mixers import mixer_of_layer_type
from .parameter_spec import ALWAYS, NEVER, Parameter, Rule, bias, same

EMBEDDINGS_PARAMETERS = (same("embeddings.word_embeddings_weight", EMBEDDINGS),)

HEAD_PARAMETERS = (
    same("head.final_norm.weight", FINAL_NORM, weight_decay=False, tensor_parallel=NEVER),
    Parameter("head.output_weights", IDENTITY, LM_HEAD, when=lambda config: not config.tie_word_embeddings),
)

BLOCK_NORMS = (
    same("norm_1.weight", "input_layernorm.weight", weight_decay=False, tensor_parallel=NEVER),
    same("norm_2.weight", "post_attention_layernorm.weight", weight_decay=False, tensor_parallel=NEVER),
)

_MLP_BIAS: Rule = lambda config: bool(config.mlp_bias)  # noqa: E731
MLP = (
    Parameter("mlp.layer_1.weight", SPLIT_HALVES, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # gate, up rows
    bias("mlp.layer_1.bias", SPLIT_HALVES, ("mlp.gate_proj.bias", "mlp.up_proj.bias"), ALWAYS, _MLP_BIAS),
    Parameter("mlp.layer_2.weight", TRANSPOSE, "mlp.down_proj.weight"),  # stored (intermediate, hidden)
    bias("mlp.layer_2.bias", IDENTITY, "mlp.down_proj.bias", NEVER, _MLP_BIAS),
)


def mixer_parameters(layer_type: str) -> tuple[Parameter, ...]:
    """The parameter table of the Fast-LLM mixer our `layer_type` is written as."""
    mixer = mixer_of_layer_type(layer_type)
    if mixer is None:
        raise ConversionError(f"layer type {layer_type!r} has no Fast-LLM mixer; convert to the hf format instead.")
    return mixer.parameters


def block_definition_order(layer_type: str) -> tuple[Parameter, ...]:
    """A block's parameters in Fast-LLM's definition order (norms, mixer, MLP): the distributed buffer's order
    before its stable sort."""
    return BLOCK_NORMS + mixer_parameters(layer_type) + MLP


def block_name_map_order(layer_type: str) -> tuple[Parameter, ...]:
    """A block's parameters in the order the name map lists them (mixer first; the written files' order)."""
    return mixer_parameters(layer_type) + BLOCK_NORMS + MLP


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


__all__ = ["Parameter", "EMBEDDINGS_PARAMETERS", "HEAD_PARAMETERS", "BLOCK_NORMS", "MLP", "mixer_parameters",
           "block_definition_order", "block_name_map_order", "name_map_entries", "block_prefix", "build_fast_llm_rows"]

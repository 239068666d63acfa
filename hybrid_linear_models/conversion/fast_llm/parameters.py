"""Fast-LLM's parameters, written once: for each module of a Fast-LLM GPT model (embeddings, block norms, the head;
each mixer's and each MLP's table is in its record, `mixers.py` and `mlps.py`), its parameters in Fast-LLM's
definition order, each with

- the converter and canonical (our Hugging Face) names it maps to: the name map of both `fast_llm` readers and the
  writer (`name_map_entries`);
- whether Fast-LLM gives it weight decay and whether it is tensor-parallel (`parameter_spec.Parameter`): the order
  of the `distributed` format's flat buffer, which sorts each stage's parameters by these two flags
  (`distributed.stage_layout`).

Names are relative to `decoder.{i}.` inside a block.
"""

from __future__ import annotations

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY
from ..errors import ConversionError
from ..hf_layout import EMBEDDINGS, FINAL_NORM, LM_HEAD, layer_config, layer_prefix
from ..name_maps import Entry, MapRow, instantiate
from .mixers import mixer_of_layer_type
from .mlps import mlp_of_type, our_mlp_type
from .parameter_spec import NEVER, Parameter, same

EMBEDDINGS_PARAMETERS = (same("embeddings.word_embeddings_weight", EMBEDDINGS),)

HEAD_PARAMETERS = (
    same("head.final_norm.weight", FINAL_NORM, weight_decay=False, tensor_parallel=NEVER),
    Parameter("head.output_weights", IDENTITY, LM_HEAD, when=lambda config: not config.tie_word_embeddings),
)

# Fast-LLM's MTP head d + 1 (d = 0..prediction_heads - 2), beside its block: a final norm (its output weight is the
# first head's, tied, and not stored again)
MTP_HEAD_PARAMETERS = (same("final_norm.weight", "weight", weight_decay=False, tensor_parallel=NEVER),)
MTP_PREFIX = "mtp."  # our LM's attribute (mtp_parallel_heads.py: `mtp.layers.{d}.*`, `mtp.norms.{d}.weight`)

BLOCK_NORMS = (
    same("norm_1.weight", "input_layernorm.weight", weight_decay=False, tensor_parallel=NEVER),
    same("norm_2.weight", "post_attention_layernorm.weight", weight_decay=False, tensor_parallel=NEVER),
)

def mixer_parameters(layer_type: str) -> tuple[Parameter, ...]:
    """The parameter table of the Fast-LLM mixer our `layer_type` is written as."""
    mixer = mixer_of_layer_type(layer_type)
    if mixer is None:
        raise ConversionError(f"layer type {layer_type!r} has no Fast-LLM mixer; convert to the hf format instead.")
    return mixer.parameters


def mlp_parameters(mlp_type: str) -> tuple[Parameter, ...]:
    """The parameter table of the Fast-LLM MLP our `mlp_type` is written as."""
    mlp = mlp_of_type(mlp_type)
    if mlp is None:
        raise ConversionError(f"MLP type {mlp_type!r} has no Fast-LLM MLP; convert to the hf format instead.")
    return mlp.parameters


def block_definition_order(config: HybridLinearConfig, index: int) -> tuple[Parameter, ...]:
    """Block `index`'s parameters in Fast-LLM's definition order (norms, mixer, MLP): the distributed buffer's order
    before its stable sort."""
    return BLOCK_NORMS + mixer_parameters(config.mixer_types[index]) + mlp_parameters(our_mlp_type(config, index))


def block_name_map_order(config: HybridLinearConfig, index: int) -> tuple[Parameter, ...]:
    """Block `index`'s parameters in the order the name map lists them (mixer first; the written files' order)."""
    return mixer_parameters(config.mixer_types[index]) + BLOCK_NORMS + mlp_parameters(our_mlp_type(config, index))


def name_map_entries(parameters: tuple[Parameter, ...]) -> tuple[Entry, ...]:
    return tuple(Entry(p.name, p.converter, p.canonical, p.when) for p in parameters)


def block_prefix(index: int) -> str:
    return f"decoder.{index}."


def mtp_block_prefix(index: int) -> str:
    return f"multi_token_prediction.blocks.{index}."


def mtp_head_prefix(index: int) -> str:
    return f"multi_token_prediction.heads.{index}."


def build_fast_llm_rows(config: HybridLinearConfig) -> list[MapRow]:
    """Fast-LLM parameter names <-> canonical names for `config`, layer by layer, each layer's converters bound to
    that layer's own config (its head counts decide the Gated DeltaNet row grouping)."""
    rows = instantiate(name_map_entries(EMBEDDINGS_PARAMETERS), config)
    for index in range(len(config.mixer_types)):
        rows += instantiate(name_map_entries(block_name_map_order(config, index)), layer_config(config, index),
                            block_prefix(index), layer_prefix(index))
    rows += instantiate(name_map_entries(HEAD_PARAMETERS), config)
    last = config.num_hidden_layers - 1  # the MTP heads' blocks are copies of the last one (mtp_parallel_heads)
    for index in range(config.num_mtp_layers):
        rows += instantiate(name_map_entries(block_name_map_order(config, last)), layer_config(config, last),
                            mtp_block_prefix(index), f"{MTP_PREFIX}layers.{index}.")
        rows += instantiate(name_map_entries(MTP_HEAD_PARAMETERS), config, mtp_head_prefix(index),
                            f"{MTP_PREFIX}norms.{index}.")
    return rows


__all__ = ["Parameter", "EMBEDDINGS_PARAMETERS", "HEAD_PARAMETERS", "MTP_HEAD_PARAMETERS", "BLOCK_NORMS",
           "mixer_parameters", "mlp_parameters", "block_definition_order", "block_name_map_order", "name_map_entries",
           "block_prefix", "mtp_block_prefix", "mtp_head_prefix", "build_fast_llm_rows"]

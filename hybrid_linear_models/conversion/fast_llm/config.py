"""Fast-LLM model config (metadata.yaml `config.base_model`) <-> `HybridLinearConfig`.

The decoder (`fixed`: one block repeated; `pattern`: named `blocks` and a `pattern` of their names), each block's
mixer (read and written by its record in `mixers.py`), MLP and norm, the embeddings and the head. Fast-LLM omits
fields left at their default; the defaults assumed are documented in `metadata_fields.py` and in each mixer's module.
Sizes whose default we cannot vouch for must be present. Every field is either mapped, checked against the one value
our model supports, or known to be training-only; anything else is an error naming the field (its dotted path names
the Fast-LLM block), never a silent approximation.

Blocks that differ become the flat fields (defaults) plus `per_layer_config` overrides: each group of related fields
(one mixer's, or a field checked alone) takes the setting most layers have, from one and the same layer.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from ...configuration_hybrid_linear import (
    BLOCK_FIELDS,
    DEFAULT_MLP_TYPE,
    MAX_LAYERS,
    MIXER_FIELDS,
    MLP_FIELDS,
    PARALLEL_MTP_TYPE,
    HybridLinearConfig,
)
from ..errors import ConversionError
from ..hf_layout import distinct_layers, layer_config, layer_settings
from ..pipeline import TensorCensus
from ..untrusted import brief, clip
from .metadata_fields import DEFAULT_NORM_EPS, MetadataFields
from .mixers import FAST_LLM_MIXERS, mixer_of_layer_type
from .mlps import ACTIVATION_FROM_HF, ACTIVATION_TO_HF, FAST_LLM_MLPS, mlp_of_type, our_mlp_type

logger = logging.getLogger(__name__)

FAST_LLM_VERSION = "0.4.0"

_NORM_SOURCE = "normalization.epsilon"  # rms_norm_eps: the block norms' epsilon (checked alone)


def _mixer_settings(mixer: MetadataFields) -> tuple[str, str, dict[str, Any], dict[str, str], dict[str, str]]:
    """(Fast-LLM mixer type, our layer type, our fields, each field's defaults group, each field's Fast-LLM key) of
    one block's mixer."""
    mixer_type = mixer.string("type", "attention")
    record = FAST_LLM_MIXERS.get(mixer_type)
    if record is None:
        kinds = ", ".join(m.description for m in FAST_LLM_MIXERS.values())
        raise ConversionError(
            f"metadata.yaml: {mixer.where('type')} = {brief(mixer_type)}: unknown mixer type; this converter "
            f"supports {', '.join(sorted(FAST_LLM_MIXERS))} ({kinds})."
        )
    layer_type, settings = record.read(mixer)
    return (mixer_type, layer_type, settings, {field: record.field_group(field) for field in settings},
            {field: record.field_sources.get(field, "mixer") for field in settings})


def _mlp_settings(mlp: MetadataFields) -> tuple[str, dict[str, Any], dict[str, str], dict[str, str]]:
    """(our MLP type, our fields, each field's defaults group, each field's Fast-LLM key) of one block's MLP."""
    mlp_type = mlp.string("type", "mlp")
    record = FAST_LLM_MLPS.get(mlp_type)
    if record is None:
        raise ConversionError(f"metadata.yaml: {mlp.where('type')} = {brief(mlp_type)} is not supported; this "
                              f"converter reads the MLP types {', '.join(sorted(FAST_LLM_MLPS))}.")
    fields = record.read(mlp)
    return (record.mlp_type, fields, {name: record.field_group(name) for name in fields},
            {name: record.field_sources[name] for name in fields})


def _rms_norm_eps(norm: MetadataFields, what: str) -> float:
    """The epsilon of a block or final norm, which must be a plain (not zero-centred) RMSNorm."""
    norm.expect("type", ("rms_norm",), None, f"{what} must be RMSNorm; Fast-LLM's default is LayerNorm")
    norm.expect("zero_centered", (False,), False, "zero-centred norms")
    eps = float(norm.number("epsilon", DEFAULT_NORM_EPS, positive=True))
    norm.sub("weight").finish()
    norm.finish()
    return eps


def _block_settings(block: MetadataFields) -> dict[str, Any]:
    block.expect("type", ("decoder", None), None, "the block type")
    mixer_type, layer_type, settings, groups, sources = _mixer_settings(block.sub("mixer"))
    mlp_type, mlp_fields, mlp_groups, mlp_sources = _mlp_settings(block.sub("mlp"))
    eps = _rms_norm_eps(block.sub("normalization"), "the block norm")
    block.finish()
    return {"mixer_type": mixer_type, "layer_type": layer_type, "mlp_type": mlp_type, "path": block.path,
            "fields": {**settings, **mlp_fields, "rms_norm_eps": eps},  # every per-layer field of ours it sets
            "groups": {**groups, **mlp_groups, "rms_norm_eps": "rms_norm_eps"},
            "sources": {**sources, **mlp_sources, "rms_norm_eps": _NORM_SOURCE}}


def _num_blocks(decoder: MetadataFields) -> int:
    num_blocks = decoder.integer("num_blocks", minimum=1)
    if decoder.census is not None:  # before any per-block list is built
        decoder.census.check_block_count(num_blocks, f"metadata.yaml: {decoder.where('num_blocks')} is "
                                                     f"{brief(num_blocks)}")
    return num_blocks


def _decoder_blocks(decoder: MetadataFields) -> list[tuple[str, dict[str, Any]]]:
    """(block name, settings) per layer, for `pattern` and `fixed` decoders."""
    decoder_type = decoder.string("type", "fixed")
    num_blocks = _num_blocks(decoder)
    if decoder_type == "fixed":
        block = _block_settings(decoder.sub("block"))
        decoder.finish()
        return [("block", block)] * num_blocks
    if decoder_type != "pattern":
        raise ConversionError(f"metadata.yaml: {decoder.where('type')} = {brief(decoder_type)} is not supported; use a "
                              "'pattern' or 'fixed' decoder.")
    blocks_field = decoder.sub("blocks")
    pattern = decoder.sequence("pattern", item=str, non_empty=True)
    used = set(pattern[: num_blocks])  # (a block no layer uses is never built by Fast-LLM, which warns: skipped)
    settings = {}
    for name in blocks_field.data:
        if name in used:
            settings[name] = _block_settings(blocks_field.sub(name))
        else:
            blocks_field.get(name)
    blocks_field.finish()
    missing = [name for name in pattern if name not in settings]
    if missing:
        raise ConversionError(f"metadata.yaml: {decoder.where('pattern')} names block(s) {brief(missing)} that "
                              f"{blocks_field.path} does not define")
    decoder.finish()
    return pattern_layers(pattern, settings, num_blocks)


def pattern_layers(pattern: list[str], blocks: dict[str, Any], num_blocks: int) -> list[tuple[str, Any]]:
    """(block name, block) per layer of a pattern decoder: the pattern repeated over num_blocks layers (every name in
    it defined in `blocks`; the readers check that first, with their own file's message)."""
    return [(pattern[i % len(pattern)], blocks[pattern[i % len(pattern)]]) for i in range(num_blocks)]


def _defaults_and_overrides(layers: list[tuple[str, dict[str, Any]]], fixed: dict[str, Any]
                            ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The flat fields and, per layer, the fields where it differs from them: HybridLinearConfig's defaults plus
    `per_layer_config`. Each group of related fields takes the setting most layers have (ties: the first layer's);
    `fixed` fields are given."""
    # Layers of one block share its settings: each distinct block is grouped once, weighted by its layer count
    # (a pattern of a few blocks repeated over thousands of layers costs a few blocks' work).
    layer_count: dict[int, list] = {}  # id(block) -> [block, layers with it], in order of first appearance
    for _, block in layers:
        layer_count.setdefault(id(block), [block, 0])[1] += 1
    counts: dict[str, dict[str, list]] = {}  # group -> repr(setting) -> [setting, layers with it]
    for block, count in layer_count.values():
        groups: dict[str, dict[str, Any]] = {}
        for field, value in block["fields"].items():
            groups.setdefault(block["groups"][field], {})[field] = value
        for group, setting in groups.items():
            counts.setdefault(group, {}).setdefault(repr(sorted(setting.items())), [setting, 0])[1] += count
    defaults: dict[str, Any] = {}
    for settings in counts.values():
        defaults.update(max(settings.values(), key=lambda entry: entry[1])[0])
    defaults.update(fixed)
    differing = {key: {field: value for field, value in block["fields"].items() if value != defaults[field]}
                 for key, (block, _) in layer_count.items()}
    overrides = {index: dict(differing[id(block)]) for index, (_, block) in enumerate(layers) if differing[id(block)]}
    return defaults, overrides


def _block_alone_error(block: dict[str, Any], shared: dict[str, Any]) -> str | None:
    """HybridLinearConfig's objection to one block's settings alone (a one-layer model), or None."""
    try:
        HybridLinearConfig(**shared, **block["fields"], layer_types=[block["layer_type"]],
                           mlp_types=[block["mlp_type"]])
    except (ValueError, TypeError) as error:
        return str(error).removeprefix("Invalid HybridLinearConfig: ")
    return None


def _config_error(error: Exception, layers: list[tuple[str, dict[str, Any]]], shared: dict[str, Any]
                  ) -> ConversionError:
    """HybridLinearConfig's message, naming the Fast-LLM block at fault and the Fast-LLM keys of the fields it names.
    A flat field's message does not say which layer its value came from (the flat fields are the defaults most
    blocks share), so each distinct block is first checked alone; failing that, a per-layer message names the layer."""
    for index, (name, block) in enumerate(layers):
        if any(other[1] is block for other in layers[:index]):
            continue  # a block repeated by the pattern: checked once
        message = _block_alone_error(block, shared)
        if message is not None:
            break
    else:
        message = str(error)
        match = re.search(r"per_layer_config\[(\d+)\]", message)
        if not (match and int(match.group(1)) < len(layers)):
            return ConversionError(f"metadata.yaml describes a model HybridLinearConfig rejects: {clip(message, 600)}")
        index = int(match.group(1))
        block = layers[index][1]
    named = [f"{field} is {block['path']}.{source}" for field, source in block["sources"].items()
             if re.search(rf"\b{field}\b", message)]
    return ConversionError(f"metadata.yaml: Fast-LLM block {block['path']} (layer {index}) describes a layer "
                           f"HybridLinearConfig rejects: {clip(message, 600).rstrip('.')}"
                           + (f" ({'; '.join(named)})" if named else "") + ".")


def _note_loss_coefficients(head: MetadataFields, mtp_layers: int) -> None:
    """Fast-LLM's `prediction_loss_coefficient` (training only: each head's loss weight, the next-token head's first)
    is not carried, as this model's MTP loss is `mtp_loss_weight` times the heads' mean loss, added to the next-token
    loss (off unless asked); one line says which weight trains as Fast-LLM does."""
    coefficients = head.get("prediction_loss_coefficient")
    if coefficients is None or not mtp_layers:
        return
    if (not isinstance(coefficients, list) or len(coefficients) != mtp_layers + 1
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0
                       for c in coefficients) or not coefficients[0] > 0):
        raise ConversionError(f"metadata.yaml: {head.where('prediction_loss_coefficient')} is {brief(coefficients)}; "
                              f"it should be a list of {mtp_layers + 1} finite weights >= 0 (one per prediction head, "
                              "the next-token head's first and > 0).")
    weight = sum(coefficients[1:]) / coefficients[0]
    exact = len(set(coefficients[1:])) == 1 and coefficients[0] == 1
    logger.warning(f"metadata.yaml: {head.where('prediction_loss_coefficient')} = {brief(coefficients)} (training "
                   f"only) is not carried; to train the MTP heads as Fast-LLM does, pass mtp_loss_weight={weight:g}"
                   + ("" if exact else " (the same total weight; the heads' own weights are not kept)") + ".")


def fast_llm_to_hybrid_config(base_model: Mapping[str, Any], weights_hint: str = "",
                              census: TensorCensus | None = None) -> HybridLinearConfig:
    """Builds our config from Fast-LLM's `config.base_model`. `weights_hint` is appended to the message when
    `tied_embedding_weight` is missing (the reader knows whether an output weight was saved). With a `census` of the
    stored tensors, every size is checked against it as it is read, before any per-block table is built."""
    base = MetadataFields(base_model, "config.base_model", census)
    peft = base.sub("peft")
    peft.expect("type", ("none", None), None, "a PEFT (LoRA) adapter must be merged before export")
    peft.finish()
    embeddings = base.sub("embeddings")
    vocab_size = embeddings.size("vocab_size")
    position = embeddings.sub("position_embeddings")
    position.expect("enabled", (False, None), None, "absolute position embeddings")
    position.finish()
    embeddings.expect("embedding_scale", (1.0,), 1.0, "scaled embeddings")
    max_positions = embeddings.integer("num_position_embeddings", None, minimum=1)
    embeddings.finish()
    head = base.sub("head")
    head.expect("logits_scale_factor", (1.0,), 1.0, "scaled logits")
    head.expect("final_logit_softcap", (None,), None, "logit soft-capping")
    # Fast-LLM's multi-token prediction: the next-token head and prediction_heads - 1 more, each a copy of the last
    # decoder block on that block's input, then a final norm of the head's normalization (mtp_type "fast_llm")
    mtp_layers = head.integer("prediction_heads", 1, minimum=1, maximum=MAX_LAYERS + 1) - 1
    _note_loss_coefficients(head, mtp_layers)
    final_eps = _rms_norm_eps(head.sub("normalization"), "the final norm")
    head.finish()

    layers = _decoder_blocks(base.sub("decoder"))
    layer_types = [block["layer_type"] for _, block in layers]
    mlp_types = [block["mlp_type"] for _, block in layers]

    # The final norm has the flat rms_norm_eps; blocks with another epsilon override it.
    defaults, overrides = _defaults_and_overrides(layers, {"rms_norm_eps": final_eps})
    kwargs: dict[str, Any] = {
        **defaults,
        "vocab_size": vocab_size,
        "hidden_size": base.size("hidden_size"),
        "tie_word_embeddings": base.boolean("tied_embedding_weight", hint=weights_hint),
        "layer_types": layer_types,
        "zero_centered_norms": False,
    }
    for mixer in FAST_LLM_MIXERS.values():  # what no layer set: each mixer's defaults (copies: kwargs are kept)
        for field, value in mixer.config_defaults.items():
            kwargs.setdefault(field, copy.deepcopy(value))
    if any(mlp_type != DEFAULT_MLP_TYPE for mlp_type in mlp_types):  # else left unset: every layer dense
        kwargs["mlp_types"] = mlp_types
    if overrides:
        kwargs["per_layer_config"] = overrides
    if mtp_layers:
        kwargs.update(num_mtp_layers=mtp_layers, mtp_type=PARALLEL_MTP_TYPE)
    if max_positions is not None:
        kwargs["max_position_embeddings"] = max_positions
    base.finish(frozenset({"type"}))
    try:
        return HybridLinearConfig(**kwargs)
    except (ValueError, TypeError) as error:
        shared = {field: kwargs[field] for field in ("vocab_size", "hidden_size", "tie_word_embeddings",
                                                      "zero_centered_norms", "attention_output_gate",
                                                      "attention_qk_norm")}
        raise _config_error(error, layers, shared) from None


def block_path(base_model: Mapping[str, Any], index: int) -> str:
    """The dotted path of the Fast-LLM block of layer `index`, in a `config.base_model` that
    `fast_llm_to_hybrid_config` has read (so its decoder is known to be well formed)."""
    decoder = base_model["decoder"]
    if decoder.get("type", "fixed") == "fixed":
        return "config.base_model.decoder.block"
    pattern = decoder["pattern"]
    return f"config.base_model.decoder.blocks.{clip(pattern[index % len(pattern)], 100)}"


# The HybridLinearConfig fields a Fast-LLM metadata.yaml carries, by the layer types that use them; the others
# (token ids, initializer_range, use_cache, ...) are not part of Fast-LLM's model config and are not written.
# Per-layer values are compared layer by layer (`fast_llm_carried_layer_fields`): every field of the layer's mixer
# (the config's own MIXER_FIELDS, from each mixer's registration) and of its block.
_CARRIED_ALWAYS = ("vocab_size", "hidden_size", "mixer_types", "mlp_types", "num_hidden_layers", "rms_norm_eps",
                   "tie_word_embeddings", "zero_centered_norms", "num_mtp_layers", "mtp_type")


def fast_llm_carried_fields(config: HybridLinearConfig) -> list[str]:
    """The model-wide fields of `config` that its Fast-LLM metadata expresses (and must read back unchanged)."""
    return list(_CARRIED_ALWAYS)


def fast_llm_carried_layer_fields(config: HybridLinearConfig, index: int) -> tuple[str, ...]:
    """The fields of layer `index`'s resolved config that Fast-LLM's block of that layer expresses: its mixer's, its
    MLP's and its block norms' (the config's own MIXER_FIELDS, MLP_FIELDS and BLOCK_FIELDS, from the registrations)."""
    return (tuple(MIXER_FIELDS[config.mixer_types[index]]) + tuple(MLP_FIELDS[our_mlp_type(config, index)])
            + tuple(BLOCK_FIELDS))


# -------------------------------------------------------------------------------------------- -> Fast-LLM


def _unsupported_for_fast_llm(config: HybridLinearConfig) -> list[str]:
    problems = []
    if config.zero_centered_norms:
        problems.append("zero_centered_norms=True (Fast-LLM's RMSNorm is x_hat * w)")
    if config.num_mtp_layers and config.mtp_type != PARALLEL_MTP_TYPE:
        problems.append(f"{config.num_mtp_layers} MTP layer(s) of mtp_type {config.mtp_type!r} (Fast-LLM's MTP heads "
                        f"are copies of the last block on its input, mtp_type {PARALLEL_MTP_TYPE!r}); convert to the "
                        "hf or qwen3_next format")
    for index in distinct_layers(config).values():
        layer, layer_type = layer_config(config, index), config.mixer_types[index]
        mlp_type = our_mlp_type(config, index)
        where = f"layer {index} ({layer_type})"
        mixer, mlp = mixer_of_layer_type(layer_type), mlp_of_type(mlp_type)
        if mixer is None:
            problems.append(f"{where}: Fast-LLM has no mixer for this layer type")
        else:
            problems += [f"{where}: {problem}" for problem in mixer.unsupported(layer)]
        if mlp is None:
            written = ", ".join(f"{m.mlp_type!r} (Fast-LLM's {m.description})" for m in FAST_LLM_MLPS.values())
            problems.append(f"{where}: mlp_types[{index}]={brief(mlp_type)} (this converter writes the MLP types "
                            f"{written})")
        else:
            problems += [f"{where}: {problem}" for problem in mlp.unsupported(layer)]
    return problems


def _norm(eps: float) -> dict[str, Any]:
    return {"type": "rms_norm", "epsilon": eps}


def _block_names(config: HybridLinearConfig) -> dict[str, str]:
    """layer setting -> Fast-LLM block name: the layer type's block name (its mixer's record) for its first setting,
    then `_2`, `_3`, ..."""
    names: dict[str, str] = {}
    used: dict[str, int] = {}
    for setting, index in distinct_layers(config).items():
        layer_type = config.mixer_types[index]
        base = mixer_of_layer_type(layer_type).block_names[layer_type]
        used[base] = used.get(base, 0) + 1
        names[setting] = base if used[base] == 1 else f"{base}_{used[base]}"
    return names


def hybrid_config_to_fast_llm(config: HybridLinearConfig) -> dict[str, Any]:
    """Fast-LLM's `config.base_model` for our config (one named block per distinct layer setting), or a
    ConversionError listing what Fast-LLM cannot express."""
    problems = _unsupported_for_fast_llm(config)
    if problems:
        raise ConversionError("this model cannot be expressed as a Fast-LLM model: " + "; ".join(problems) + ".")
    names = _block_names(config)
    blocks = {}
    for setting, index in distinct_layers(config).items():
        layer = layer_config(config, index)
        blocks[names[setting]] = {
            "type": "decoder",
            "mixer": mixer_of_layer_type(config.mixer_types[index]).write(layer, config.mixer_types[index]),
            "mlp": mlp_of_type(our_mlp_type(config, index)).write(layer),
            "normalization": _norm(layer.rms_norm_eps),
        }
    return {
        "decoder": {"type": "pattern", "blocks": blocks,
                    "pattern": [names[setting] for setting in layer_settings(config)],
                    "num_blocks": config.num_hidden_layers},
        "embeddings": {"vocab_size": config.vocab_size},
        # the final norm's epsilon is the flat default, whatever the blocks override; the MTP heads count the
        # next-token head too
        "head": {"normalization": _norm(config._getattr_without_heterogeneous_validation("rms_norm_eps")),
                 **({"prediction_heads": config.num_mtp_layers + 1} if config.num_mtp_layers else {})},
        "hidden_size": config.hidden_size,
        "peft": {"type": "none"},
        "tied_embedding_weight": bool(config.tie_word_embeddings),
    }


__all__ = ["fast_llm_to_hybrid_config", "hybrid_config_to_fast_llm", "block_path", "fast_llm_carried_fields",
           "fast_llm_carried_layer_fields", "FAST_LLM_VERSION",
           "ACTIVATION_TO_HF", "ACTIVATION_FROM_HF"]

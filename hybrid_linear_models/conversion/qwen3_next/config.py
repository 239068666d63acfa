"""Qwen3-Next's config.json <-> HybridLinearConfig.

Qwen3-Next is the model our family mirrors, so the mapping is a renaming plus the settings Qwen3-Next fixes:

- `layer_types`: "linear_attention" -> "gated_deltanet", "full_attention" -> "full_attention" (without the list,
  Qwen3-Next puts full attention on every `full_attention_interval`-th layer, default 4);
- `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`,
  `linear_conv_kernel_dim` -> `gdn_*`;
- fixed by Qwen3-Next: gated attention (`attention_output_gate`), per-head q/k RMSNorm (`attention_qk_norm`), every
  RMSNorm zero-centred, x_hat * (1 + w) (`zero_centered_norms`), except GDN's gated output norm, x_hat * w * silu(z)
  (`gdn_gate_activation` "silu"), whose epsilon is `rms_norm_eps` too (`gdn_norm_eps`); no MLP biases; one
  `attention_bias` for q, k, v and o_proj (our `attention_output_bias` equal to `attention_bias`);
- GDN's short convolution uses `hidden_act` in Qwen3-Next (ours: silu), so a model with GDN layers needs silu;
- rotary settings (`rope_parameters`, or the older `rope_theta` / `rope_scaling` / `partial_rotary_factor`, default
  0.25) are standardised by transformers' own `Qwen3NextConfig`, so they mean what they mean to transformers;
- MoE: a layer is sparse when `num_experts > 0`, it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step ==
  0` (Qwen3-Next's rule) -> `mlp_types[i] = "sparse_moe"`, else "dense"; the expert fields keep their names;
- multi-token prediction: `mtp_num_hidden_layers` (the released checkpoints' name) or `num_nextn_predict_layers` ->
  `num_mtp_layers` (mtp_head.py; at most one MTP layer per decoder layer), its MLP the first decoder layer's (the MLP
  vLLM builds for Qwen3-Next's MTP layer, by Qwen3-Next's sparsity rule at index 0) -> `mtp_mlp_type`;
  `mtp_use_dedicated_embeddings` must be false (the head shares the model's embedding, as every released checkpoint
  and serving engine has it). The reader checks that the stored `mtp.*` tensors are exactly that head. Written back
  as `mtp_num_hidden_layers` and `mtp_use_dedicated_embeddings`. Without MTP layers in the config, `mtp.*` tensors
  and the other `mtp_*` fields are recorded beside the model's tensors (`extra_tensors`) and written back as found.

Every other field is refused by name unless it is in `IRRELEVANT` (bookkeeping that does not change the math).
Absent fields take Qwen3NextConfig's defaults (`QWEN3_NEXT_DEFAULTS`, pinned by a test against transformers).
"""

from __future__ import annotations

import copy
from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from ...fp8_settings import QUANTIZATION_KEY
from ...shown_values import brief, clip
from ..errors import ConversionError
from ..hf_layout import layer_overrides
from ..hf_style_folder import TOKEN_FIELDS, check_model_type, layer_count, per_layer_names, token_ids
from ..pipeline import TensorCensus
from ..untrusted import Fields

MODEL_TYPE = "qwen3_next"
ARCHITECTURES = ["Qwen3NextForCausalLM"]
LAYER_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "full_attention"}
TO_QWEN3_NEXT_LAYER_TYPES = {ours: theirs for theirs, ours in LAYER_TYPES.items()}

# Qwen3NextConfig's defaults in transformers 5.24 for the fields read here (tests pin them against the class).
QWEN3_NEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}

# Fields that do not change the model's math: bookkeeping of transformers and of the hub.
IRRELEVANT = ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "output_attentions",
              "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
              "label2id", "problem_type", "tokenizer_class", "max_window_layers", "model_type")

_SIZES = {  # Qwen3-Next name -> ours
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings",
    "linear_num_key_heads": "gdn_num_key_heads", "linear_num_value_heads": "gdn_num_value_heads",
    "linear_key_head_dim": "gdn_key_head_dim", "linear_value_head_dim": "gdn_value_head_dim",
    "linear_conv_kernel_dim": "gdn_conv_kernel_size",
}
# Which stored tensors have each size as a dimension: every model's (None), or the tensors of a kind of layer or MLP
# only (a model without it loads in transformers whatever the size says). A size is bounded by the stored weights
# only where such tensors exist; max_position_embeddings sizes no tensor (rotary angles are computed), so never.
_SIZED_BY = {"vocab_size": None, "hidden_size": None, "intermediate_size": "dense",
             **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "head_dim"), "full_attention"),
             **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                              "linear_value_head_dim", "linear_conv_kernel_dim"), "gated_deltanet")}
_ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
_MOE_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts")
_MOE_FLAGS = ("norm_topk_prob", "output_router_logits")
# Qwen3-Next's fixed settings, as our fields must be for `--to qwen3_next`.
FIXED = {"attention_output_gate": True, "attention_qk_norm": True, "zero_centered_norms": True,
         "gdn_gate_activation": "silu", "mlp_bias": False}


def is_carried_field(name: str) -> bool:
    """Multi-token-prediction settings: recorded with mtp.* tensors carried beside a model without MTP layers."""
    return name.startswith("mtp_") or name == "num_nextn_predict_layers"


MTP_LAYER_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3-Next's names for the MTP layers
MTP_EMBEDDINGS_FIELD = "mtp_use_dedicated_embeddings"


def _mtp_layers(fields: Fields, layers: int, label: str) -> int:
    """The MTP layers config.json declares (0: none), from either of its names (which must agree when both are
    given); at most one per decoder layer, so a hostile count is refused before a module is built."""
    counts = {name: fields.integer(name, minimum=0, maximum=layers) for name in MTP_LAYER_FIELDS if fields.has(name)}
    if len(set(counts.values())) > 1:
        raise ConversionError(f"{label}: mtp_num_hidden_layers ({counts['mtp_num_hidden_layers']}) and "
                              f"num_nextn_predict_layers ({counts['num_nextn_predict_layers']}) disagree; keep one.")
    count = next(iter(counts.values()), 0)
    if count and fields.boolean(MTP_EMBEDDINGS_FIELD, False):
        raise ConversionError(f"{label}: mtp_use_dedicated_embeddings is true, and this model's MTP head shares the "
                              "model's embedding (Qwen3-Next's released layout); only false converts.")
    if count:
        unknown = sorted(name for name in fields.data if is_carried_field(name)
                         and name not in (*MTP_LAYER_FIELDS, MTP_EMBEDDINGS_FIELD))
        if unknown:
            raise ConversionError(f"{label}: field(s) {brief(unknown)} are not Qwen3-Next MTP settings this converter "
                                  "knows; they may change the MTP head, so it refuses rather than guess.")
    return count


def _size(fields: Fields, name: str, census: TensorCensus | None) -> int:
    """A positive integer (default Qwen3NextConfig's), no larger than the stored weights (`census`, when given: the
    size of a stored tensor)."""
    return fields.integer(name, QWEN3_NEXT_DEFAULTS[name], minimum=1, maximum=census.elements if census else None,
                          too_large=census.elements_phrase if census else "")


def _layer_types(fields: Fields, layers: int) -> list[str]:
    if not fields.has("layer_types"):
        interval = fields.integer("full_attention_interval", 4, minimum=1)
        return ["gated_deltanet" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if fields.has("full_attention_interval"):
        fields.integer("full_attention_interval", minimum=1)  # superseded by layer_types, as in Qwen3NextConfig
    types = per_layer_names(fields, "layer_types", layers, LAYER_TYPES, "Qwen3-Next layers")
    return [LAYER_TYPES[t] for t in types]


def _rope_parameters(fields: Fields) -> dict:
    """The rotary settings as transformers' Qwen3NextConfig standardises them (legacy top-level keys included)."""
    from transformers import Qwen3NextConfig

    given = {name: fields.get(name) for name in _ROPE_FIELDS if fields.has(name)}
    if given.get("rope_parameters") is not None:
        fields.mapping("rope_parameters")  # a mapping, or one clear line
    try:
        return dict(Qwen3NextConfig(num_hidden_layers=1, **given).rope_parameters)
    except Exception as error:  # noqa: BLE001 - transformers' own checks, of several kinds, on untrusted values
        raise ConversionError(f"{fields.file}: the rotary settings ({', '.join(given) or 'defaults'}) are not valid "
                              f"for Qwen3NextConfig: {clip(' '.join(str(error).split()), 200)}") from None


def _mlp_types(fields: Fields, layers: int, census: TensorCensus | None) -> tuple[list[str], dict[str, Any]]:
    """Each layer's MLP ("dense" / "sparse_moe") by Qwen3-Next's rule, and the expert fields when a layer is sparse
    (only then are they sizes of stored tensors, bounded by the census)."""
    experts = fields.integer("num_experts", QWEN3_NEXT_DEFAULTS["num_experts"], minimum=0)
    step = fields.integer("decoder_sparse_step", 1, minimum=1)
    dense_only = fields.sequence("mlp_only_layers", [], item=int) or []
    for position, index in enumerate(dense_only):
        if not 0 <= index < layers:
            raise ConversionError(f"{fields.file}: mlp_only_layers[{position}] is {index}, not a layer index (0 to "
                                  f"{layers - 1}); fix the list.")
    types = ["sparse_moe" if experts > 0 and i not in dense_only and (i + 1) % step == 0 else "dense"
             for i in range(layers)]
    moe = {}
    if "sparse_moe" in types:
        if fields.get("shared_expert_intermediate_size") == 0:
            raise ConversionError(f"{fields.file}: shared_expert_intermediate_size is 0; Qwen3-Next then still has a "
                                  "shared-expert gate (1, hidden) on a zero-width expert, which this model would have "
                                  "to drop; only models with a shared expert convert.")
        for name in _MOE_SIZES:
            moe[name] = _size(fields, name, census)
        for name in _MOE_FLAGS:
            moe[name] = fields.boolean(name, QWEN3_NEXT_DEFAULTS[name])
        moe["router_aux_loss_coef"] = fields.number("router_aux_loss_coef", QWEN3_NEXT_DEFAULTS["router_aux_loss_coef"])
        if moe["num_experts_per_tok"] > experts:
            raise ConversionError(f"{fields.file}: num_experts_per_tok ({moe['num_experts_per_tok']}) is more than "
                                  f"num_experts ({experts}); fix the config.")
        moe["mlp_types"] = types
    else:  # no sparse layer: the expert fields describe nothing
        for name in (*_MOE_SIZES, *_MOE_FLAGS, "router_aux_loss_coef"):
            fields.get(name)
    return types, moe


def qwen3_next_to_hybrid_config(data: Any, label: str, census: TensorCensus | None = None
                                ) -> tuple[HybridLinearConfig, dict[str, Any]]:
    """A Qwen3-Next config.json (parsed) -> our config, and the multi-token-prediction fields to carry."""
    fields = Fields(data, "", label, missing_is_empty=False)
    check_model_type(fields, MODEL_TYPE, "qwen3_next")
    layers = layer_count(fields, QWEN3_NEXT_DEFAULTS["num_hidden_layers"], census)
    layer_types = _layer_types(fields, layers)
    mlp_types, moe = _mlp_types(fields, layers, census)
    kinds = {*layer_types, *mlp_types}
    kwargs: dict[str, Any] = {"layer_types": layer_types}
    for theirs, ours in _SIZES.items():
        sized = theirs in _SIZED_BY and (_SIZED_BY[theirs] is None or _SIZED_BY[theirs] in kinds)
        kwargs[ours] = _size(fields, theirs, census if sized else None)
    kwargs["hidden_act"] = fields.string("hidden_act", "silu")
    if kwargs["hidden_act"] != "silu" and "gated_deltanet" in layer_types:
        raise ConversionError(f"{label}: hidden_act is {brief(kwargs['hidden_act'])}; Qwen3-Next also applies it "
                              "after GDN's short convolution, where this model uses silu; only 'silu' converts.")
    eps = fields.number("rms_norm_eps", QWEN3_NEXT_DEFAULTS["rms_norm_eps"], positive=True)
    kwargs.update(rms_norm_eps=eps, gdn_norm_eps=eps)  # Qwen3-Next's gated GDN norm uses rms_norm_eps too
    kwargs["initializer_range"] = fields.number("initializer_range", QWEN3_NEXT_DEFAULTS["initializer_range"])
    kwargs["attention_dropout"] = fields.number("attention_dropout", 0.0)
    for name in ("use_cache", "tie_word_embeddings", "attention_bias"):
        kwargs[name] = fields.boolean(name, QWEN3_NEXT_DEFAULTS[name])
    kwargs["attention_output_bias"] = kwargs["attention_bias"]  # Qwen3-Next's switches o_proj's bias too
    kwargs.update(token_ids(fields))
    if fields.get("use_sliding_window", False) is not False:
        raise ConversionError(f"{label}: use_sliding_window is {brief(fields.get('use_sliding_window'))}; Qwen3-Next "
                              "runs full attention (transformers ignores this flag), so only false converts.")
    if fields.get("sliding_window") is not None:
        raise ConversionError(f"{label}: sliding_window is {brief(fields.get('sliding_window'))}; Qwen3-Next has no "
                              "sliding-window layers, so only null converts.")
    kwargs["rope_parameters"] = _rope_parameters(fields)
    kwargs.update(moe)
    kwargs.update(FIXED)
    if fields.get(QUANTIZATION_KEY) is not None:  # FP8 (fp8_settings): the same setting, checked by our config
        kwargs[QUANTIZATION_KEY] = fields.get(QUANTIZATION_KEY)
    mtp_layers = _mtp_layers(fields, layers, label)
    if mtp_layers:
        kwargs.update(num_mtp_layers=mtp_layers, mtp_mlp_type=mlp_types[0])
    carried = {name: fields.get(name) for name in sorted(fields.data) if is_carried_field(name)}
    unknown = fields.unread(IRRELEVANT)
    if unknown:
        raise ConversionError(f"{label}: field(s) {brief(unknown)} are not Qwen3-Next settings this converter knows; "
                              "they may change the model, so it refuses rather than guess. Remove them if they are "
                              "bookkeeping.")
    try:
        return HybridLinearConfig(**kwargs), carried
    except ValueError as error:
        raise ConversionError(f"{label}: not a valid model once mapped: {clip(str(error))}") from None


def _refuse(what: str) -> ConversionError:
    return ConversionError(f"this model does not fit Qwen3-Next: {what}; convert it to the hf format instead.")


def check_fits_qwen3_next(config: HybridLinearConfig) -> None:
    """Refuses, naming the first layer or setting, a model Qwen3-Next's architecture cannot express."""
    for index, layer_type in enumerate(config.mixer_types):
        if layer_type not in TO_QWEN3_NEXT_LAYER_TYPES:
            raise _refuse(f"layer {index} is {layer_type!r}, and Qwen3-Next layers are Gated DeltaNet "
                          "('gated_deltanet') or gated full attention ('full_attention')")
    for index, mlp_type in enumerate(config.mlp_types):
        if mlp_type not in ("dense", "sparse_moe"):
            raise _refuse(f"layer {index}'s MLP is {brief(mlp_type)} (mlp_types[{index}]), and Qwen3-Next's MLPs are "
                          "the gated MLP ('dense') or its sparse MoE ('sparse_moe')")
    for index in range(len(config.mixer_types)):
        overrides = layer_overrides(config, index)
        if overrides:
            raise _refuse(f"layer {index} has its own {', '.join(sorted(overrides))} (per_layer_config), and "
                          "Qwen3-Next has one setting for all layers")
    for name, value in FIXED.items():
        if getattr(config, name) != value:
            raise _refuse(f"{name} is {brief(getattr(config, name))}, and Qwen3-Next has {value!r}")
    if config.attention_output_bias != config.attention_bias:
        raise _refuse(f"attention_output_bias is {config.attention_output_bias} and attention_bias "
                      f"{config.attention_bias}, and Qwen3-Next's attention_bias switches the q, k, v and o_proj "
                      "biases together")
    has_gdn = "gated_deltanet" in config.mixer_types
    if has_gdn and config.gdn_norm_eps != config.rms_norm_eps:
        raise _refuse(f"gdn_norm_eps ({config.gdn_norm_eps}) differs from rms_norm_eps ({config.rms_norm_eps}), and "
                      "Qwen3-Next's gated norm uses rms_norm_eps")
    if config.num_mtp_layers and config.mtp_type != "qwen3_next":
        raise _refuse(f"its {config.num_mtp_layers} MTP layer(s) are of mtp_type {config.mtp_type!r} (copies of the "
                      "last layer on its input), and Qwen3-Next's MTP layer fuses the next token's embedding into "
                      "the last hidden state (mtp_type 'qwen3_next'); the fast_llm format keeps them")
    if config.num_mtp_layers and config.mtp_mlp_type != config.mlp_types[0]:
        raise _refuse(f"the MTP layers' MLP is {brief(config.mtp_mlp_type)} (mtp_mlp_type) and layer 0's "
                      f"{brief(config.mlp_types[0])}, and Qwen3-Next's MTP layer has layer 0's")
    if has_gdn and config.hidden_act != "silu":
        raise _refuse(f"hidden_act is {brief(config.hidden_act)}, and Qwen3-Next applies it after GDN's short "
                      "convolution too, where this model uses silu")


def hybrid_config_to_qwen3_next(config: HybridLinearConfig, carried: dict[str, Any] | None = None
                                ) -> dict[str, Any]:
    """Our config -> the fields of Qwen3NextConfig (plus the carried mtp fields); refuses what does not fit."""
    check_fits_qwen3_next(config)
    out: dict[str, Any] = {theirs: getattr(config, ours) for theirs, ours in _SIZES.items()}
    out.update(
        model_type=MODEL_TYPE, architectures=list(ARCHITECTURES), num_hidden_layers=len(config.mixer_types),
        layer_types=[TO_QWEN3_NEXT_LAYER_TYPES[t] for t in config.mixer_types], hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps, initializer_range=config.initializer_range,
        attention_dropout=config.attention_dropout, use_cache=config.use_cache,
        tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
        rope_parameters=dict(config.rope_parameters), **{name: getattr(config, name) for name in TOKEN_FIELDS},
    )
    mlp_types = config.mlp_types
    if "sparse_moe" in mlp_types:
        out.update({name: getattr(config, name) for name in (*_MOE_SIZES, *_MOE_FLAGS, "router_aux_loss_coef")})
        if config.shared_expert_intermediate_size == 0:
            raise _refuse("the MoE layers have no shared expert (shared_expert_intermediate_size 0), and Qwen3-Next's "
                          "always have one")
        out.update(decoder_sparse_step=1, mlp_only_layers=[i for i, t in enumerate(mlp_types) if t != "sparse_moe"])
    else:
        out.update(num_experts=0, mlp_only_layers=[], decoder_sparse_step=1)
    if config.block_fp8 is not None:  # FP8: the setting as read (module names are the same on both sides)
        out[QUANTIZATION_KEY] = copy.deepcopy(config.block_fp8)
    if config.num_mtp_layers:
        out.update({MTP_LAYER_FIELDS[0]: config.num_mtp_layers, MTP_EMBEDDINGS_FIELD: False})
    out.update(carried or {})
    return out


__all__ = ["qwen3_next_to_hybrid_config", "hybrid_config_to_qwen3_next", "check_fits_qwen3_next",
           "is_carried_field", "QWEN3_NEXT_DEFAULTS", "IRRELEVANT", "MODEL_TYPE", "ARCHITECTURES", "MTP_LAYER_FIELDS",
           "MTP_EMBEDDINGS_FIELD"]

"""Kimi-Linear's config.json <-> HybridLinearConfig.

Two writers produce Kimi-Linear configs: the released checkpoints (hub, `configuration_kimi.py`: `linear_attn_config`
with 1-indexed `kda_layers` / `full_attn_layers`, `first_k_dense_replace`, `num_experts_per_token`, ...) and
transformers' `KimiLinearConfig.save_pretrained` (the same plus `layer_types`, `mlp_layer_types`, `linear_*` and its
alias names). Both are read; where both spellings of one setting are present they must agree (transformers reads one,
the original remote code the other, so a disagreement means two different models: refused, naming both).

What Kimi-Linear's modules compute, and what it becomes here:

- layers: `linear_attention` (KDA) -> "kimi_delta_attention"; `full_attention` (MLA, no RoPE) -> "mla_attention".
  MLPs: `dense` (SwiGLU, `intermediate_size`) -> "dense"; `sparse` (sigmoid-routed MoE with shared experts) ->
  "kimi_moe". Without `mlp_layer_types`, the first `first_k_dense_replace` (default 1) layers are dense and the rest
  sparse; the original code also has `moe_layer_freq` (only 1 converts: transformers ignores it).
- KDA: `num_heads` x `head_dim`, kernel `short_conv_kernel_size`; q/k/v convolutions followed by silu in the original
  code and by `hidden_act` in transformers (so only silu converts), output gate sigmoid (`kda_gate_activation`), its
  norm's epsilon `rms_norm_eps` (`kda_norm_eps`), no gate bias (`kda_gate_bias` false).
- tied embeddings: transformers' KimiLinear never ties (its lm_head is always its own tensor), the original code
  does; a folder with tie_word_embeddings true and a stored lm_head.weight is refused (the two would run different
  models), one without lm_head.weight reads as tied; `--to kimi_linear` refuses tied models.
- every other RMSNorm is plain x_hat * w (`zero_centered_norms` false); no MLP biases.
- MLA: `num_attention_heads`, `kv_lora_rank`, `q_lora_rank` (null: a plain q_proj), `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`, `mla_use_nope`; its q_a_layernorm / kv_a_layernorm at epsilon 1e-6 (their
  classes' default in both codes; `mla_norm_eps`), `attention_bias` on q_a_proj, kv_a_proj_with_mqa and o_proj
  (transformers' KimiLinearAttention; ours puts them there too). transformers' KimiLinear never applies RoPE in
  MLA (what `mla_use_nope: true` means in the original code, and what the released checkpoints use), so an absent
  `mla_use_nope` is taken as true and false is refused; `num_key_value_heads` must equal `num_attention_heads`
  (MLA has one latent KV shared by all heads; transformers repeats its keys by their ratio).
- MoE (Kimi's / DeepSeek-V3's router): `num_experts`, `num_experts_per_token`, `moe_intermediate_size`,
  `num_shared_experts`, `moe_renormalize`, `routed_scaling_factor`, `num_expert_group`, `topk_group`; fixed:
  `moe_router_activation_func` sigmoid and grouped top-k (`use_grouped_topk` false only with one group, where both
  pick the same experts).

Absent fields take transformers' KimiLinearConfig defaults (`KIMI_DEFAULTS`, pinned by a test against the class).
Every field is mapped, checked against the one value we support, or bookkeeping (`IRRELEVANT`); anything else is
refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from ...shown_values import brief, clip
from ..errors import ConversionError
from ..hf_layout import layer_overrides
from ..hf_style_folder import TOKEN_FIELDS, check_model_type, layer_count, per_layer_names, token_ids
from ..pipeline import TensorCensus
from ..untrusted import Fields

MODEL_TYPE = "kimi_linear"
ARCHITECTURES = ["KimiLinearForCausalLM"]
KDA, MLA = "kimi_delta_attention", "mla_attention"
DENSE, KIMI_MOE = "dense", "kimi_moe"
LAYER_TYPES = {"linear_attention": KDA, "full_attention": MLA}  # Kimi's layer_types -> ours
MLP_TYPES = {"dense": DENSE, "sparse": KIMI_MOE}

# transformers 5.24's KimiLinearConfig defaults for the fields read here (a test pins them against the class).
KIMI_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 8, "moe_renormalize": True, "hidden_act": "silu",
    "model_max_length": 1048576, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "num_experts": 256,
    "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4, "output_router_logits": False,
}
FIRST_K_DENSE_DEFAULT = 1  # KimiLinearConfig's, when neither mlp_layer_types nor first_k_dense_replace is given

# Two spellings of one setting: the hub's (and transformers' config.json) name first, transformers' attribute second.
ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "model_max_length": "max_position_embeddings"}
# linear_attn_config's key -> transformers' flat field
LINEAR_FIELDS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                 "short_conv_kernel_size": "linear_conv_kernel_dim"}
_KDA_FIELDS = {"num_heads": "kda_num_heads", "head_dim": "kda_head_dim",
               "short_conv_kernel_size": "kda_conv_kernel_size"}
_MLA_SIZES = {"num_attention_heads": "num_attention_heads", "kv_lora_rank": "kv_lora_rank",
              "qk_nope_head_dim": "qk_nope_head_dim", "v_head_dim": "v_head_dim"}
_MOE_SIZES = {"num_experts": "num_experts", "num_experts_per_token": "num_experts_per_tok",
              "moe_intermediate_size": "moe_intermediate_size", "num_expert_group": "n_group",
              "topk_group": "topk_group", "num_shared_experts": "n_shared_experts"}

# Fields that do not change the math: bookkeeping of transformers and of the hub, and what transformers derives
# (`qk_head_dim`, `head_dim`: the original config's head_dim, 72 in the released one, is read by nothing);
# `rope_*` mean nothing without RoPE (mla_use_nope).
IRRELEVANT = ("architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
              "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
              "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "model_type",
              "pretraining_tp", "qk_head_dim", "head_dim", "rope_theta", "rope_scaling", "rope_parameters")

# Kimi-Linear's fixed settings, as our fields must be for `--to kimi_linear`.
FIXED = {"zero_centered_norms": False, "kda_gate_activation": "sigmoid", "kda_gate_bias": False, "mlp_bias": False}
# MLA's q_a_layernorm / kv_a_layernorm: KimiLinearRMSNorm(dim) in transformers, KimiRMSNorm(dim) in the original
# code, both at their default epsilon, not rms_norm_eps
MLA_NORM_EPS = 1e-6
FIXED_MLA = {"mla_use_nope": True, "mla_norm_eps": MLA_NORM_EPS}


def _aliased(fields: Fields, name: str, read: Callable[[str, Any], Any], default: Any) -> Any:
    """The setting `name` or its alias (`ALIASES`), read with `read(key, default)`; both given must agree."""
    names = [key for key in (name, ALIASES.get(name)) if key is not None and fields.has(key)]
    values = [read(key, default) for key in names]
    if len(values) == 2 and values[0] != values[1]:
        raise ConversionError(f"{fields.file}: {names[0]} ({brief(values[0])}) and {names[1]} ({brief(values[1])}) "
                              "name the same setting and disagree (transformers reads one, the original code the "
                              "other); make them equal.")
    for key in (name, ALIASES.get(name)):  # mark both read
        if key is not None:
            fields.get(key)
    return values[0] if values else default


def _layer_lists(fields: Fields, linear: Fields, layers: int) -> list[str] | None:
    """Kimi's layer types from linear_attn_config's 1-indexed kda_layers / full_attn_layers, or None without them."""
    if not (linear.has("kda_layers") or linear.has("full_attn_layers")):
        return None
    types: list[str | None] = [None] * layers
    for key, kind in (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention")):
        for position, number in enumerate(linear.sequence(key, [], item=int)):
            if not 1 <= number <= layers:
                raise ConversionError(f"{fields.file}: linear_attn_config.{key}[{position}] is {number}, not a layer "
                                      f"number (1 to {layers}: these lists count from 1); fix the list.")
            if types[number - 1] is not None:
                raise ConversionError(f"{fields.file}: layer {number} is listed twice in linear_attn_config's "
                                      "kda_layers / full_attn_layers; list each layer once.")
            types[number - 1] = kind
    missing = [index + 1 for index, kind in enumerate(types) if kind is None]
    if missing:
        raise ConversionError(f"{fields.file}: layer(s) {brief(missing)} are in neither linear_attn_config."
                              "kda_layers nor full_attn_layers (1-indexed); list every layer in one of them.")
    return types  # type: ignore[return-value]


def _layer_types(fields: Fields, linear: Fields, layers: int) -> list[str]:
    """Each layer's Kimi type: `layer_types` (transformers) and the lists (hub) must agree where both are given."""
    listed = _layer_lists(fields, linear, layers)
    given = per_layer_names(fields, "layer_types", layers, LAYER_TYPES, "Kimi-Linear layers", default=None)
    if given is not None:
        if listed is not None and listed != given:
            index = next(i for i, (a, b) in enumerate(zip(listed, given)) if a != b)
            raise ConversionError(f"{fields.file}: layer_types[{index}] is {given[index]!r} but linear_attn_config "
                                  f"makes layer {index + 1} (1-indexed) {listed[index]!r}; transformers reads the "
                                  "first, the original code the second: make them agree.")
        return list(given)
    if listed is not None:
        return listed
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]  # KimiLinearConfig


def _mlp_types(fields: Fields, layers: int) -> list[str]:
    """Each layer's Kimi MLP ("dense" / "sparse"): `mlp_layer_types`, else first_k_dense_replace dense layers first."""
    frequency = fields.integer("moe_layer_freq", 1, minimum=1)
    if frequency != 1:
        raise ConversionError(f"{fields.file}: moe_layer_freq is {frequency}; transformers' KimiLinear ignores it "
                              "(every layer after first_k_dense_replace is MoE), so only 1 converts.")
    first = fields.integer("first_k_dense_replace", None, minimum=0)
    from_first = ["dense" if i < (FIRST_K_DENSE_DEFAULT if first is None else first) else "sparse"
                  for i in range(layers)]
    given = per_layer_names(fields, "mlp_layer_types", layers, MLP_TYPES, "Kimi-Linear MLPs", default=None)
    if given is None:
        return from_first
    if first is not None and given != from_first:
        raise ConversionError(f"{fields.file}: mlp_layer_types ({brief(given)}) disagrees with first_k_dense_replace "
                              f"({first}); transformers reads the first, the original code the second: make them "
                              "agree.")
    return list(given)


def _size(fields: Fields, census: TensorCensus | None, minimum: int = 1) -> Callable[[str, Any], Any]:
    def read(key: str, default: Any) -> Any:
        return fields.integer(key, default, minimum=minimum, maximum=census.elements if census else None,
                              too_large=census.elements_phrase if census else "")
    return read


def _kda_settings(fields: Fields, linear: Fields, census: TensorCensus | None) -> dict[str, Any]:
    out = {}
    for key, flat in LINEAR_FIELDS.items():
        nested = linear.integer(key, None, minimum=1, maximum=census.elements if census else None,
                                too_large=census.elements_phrase if census else "")
        top = _size(fields, census)(flat, None)
        if nested is not None and top is not None and nested != top:
            raise ConversionError(f"{fields.file}: linear_attn_config.{key} ({nested}) and {flat} ({top}) name the "
                                  "same setting and disagree; make them equal.")
        out[_KDA_FIELDS[key]] = nested if nested is not None else top if top is not None else KIMI_DEFAULTS[flat]
    unknown = linear.unread()
    if unknown:
        raise ConversionError(f"{fields.file}: linear_attn_config field(s) {brief(unknown)} are not Kimi-Linear "
                              "settings this converter knows (transformers' KimiLinear ignores them, so they may "
                              "change the original model's math); it refuses rather than guess.")
    return out


def _mla_settings(fields: Fields, census: TensorCensus | None, present: bool) -> dict[str, Any]:
    """MLA's fields; read (and checked) only when a layer is MLA, consumed either way."""
    names = (*_MLA_SIZES, "qk_rope_head_dim", "q_lora_rank", "mla_use_nope", "num_key_value_heads", "attention_bias",
             "attention_dropout")
    if not present:
        for name in names:
            fields.get(name)
        return {}
    read = _size(fields, census)
    out = {ours: read(theirs, KIMI_DEFAULTS[theirs]) for theirs, ours in _MLA_SIZES.items()}
    out["qk_rope_head_dim"] = _size(fields, census, minimum=0)("qk_rope_head_dim", KIMI_DEFAULTS["qk_rope_head_dim"])
    out["q_lora_rank"] = read("q_lora_rank", None) or 0  # null: one q_proj (ours: 0)
    out["mla_norm_eps"] = MLA_NORM_EPS
    if not fields.boolean("mla_use_nope", True):
        raise ConversionError(f"{fields.file}: mla_use_nope is false; transformers' KimiLinear never applies RoPE in "
                              "its MLA layers (the released checkpoints use mla_use_nope true), so only true "
                              "converts.")
    out["mla_use_nope"] = True
    kv_heads = read("num_key_value_heads", out["num_attention_heads"])
    if kv_heads != out["num_attention_heads"]:
        raise ConversionError(f"{fields.file}: num_key_value_heads ({kv_heads}) differs from num_attention_heads "
                              f"({out['num_attention_heads']}); MLA shares one latent KV among all heads and "
                              "transformers' KimiLinear repeats its keys by their ratio, so they must be equal.")
    out["attention_bias"] = fields.boolean("attention_bias", KIMI_DEFAULTS["attention_bias"])  # q_a, kv_a, o_proj
    out["attention_dropout"] = fields.number("attention_dropout", 0.0)
    out["num_key_value_heads"] = out["num_attention_heads"]  # read by no MLA layer; the config checks the ratio
    return out


def _moe_settings(fields: Fields, census: TensorCensus | None, present: bool) -> dict[str, Any]:
    """Kimi's MoE fields; read (and checked) only when a layer is sparse, consumed either way."""
    names = (*_MOE_SIZES, *(ALIASES.get(n) for n in _MOE_SIZES), "moe_renormalize", "norm_topk_prob",
             "routed_scaling_factor", "moe_router_activation_func", "use_grouped_topk", "output_router_logits")
    if not present:
        for name in names:
            if name is not None:
                fields.get(name)
        return {}
    read = _size(fields, census)
    out = {ours: _aliased(fields, theirs, read, KIMI_DEFAULTS[theirs]) for theirs, ours in _MOE_SIZES.items()}
    out["norm_topk_prob"] = _aliased(fields, "moe_renormalize", fields.boolean, KIMI_DEFAULTS["moe_renormalize"])
    out["routed_scaling_factor"] = fields.number("routed_scaling_factor", KIMI_DEFAULTS["routed_scaling_factor"],
                                                 positive=True)
    out["output_router_logits"] = fields.boolean("output_router_logits", False)
    activation = fields.string("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ConversionError(f"{fields.file}: moe_router_activation_func is {brief(activation)}; transformers' "
                              "KimiLinear routes with sigmoid scores, so only 'sigmoid' converts.")
    if not fields.boolean("use_grouped_topk", True) and out["n_group"] != 1:
        raise ConversionError(f"{fields.file}: use_grouped_topk is false with num_expert_group {out['n_group']}; "
                              "transformers' KimiLinear always picks experts by group, which is the same only with "
                              "one group: set use_grouped_topk true or num_expert_group 1.")
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ConversionError(f"{fields.file}: num_experts_per_token ({out['num_experts_per_tok']}) is more than "
                              f"num_experts ({out['num_experts']}); fix the config.")
    return out


def kimi_to_hybrid_config(data: Any, label: str, census: TensorCensus | None = None) -> HybridLinearConfig:
    """A Kimi-Linear config.json (parsed) -> our config."""
    fields = Fields(data, "", label, missing_is_empty=False)
    check_model_type(fields, MODEL_TYPE, "kimi_linear")
    layers = layer_count(fields, KIMI_DEFAULTS["num_hidden_layers"], census)
    linear = fields.mapping("linear_attn_config")
    kimi_types = _layer_types(fields, linear, layers)
    kimi_mlps = _mlp_types(fields, layers)
    kwargs: dict[str, Any] = {"layer_types": [LAYER_TYPES[t] for t in kimi_types],
                              "mlp_types": [MLP_TYPES[t] for t in kimi_mlps]}
    read = _size(fields, census)
    for name in ("vocab_size", "hidden_size"):
        kwargs[name] = read(name, KIMI_DEFAULTS[name])
    # a size is bounded by the stored weights only where a stored tensor has it: the dense MLP's width when a layer
    # is dense, KDA's sizes when a layer is KDA (MLA's and the MoE's are read only when present)
    kwargs["intermediate_size"] = _size(fields, census if DENSE in kwargs["mlp_types"] else None)(
        "intermediate_size", KIMI_DEFAULTS["intermediate_size"])
    kwargs["max_position_embeddings"] = _aliased(  # no tensor's size: not bounded by the census
        fields, "model_max_length", lambda key, default: fields.integer(key, default, minimum=1),
        KIMI_DEFAULTS["model_max_length"])
    kwargs["hidden_act"] = fields.string("hidden_act", "silu")
    if kwargs["hidden_act"] != "silu" and KDA in kwargs["layer_types"]:
        raise ConversionError(f"{label}: hidden_act is {brief(kwargs['hidden_act'])}; transformers' KimiLinear also "
                              "applies it after KDA's short convolutions, where the original code (and this model) "
                              "uses silu; only 'silu' converts.")
    eps = fields.number("rms_norm_eps", KIMI_DEFAULTS["rms_norm_eps"], positive=True)
    kwargs.update(rms_norm_eps=eps, kda_norm_eps=eps)  # KDA's gated output norm uses rms_norm_eps too
    kwargs["initializer_range"] = fields.number("initializer_range", KIMI_DEFAULTS["initializer_range"])
    for name in ("use_cache", "tie_word_embeddings"):
        kwargs[name] = fields.boolean(name, KIMI_DEFAULTS[name])
    kwargs.update(token_ids(fields))
    kwargs.update(_kda_settings(fields, linear, census if KDA in kwargs["layer_types"] else None))
    kwargs.update(_mla_settings(fields, census, MLA in kwargs["layer_types"]))
    kwargs.update(_moe_settings(fields, census, KIMI_MOE in kwargs["mlp_types"]))
    layers_mtp = fields.integer("num_nextn_predict_layers", 0, minimum=0)
    if layers_mtp:
        raise ConversionError(f"{label}: num_nextn_predict_layers is {layers_mtp}; transformers' KimiLinear has no "
                              "multi-token prediction layers, so only 0 converts.")
    kwargs.update(FIXED)
    unknown = fields.unread(IRRELEVANT)
    if unknown:
        raise ConversionError(f"{label}: field(s) {brief(unknown)} are not Kimi-Linear settings this converter knows; "
                              "they may change the model, so it refuses rather than guess. Remove them if they are "
                              "bookkeeping.")
    try:
        return HybridLinearConfig(**kwargs)
    except ValueError as error:
        raise ConversionError(f"{label}: not a valid model once mapped: {clip(str(error))}") from None


# ------------------------------------------------------------------------------------------------ --to kimi_linear


def _refuse(what: str) -> ConversionError:
    return ConversionError(f"this model does not fit Kimi-Linear: {what}; convert it to the hf format instead.")


def dense_first_layers(config: HybridLinearConfig) -> int:
    """Kimi's first_k_dense_replace for `config`: its leading dense layers (refusing a dense layer after a MoE one)."""
    mlp_types = list(config.mlp_types)
    first = next((i for i, t in enumerate(mlp_types) if t != DENSE), len(mlp_types))
    for index, mlp_type in enumerate(mlp_types):
        if mlp_type not in (DENSE, KIMI_MOE):
            raise _refuse(f"layer {index}'s MLP is {mlp_type!r}, and Kimi-Linear's are the gated MLP ('dense') or "
                          "its own MoE ('kimi_moe')")
        if index >= first and mlp_type == DENSE:
            raise _refuse(f"layer {index} has a dense MLP after MoE layers, and Kimi-Linear's dense layers are its "
                          "first ones (first_k_dense_replace)")
    return first


def check_fits_kimi(config: HybridLinearConfig) -> None:
    """Refuses, naming the first layer or setting, a model Kimi-Linear's architecture cannot express."""
    for index, layer_type in enumerate(config.mixer_types):
        if layer_type not in (KDA, MLA):
            raise _refuse(f"layer {index} is {layer_type!r}, and Kimi-Linear layers are Kimi Delta Attention "
                          "('kimi_delta_attention') or MLA ('mla_attention')")
    for index in range(len(config.mixer_types)):
        overrides = layer_overrides(config, index)
        if overrides:
            raise _refuse(f"layer {index} has its own {', '.join(sorted(overrides))} (per_layer_config), and "
                          "Kimi-Linear has one setting for all layers")
    fixed = {**FIXED, **(FIXED_MLA if MLA in config.mixer_types else {})}
    for name, value in fixed.items():
        if getattr(config, name) != value:
            raise _refuse(f"{name} is {brief(getattr(config, name))}, and Kimi-Linear has {value!r}")
    if KDA in config.mixer_types and config.kda_norm_eps != config.rms_norm_eps:
        raise _refuse(f"kda_norm_eps ({config.kda_norm_eps}) differs from rms_norm_eps ({config.rms_norm_eps}), and "
                      "Kimi-Linear's gated KDA norm uses rms_norm_eps")
    if KDA in config.mixer_types and config.hidden_act != "silu":
        raise _refuse(f"hidden_act is {brief(config.hidden_act)}, and transformers' KimiLinear applies it after KDA's "
                      "short convolutions too, where this model uses silu")
    if config.tie_word_embeddings:
        raise _refuse("tie_word_embeddings is True, and transformers' KimiLinear never ties its lm_head to the "
                      "embeddings (it would load the folder with a random lm_head)")
    dense_first_layers(config)


def hybrid_config_to_kimi(config: HybridLinearConfig) -> dict[str, Any]:
    """Our config -> Kimi-Linear's config.json fields (the hub's names), refusing what does not fit."""
    check_fits_kimi(config)
    layers = len(config.mixer_types)
    out: dict[str, Any] = {
        "model_type": MODEL_TYPE, "architectures": list(ARCHITECTURES), "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": layers, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range, "use_cache": config.use_cache,
        "tie_word_embeddings": config.tie_word_embeddings, "model_max_length": config.max_position_embeddings,
        **{name: getattr(config, name) for name in TOKEN_FIELDS},
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(config.mixer_types) if t == KDA],
            "full_attn_layers": [i + 1 for i, t in enumerate(config.mixer_types) if t == MLA],
            **{theirs: getattr(config, ours) for theirs, ours in _KDA_FIELDS.items()},
        },
        "first_k_dense_replace": dense_first_layers(config), "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    }
    if MLA in config.mixer_types:
        out.update({theirs: getattr(config, ours) for theirs, ours in _MLA_SIZES.items()})
        out.update(qk_rope_head_dim=config.qk_rope_head_dim, q_lora_rank=config.q_lora_rank or None, mla_use_nope=True,
                   attention_bias=config.attention_bias, num_key_value_heads=config.num_attention_heads,
                   attention_dropout=config.attention_dropout)
    if KIMI_MOE in config.mlp_types:
        if config.n_shared_experts == 0:
            raise _refuse("the kimi_moe layers have no shared experts (n_shared_experts 0), and Kimi-Linear's always "
                          "have them")
        out.update({theirs: getattr(config, ours) for theirs, ours in _MOE_SIZES.items()})
        out.update(moe_renormalize=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
                   moe_router_activation_func="sigmoid", use_grouped_topk=True,
                   output_router_logits=config.output_router_logits)
    return out


__all__ = ["kimi_to_hybrid_config", "hybrid_config_to_kimi", "check_fits_kimi", "dense_first_layers",
           "KIMI_DEFAULTS", "IRRELEVANT", "ALIASES", "MODEL_TYPE", "ARCHITECTURES"]

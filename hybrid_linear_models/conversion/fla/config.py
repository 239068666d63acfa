"""fla's model config (config.json of a `gated_deltanet` or `kda` model) -> `HybridLinearConfig`.

What fla 0.6.0's `GatedDeltaNetConfig` / `KDAConfig` and the modules they build mean, field by field:

- Every layer is the model's linear mixer (GDN or KDA) unless fla's `attn` setting places softmax attention there:
  `attn` is one mapping or a list of them, each {layers, num_heads, num_kv_heads (default num_heads), qkv_bias
  (false), window_size (null), rope_theta (1e4)}. fla's attention has head_dim = hidden_size // num_heads, full
  rotary (rotate-half, theta), no q/k norm (0.6.0's `get_attention` never passes one), no output gate, biases on
  q/k/v when qkv_bias and never on o_proj, and a flash-attention window of `window_size` keys including the query:
  our `full_attention` / `sliding_attention` with attention_output_gate False, attention_qk_norm False,
  partial_rotary_factor 1.0, attention_bias = qkv_bias, attention_output_bias False.
- GDN (`gated_deltanet`): key heads num_heads x head_dim, value heads num_v_heads (default num_heads) x
  int(head_dim * expand_v), value head j reading key head j // (num_v_heads / num_heads) as ours;
  g = -exp(A_log) * softplus(a_proj x + dt_bias), beta = sigmoid(b_proj x) (x2 with allow_neg_eigval: refused);
  the output norm is x_hat * w * act(g_proj x) with act = output_gate_activation (swish = silu), eps norm_eps.
- KDA (`kda`): heads num_heads x head_dim, per-channel g = -exp(A_log[h]) * softplus(f_proj(x) + dt_bias); the
  output norm's gate is sigmoid(g_proj(x)), whose second linear has a bias (our kda_gate_bias). GVA (num_v_heads >
  num_heads), expand_v != 1 and the lower-bound gate (safe_gate / lower_bound) are not expressible: refused.
- Block: RMSNorm x_hat * w (eps norm_eps) before the mixer and the MLP, plus the final norm; fused or not
  (fuse_norm), the math is the same. MLP: SwiGLU (hidden_act 'swish'), intermediate_size, or when null
  256 * ceil(int(hidden_size * hidden_ratio * 2/3) / 256) with hidden_ratio defaulting to 4, as fla's GatedMLP.

fla's layers keep their recurrent state as [V, K] (`state_v_first=True`) where ours and the ops' default is [K, V]:
that is a cache layout, never stored in a checkpoint, so nothing here converts it (the delta rule itself is the same
map; the GPU test runs fla's own models beside ours).

A field absent from config.json takes fla 0.6.0's default (what fla's own `from_pretrained` would build). Every field
is mapped, checked against the one value our model supports, or known not to change the forward pass
(`_IRRELEVANT`: kernel choices, fused training losses, transformers' bookkeeping and generation defaults); anything
else is a ConversionError naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from ...configuration_hybrid_linear import MIXER_FIELDS, HybridLinearConfig
from ..errors import ConversionError
from ..hf_layout import layer_config
from ..hf_style_folder import layer_count
from ..pipeline import TensorCensus
from ..untrusted import Fields, brief, clip

MODEL_TYPES = {"gated_deltanet": "gated_deltanet", "kda": "kimi_delta_attention"}  # fla model_type -> our layer type

# fla 0.6.0's config defaults, per model type (GatedDeltaNetConfig / KDAConfig __init__), then the shared ones.
_DEFAULTS = {
    "gated_deltanet": {"expand_v": 2.0, "head_dim": 256, "num_heads": 6, "num_hidden_layers": 21},
    "kda": {"expand_v": 1.0, "head_dim": 128, "num_heads": 16, "num_hidden_layers": 24},
}
_SHARED_DEFAULTS = {"hidden_size": 2048, "conv_size": 4, "max_position_embeddings": 2048, "hidden_ratio": 4,
                    "norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
                    "vocab_size": 32000}
_ATTENTION_DEFAULT_THETA = 10_000.0

# Fields that do not change the forward pass: fla's kernel and training-loss switches, and what transformers writes
# into every config.json (bookkeeping, and the generation defaults older versions stored there).
_IRRELEVANT = frozenset({
    "attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp",
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "auto_map",
    "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "torchscript", "tf_legacy_loss", "use_bfloat16", "pruned_heads",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})
_ATTENTION_KEYS = ("layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta", "qk_norm")


class FlaFields(Fields):
    """config.json of an fla model, read through typed getters; sizes bounded by the stored tensors (`census`)."""

    def __init__(self, data: Any, path: str, file: str, census: TensorCensus | None = None):
        super().__init__(data, path, file, missing_is_empty=False)
        self.census = census

    def _child(self, data: Any, path: str) -> FlaFields:
        return FlaFields(data, path, self.file, self.census)

    def size(self, key: str, default: Any) -> int:
        census = self.census
        return self.integer(key, default, minimum=1, maximum=census.elements if census else None,
                            too_large=census.elements_phrase if census else "")

    def refuse(self, key: str, value: Any, meaning: str) -> ConversionError:
        return ConversionError(f"{self.file}: {self.where(key)} = {brief(value)} is not supported ({meaning}); "
                               "HybridLinearConfig cannot express it, so this model does not convert.")


def model_type_of(fields: Fields) -> str:
    """config.json's model_type, which must be one of fla's models this converter reads."""
    model_type = fields.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ConversionError(f"{fields.file} has model_type {brief(model_type)}; --from fla reads fla's "
                              f"{' and '.join(repr(t) for t in MODEL_TYPES)} models (GatedDeltaNetForCausalLM, "
                              "KDAForCausalLM).")
    return model_type


def _attention_specs(fields: FlaFields, num_layers: int) -> list[tuple[FlaFields, list[int]]]:
    """fla's `attn`: None, one mapping or a list of them, each with the layers it places (in range, each layer at
    most once, as fla's parse_attention_config checks)."""
    attn = fields.get("attn")
    if attn is None:
        return []
    if isinstance(attn, dict):
        specs = [FlaFields(attn, fields.where("attn"), fields.file, fields.census)]
    elif isinstance(attn, list):
        specs = [FlaFields(spec, f"{fields.where('attn')}[{i}]", fields.file, fields.census)
                 for i, spec in enumerate(attn)]
    else:
        raise fields.wrong("attn", "null, a mapping or a list of mappings", attn)
    placed: dict[int, str] = {}
    result = []
    for spec in specs:
        layers = spec.sequence("layers", item=int)
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise ConversionError(f"{spec.file}: {spec.where('layers')} holds layer {brief(layer)}, outside "
                                      f"[0, num_hidden_layers={num_layers}); fix the config.")
            if layer in placed:
                raise ConversionError(f"{spec.file}: layer {layer} is placed twice (by {placed[layer]} and "
                                      f"{spec.path}); fla refuses such a config, fix it.")
            placed[layer] = spec.path
        result.append((spec, layers))
    return result


def _attention_settings(spec: FlaFields, hidden_size: int) -> dict[str, Any]:
    """Our attention fields for one of fla's `attn` specs (and its window, None for full attention)."""
    heads = spec.size("num_heads", None)
    if heads is None:
        raise spec.missing("num_heads", "; fla requires it")
    kv_heads = spec.size("num_kv_heads", None) or heads
    if hidden_size % heads:
        raise ConversionError(f"{spec.file}: {spec.where('num_heads')} = {heads} does not divide hidden_size = "
                              f"{hidden_size}; fla's attention has head_dim = hidden_size // num_heads and cannot "
                              "run such a config.")
    if heads % kv_heads:
        raise ConversionError(f"{spec.file}: {spec.where('num_heads')} = {heads} is not a multiple of "
                              f"{spec.where('num_kv_heads')} = {kv_heads}; fix the config.")
    qkv_bias = spec.boolean("qkv_bias", False)  # q/k/v biases, never one on o_proj (attention_output_bias False)
    qk_norm = spec.get("qk_norm", False)
    if qk_norm is not False and qk_norm is not None:
        raise spec.refuse("qk_norm", qk_norm, "fla 0.6.0 builds these attention layers without q/k norms whatever "
                          "attn says, so a checkpoint claiming them was written by other code")
    theta = float(spec.number("rope_theta", _ATTENTION_DEFAULT_THETA, positive=True))
    window = spec.integer("window_size", None, minimum=1)
    unknown = spec.unread()
    if unknown:
        raise ConversionError(f"{spec.file}: {clip(', '.join(unknown))} not supported in fla's attn setting (known "
                              f"keys: {', '.join(_ATTENTION_KEYS)}).")
    settings = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden_size // heads,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0},
                "attention_bias": qkv_bias}
    if window is not None:
        settings["sliding_window"] = window
    return settings


def _value_head_dim(fields: FlaFields, head_dim: int, expand_v: float) -> int:
    """int(head_dim * expand_v), which fla requires to be whole."""
    value = head_dim * expand_v
    if not math.isfinite(value) or value < 1 or not math.isclose(value, int(value), rel_tol=1e-5):
        raise ConversionError(f"{fields.file}: head_dim * expand_v = {head_dim} * {brief(expand_v)} is not a "
                              "positive whole number; fla refuses such a config, fix expand_v.")
    census = fields.census
    if census is not None and int(value) > census.elements:
        raise ConversionError(f"{fields.file}: head_dim * expand_v = {int(value)}, more than "
                              f"{census.elements_phrase}; the config does not match the weights.")
    return int(value)


def _linear_mixer_settings(fields: FlaFields, model_type: str, norm_eps: float) -> dict[str, Any]:
    defaults = _DEFAULTS[model_type]
    heads = fields.size("num_heads", defaults["num_heads"])
    head_dim = fields.size("head_dim", defaults["head_dim"])
    value_heads = fields.size("num_v_heads", None) or heads
    expand_v = fields.number("expand_v", defaults["expand_v"], positive=True)
    conv_size = fields.size("conv_size", _SHARED_DEFAULTS["conv_size"])
    if not fields.boolean("use_short_conv", True):
        raise fields.refuse("use_short_conv", False, "our GDN and KDA always run their short convolutions")
    if fields.boolean("allow_neg_eigval", False):
        raise fields.refuse("allow_neg_eigval", True, "beta = 2 * sigmoid(b); ours is sigmoid(b)")
    if model_type == "gated_deltanet":
        if value_heads % heads:
            raise ConversionError(f"{fields.file}: num_v_heads = {value_heads} is not a multiple of num_heads = "
                                  f"{heads}; GDN's value heads share key heads in equal groups, fix the config.")
        if not fields.boolean("use_gate", True):
            raise fields.refuse("use_gate", False, "an output norm without gate; ours is x_hat * w * act(g_proj x)")
        activation = fields.name("output_gate_activation", ("swish", "silu", "sigmoid"), "swish")
        return {"gdn_num_key_heads": heads, "gdn_num_value_heads": value_heads, "gdn_key_head_dim": head_dim,
                "gdn_value_head_dim": _value_head_dim(fields, head_dim, expand_v), "gdn_conv_kernel_size": conv_size,
                "gdn_gate_activation": "sigmoid" if activation == "sigmoid" else "silu", "gdn_norm_eps": norm_eps}
    if value_heads != heads:
        raise fields.refuse("num_v_heads", value_heads, f"KDA with more value heads than num_heads = {heads}")
    if expand_v != 1:
        raise fields.refuse("expand_v", expand_v, "KDA with value heads wider than its key heads")
    if fields.boolean("safe_gate", False):
        raise fields.refuse("safe_gate", True, "the lower-bounded gate lower_bound * sigmoid(...)")
    lower_bound = fields.get("lower_bound")
    if lower_bound is not None:
        raise fields.refuse("lower_bound", lower_bound, "the lower-bounded gate lower_bound * sigmoid(...); ours is "
                            "-exp(A_log) * softplus(...)")
    return {"kda_num_heads": heads, "kda_head_dim": head_dim, "kda_conv_kernel_size": conv_size,
            "kda_gate_activation": "sigmoid", "kda_norm_eps": norm_eps, "kda_gate_bias": True}


def _intermediate_size(fields: FlaFields, hidden_size: int) -> int:
    """fla's GatedMLP: intermediate_size, or the multiple of 256 nearest above 2/3 * hidden_ratio * hidden_size."""
    size = fields.size("intermediate_size", None)
    ratio = _SHARED_DEFAULTS["hidden_ratio"]
    if fields.get("hidden_ratio") is not None:  # null: GatedMLP's own default, 4
        ratio = fields.number("hidden_ratio", positive=True)
    if size is not None:
        return size
    size = int(hidden_size * ratio * 2 / 3)
    size = 256 * ((size + 255) // 256)
    census = fields.census
    if census is not None and size > census.elements:
        raise ConversionError(f"{fields.file}: hidden_ratio {brief(ratio)} gives intermediate_size {size}, more "
                              f"than {census.elements_phrase}; the config does not match the weights.")
    return size


def _token_id(fields: FlaFields, key: str) -> int | None:
    if fields.get(key, _SHARED_DEFAULTS.get(key)) is None:
        return None
    return fields.integer(key, _SHARED_DEFAULTS.get(key), minimum=0)


def fla_to_hybrid_config(data: Any, file: str, census: TensorCensus | None = None) -> HybridLinearConfig:
    """Our config for fla's config.json (parsed); `census` bounds every size by the stored tensors before any
    per-layer table is built."""
    fields = FlaFields(data, "", file, census)
    model_type = model_type_of(fields)
    num_layers = layer_count(fields, _DEFAULTS[model_type]["num_hidden_layers"], census)
    hidden_size = fields.size("hidden_size", _SHARED_DEFAULTS["hidden_size"])
    norm_eps = float(fields.number("norm_eps", _SHARED_DEFAULTS["norm_eps"], positive=True))
    hidden_act = fields.string("hidden_act", "swish")
    if hidden_act != "swish":
        raise fields.refuse("hidden_act", hidden_act, "fla's GatedMLP with an activation other than 'swish' (SwiGLU)")
    if not fields.boolean("elementwise_affine", True):  # older fla configs carry it; False: norms without weights
        raise fields.refuse("elementwise_affine", False, "RMSNorms without a learned weight; ours always have one")
    attnres = fields.get("attnres_block_size")
    if attnres is not None:
        raise fields.refuse("attnres_block_size", attnres, "attention residuals mix earlier layers' outputs")
    linear_type = MODEL_TYPES[model_type]
    kwargs: dict[str, Any] = {
        **_linear_mixer_settings(fields, model_type, norm_eps),
        "vocab_size": fields.size("vocab_size", _SHARED_DEFAULTS["vocab_size"]),
        "hidden_size": hidden_size,
        "intermediate_size": _intermediate_size(fields, hidden_size),
        "hidden_act": "silu",
        "mlp_bias": False,
        "rms_norm_eps": norm_eps,
        "zero_centered_norms": False,
        "attention_output_gate": False,
        "attention_qk_norm": False,
        "attention_bias": False,
        "attention_output_bias": False,  # fla's o_proj never has a bias
        "max_position_embeddings": fields.integer("max_position_embeddings",
                                                  _SHARED_DEFAULTS["max_position_embeddings"], minimum=1),
        "tie_word_embeddings": fields.boolean("tie_word_embeddings", False),
        "initializer_range": float(fields.number("initializer_range", _SHARED_DEFAULTS["initializer_range"])),
        "use_cache": fields.boolean("use_cache", True),
        "pad_token_id": _token_id(fields, "pad_token_id"),
        "bos_token_id": _token_id(fields, "bos_token_id"),
        "eos_token_id": _token_id(fields, "eos_token_id"),
    }
    layer_types = [linear_type] * num_layers
    per_layer: dict[int, dict[str, Any]] = {}
    first: dict[str, Any] | None = None
    for spec, layers in _attention_specs(fields, num_layers):
        settings = _attention_settings(spec, hidden_size)
        window = settings.pop("sliding_window", None)
        if first is None:  # the first spec's settings are the flat defaults, the others override them per layer
            first = settings
            kwargs.update(settings)
        differing = {key: value for key, value in settings.items() if value != first[key]}
        for layer in layers:
            layer_types[layer] = "full_attention" if window is None else "sliding_attention"
            overrides = dict(differing)
            if window is not None:
                overrides["sliding_window"] = window
            if overrides:
                per_layer[layer] = overrides
    windows = {overrides["sliding_window"] for overrides in per_layer.values() if "sliding_window" in overrides}
    if len(windows) == 1:  # one window: a flat field, not one override per sliding layer
        kwargs["sliding_window"] = windows.pop()
        for overrides in per_layer.values():
            overrides.pop("sliding_window", None)
        per_layer = {layer: overrides for layer, overrides in per_layer.items() if overrides}
    unknown = fields.unread(_IRRELEVANT | {"attn"})
    if unknown:
        raise ConversionError(f"{file}: field(s) {clip(', '.join(unknown))} not supported by --from fla (they may "
                              "change the model's math, and this converter does not know them).")
    kwargs["layer_types"] = layer_types
    if per_layer:
        kwargs["per_layer_config"] = per_layer
    try:
        return HybridLinearConfig(**kwargs)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"{file} describes a model HybridLinearConfig rejects: {clip(str(error), 600)}") from None





# -------------------------------------------------------------------------------------------- -> fla

LAYER_TYPE_TO_MODEL = {layer_type: model_type for model_type, layer_type in MODEL_TYPES.items()}
_ATTENTION_TYPES = ("full_attention", "sliding_attention")


def _fla_problem(config: HybridLinearConfig) -> str | None:
    """The first layer or setting of `config` that fla's gated_deltanet / kda models cannot express, or None."""
    linear = [t for t in dict.fromkeys(config.mixer_types) if t not in _ATTENTION_TYPES]
    if not linear:
        return "it has no gated_deltanet or kimi_delta_attention layer (fla's models are GDN or KDA models)"
    if len(linear) > 1:
        return (f"it mixes {linear[0]} and {linear[1]} layers (layer {config.mixer_types.index(linear[1])}); an fla "
                "model has one linear mixer type")
    if config.zero_centered_norms:
        return "zero_centered_norms=True (fla's RMSNorms are x_hat * w)"
    flat_eps = config._getattr_without_heterogeneous_validation("rms_norm_eps")
    first = config.mixer_types.index(linear[0])
    reference = layer_config(config, first)
    for index, layer_type in enumerate(config.mixer_types):
        layer, where = layer_config(config, index), f"layer {index} ({layer_type})"
        if config.mlp_types[index] != "dense":
            return f"{where}: mlp_types[{index}]={brief(config.mlp_types[index])} (fla's models have dense MLPs only)"
        for field in ("intermediate_size", "rms_norm_eps"):
            if getattr(layer, field) != getattr(reference, field):
                return f"{where}: {field}={brief(getattr(layer, field))} differs from layer {first}'s (fla has one)"
        if layer.hidden_act != "silu" or layer.mlp_bias:
            return f"{where}: hidden_act={brief(layer.hidden_act)}, mlp_bias={layer.mlp_bias} (fla's MLP is SwiGLU)"
        if layer.rms_norm_eps != flat_eps:
            return f"{where}: rms_norm_eps={brief(layer.rms_norm_eps)}, the final norm's is {brief(flat_eps)}"
        if layer_type in _ATTENTION_TYPES:
            rope = layer.rope_parameters
            if layer.attention_output_gate or layer.attention_qk_norm or layer.attention_output_bias:
                return (f"{where}: attention_output_gate, attention_qk_norm and attention_output_bias must be False "
                        "for fla (its attention has no output gate, no q/k norm and no o_proj bias)")
            if rope.get("rope_type") != "default" or rope.get("partial_rotary_factor") != 1.0:
                return f"{where}: rope_parameters={brief(rope)} (fla rotates the whole head, default rope)"
            if layer.num_attention_heads * layer.head_dim != config.hidden_size:
                return (f"{where}: num_attention_heads * head_dim = {layer.num_attention_heads * layer.head_dim}, "
                        f"fla's attention has head_dim = hidden_size // heads = {config.hidden_size} in all")
            continue
        for field in MIXER_FIELDS[layer_type]:  # one fla setting for every linear layer
            if getattr(layer, field) != getattr(reference, field):
                return f"{where}: {field}={brief(getattr(layer, field))} differs from layer {first}'s (fla has one)"
    if linear[0] == "gated_deltanet":
        dk, dv = reference.gdn_key_head_dim, reference.gdn_value_head_dim
        if int(dk * (dv / dk)) != dv:
            return f"gdn_value_head_dim={dv} is not int(head_dim * expand_v) for any float expand_v"
        if reference.gdn_norm_eps != flat_eps:
            return f"gdn_norm_eps={brief(reference.gdn_norm_eps)} differs from rms_norm_eps (fla has one norm_eps)"
    else:
        if reference.kda_gate_activation != "sigmoid":
            return f"kda_gate_activation={brief(reference.kda_gate_activation)} (fla's KDA output gate is sigmoid)"
        if not reference.kda_gate_bias:
            return "kda_gate_bias=False (fla's KDA g_proj.1 has a bias, and no weight is invented for it)"
        if reference.kda_norm_eps != flat_eps:
            return f"kda_norm_eps={brief(reference.kda_norm_eps)} differs from rms_norm_eps (fla has one norm_eps)"
    return None


def _attention_spec(layer: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    return {"num_heads": layer.num_attention_heads, "num_kv_heads": layer.num_key_value_heads,
            "qkv_bias": bool(layer.attention_bias),
            "window_size": layer.sliding_window if layer_type == "sliding_attention" else None,
            "rope_theta": float(layer.rope_parameters["rope_theta"])}


def hybrid_config_to_fla(config: HybridLinearConfig) -> dict[str, Any]:
    """fla's config.json for `config` (every field its config class writes), or a ConversionError naming the first
    layer or setting fla cannot express."""
    problem = _fla_problem(config)
    if problem is not None:
        raise ConversionError(f"this model cannot be written as an fla model: {problem}.")
    linear_type = next(t for t in config.mixer_types if t not in _ATTENTION_TYPES)
    model_type = LAYER_TYPE_TO_MODEL[linear_type]
    first = layer_config(config, config.mixer_types.index(linear_type))
    specs: dict[str, dict[str, Any]] = {}
    for index, layer_type in enumerate(config.mixer_types):
        if layer_type in _ATTENTION_TYPES:
            spec = _attention_spec(layer_config(config, index), layer_type)
            specs.setdefault(repr(sorted(spec.items())), {"layers": [], **spec})["layers"].append(index)
    attn = list(specs.values())
    result: dict[str, Any] = {
        "model_type": model_type, "attn_mode": "chunk", "hidden_size": config.hidden_size,
        "use_short_conv": True, "allow_neg_eigval": False,
        "max_position_embeddings": config.max_position_embeddings, "hidden_ratio": 4,
        "intermediate_size": first.intermediate_size, "hidden_act": "swish",
        "num_hidden_layers": config.num_hidden_layers,
        "norm_eps": first.rms_norm_eps, "attn": None if not attn else attn[0] if len(attn) == 1 else attn,
        "use_cache": config.use_cache, "pad_token_id": config.pad_token_id, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range, "fuse_norm": True, "fuse_swiglu": True,
        "fuse_cross_entropy": True, "use_l2warp": False, "vocab_size": config.vocab_size, "attnres_block_size": None,
    }
    if model_type == "gated_deltanet":
        result.update({"head_dim": first.gdn_key_head_dim, "num_heads": first.gdn_num_key_heads,
                       "num_v_heads": first.gdn_num_value_heads,
                       "expand_v": first.gdn_value_head_dim / first.gdn_key_head_dim, "use_gate": True,
                       "conv_size": first.gdn_conv_kernel_size, "fuse_linear_cross_entropy": False,
                       "output_gate_activation": "sigmoid" if first.gdn_gate_activation == "sigmoid" else "swish"})
    else:
        result.update({"head_dim": first.kda_head_dim, "num_heads": first.kda_num_heads, "num_v_heads": None,
                       "expand_v": 1.0, "conv_size": first.kda_conv_kernel_size, "safe_gate": False,
                       "lower_bound": None})
    return result


__all__ = ["MODEL_TYPES", "fla_to_hybrid_config", "hybrid_config_to_fla", "model_type_of"]

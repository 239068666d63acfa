"""Fast-LLM model config (metadata.yaml `config.base_model`) <-> `HybridLinearConfig`.

Fast-LLM omits fields left at their default. The defaults used here are the ones documented for the fixtures (conv
kernel 4; gated norms: silu gate, epsilon 1e-5; block norms epsilon 1e-5; causal attention with scale
1/sqrt(head_size), no window; rotary theta 1e4) and Fast-LLM's attention defaults (heads 8, head_groups 1,
head_size 128, biases on). Sizes whose default we cannot vouch for must be present. Every field is either mapped,
checked against the one value our model supports, or known to be training-only; anything else is an error naming
the field, never a silent approximation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...configuration_hybrid_linear import MIXER_FIELDS, HybridLinearConfig
from ..errors import ConversionError
from ..hf_layout import distinct_layers, layer_config, layer_settings
from ..pipeline import TensorCensus
from ..untrusted import REQUIRED, Fields, brief, clip

FAST_LLM_VERSION = "0.4.0"
METADATA = "metadata.yaml"
_DEFAULT_NORM_EPS = 1e-5
_DEFAULT_CONV_KERNEL = 4
_DEFAULT_ROPE_THETA = 10_000.0
_ATTENTION_DEFAULTS = {"heads": 8, "head_groups": 1, "head_size": 128}

# Fast-LLM's MLP activations and the transformers (ACT2FN) names of the same functions (Fast-LLM's own HF export
# table: its gelu is the tanh approximation).
ACTIVATION_TO_HF = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "relu": "relu", "squared_relu": "relu2"}
ACTIVATION_FROM_HF = {hf: fast_llm for fast_llm, hf in ACTIVATION_TO_HF.items()}

MIXER_TO_LAYER_TYPE = {"attention": "full_attention", "gdn": "gated_deltanet", "kda": "kimi_delta_attention"}

# Keys that only matter for training (initialisation, learning rates, dropout, losses, kernels): safe to ignore.
_TRAINING_ONLY = frozenset({
    "initialization", "lr_scale", "dropout", "apply_peft", "implementation", "use_flash_attention",
    "recompute_level", "debug", "activation_distillation_factor", "distillation_model", "losses",
    "cross_entropy_implementation", "cross_entropy_splits", "dpo_reference_model", "enable_dpo", "dpo_beta",
    "logit_z_loss", "language_model_loss_factor", "distillation_loss_factor", "teacher_softmax_temperature",
    "sequence_first", "full_precision_residual", "num_position_embeddings", "word_embeddings", "output_weight",
    "dt_bias_weight", "a_log_weight",
})


class _Fields(Fields):
    """A `config.base_model` mapping of metadata.yaml, read through typed getters; sizes are bounded by what the
    stored tensors can hold (`census`), so that no size read here can make a later table or allocation explode."""

    def __init__(self, data: Any, path: str, census: TensorCensus | None = None):
        super().__init__(data, path, METADATA)
        self.census = census

    def _child(self, data: Any, path: str) -> _Fields:
        return _Fields(data, path, self.census)

    def missing(self, key: str, hint: str = "") -> ConversionError:
        return ConversionError(
            f"metadata.yaml does not give {self.where(key)}. Fast-LLM omits fields left at their default and this "
            f"converter does not assume that default; add the value the model was trained with to metadata.yaml"
            f"{hint}."
        )

    def size(self, key: str, default: Any = REQUIRED, hint: str = "") -> int:
        """A positive integer no larger than the number of weight elements stored (a dimension of some tensor)."""
        census = self.census
        return self.integer(key, default, minimum=1, maximum=census.elements if census else None,
                            too_large=census.elements_phrase if census else "", hint=hint)

    def finish(self, extra_ignorable: frozenset = frozenset()) -> None:
        unknown = self.unread(_TRAINING_ONLY | extra_ignorable)
        if unknown:
            raise ConversionError(
                f"metadata.yaml: field(s) {clip(', '.join(unknown))} not supported by this converter "
                "(they may change the model's math, and HybridLinearConfig cannot express them)."
            )


def _check_no_bias(layer: _Fields, default_enabled: bool) -> None:
    """A linear/conv sub-config (`query_layer`, `layer_1`, ...): no bias, nothing else that changes the math."""
    bias = layer.sub("bias")
    enabled = bias.boolean("enabled", None)
    bias.finish()
    if enabled or (enabled is None and default_enabled):
        origin = f"{bias.path}.enabled" if enabled else "add_linear_biases, which Fast-LLM defaults to true"
        raise ConversionError(f"metadata.yaml: {layer.path} has a bias (from {origin}); HybridLinearConfig cannot "
                              "express biases in this layer, so only bias-free models convert (a model trained "
                              "without biases should say add_linear_biases: false).")
    weight = layer.sub("weight")
    weight.finish()
    layer.finish()


def _linear_layers(mixer: _Fields, names: tuple[str, ...], default_bias: bool) -> None:
    for name in names:
        _check_no_bias(mixer.sub(name), default_bias)


def _shared_bias(module: _Fields, names: tuple[str, ...], field: str) -> bool:
    """Whether the linear layers `names` of `module` have biases (each layer's `bias.enabled`, else the module's
    `add_linear_biases`, which Fast-LLM defaults to true). Our model has one switch (`field`) for all of them, so they
    must agree."""
    default = module.boolean("add_linear_biases", True)
    enabled = {}
    for name in names:
        layer = module.sub(name)
        bias = layer.sub("bias")
        explicit = bias.boolean("enabled", None)
        bias.finish()
        layer.sub("weight").finish()
        layer.finish()
        enabled[name] = default if explicit is None else explicit
    if len(set(enabled.values())) > 1:
        listing = ", ".join(f"{name}: {'bias' if on else 'no bias'}" for name, on in enabled.items())
        raise ConversionError(f"metadata.yaml: {module.path} mixes linear layers with and without biases ({listing}); "
                              f"HybridLinearConfig has one {field} switch for them, so give them all the same "
                              "bias.enabled.")
    return next(iter(enabled.values()))


def _convolution(mixer: _Fields) -> int:
    conv = mixer.sub("convolution_layer")
    kernel = conv.size("kernel_size", _DEFAULT_CONV_KERNEL)
    conv.expect("activation", ("silu", None), None, "the short convolution's activation")
    _check_no_bias(conv, default_enabled=False)
    return kernel


def _gated_norm(mixer: _Fields) -> tuple[float, str]:
    norm = mixer.sub("normalization")
    norm.expect("type", ("gated_rms_norm", None), None, "the output norm type")
    eps = float(norm.number("epsilon", _DEFAULT_NORM_EPS, positive=True))
    activation = norm.name("activation", ("silu", "sigmoid"), "silu")
    norm.sub("weight").finish()
    norm.finish()
    return eps, activation


# -------------------------------------------------------------------------------------------- mixers: Fast-LLM ->


def _attention_settings(mixer: _Fields) -> dict[str, Any]:
    mixer.expect("causal", (True,), True, "bidirectional attention")
    mixer.expect("softmax_scale_power", (0.5,), 0.5, "the softmax scale must be 1/sqrt(head_size)")
    for name in ("query_norm", "key_norm", "value_norm"):
        mixer.expect(name, (None,), None, "per-head q/k/v norms in Fast-LLM's layout")
    mixer.expect("shared_key_value", (False,), False, "one projection shared by keys and values")
    attention_bias = _shared_bias(mixer, ("query_layer", "key_layer", "value_layer", "dense_layer"), "attention_bias")
    rotary = mixer.sub("rotary")
    rotary_type = rotary.string("type", "none")
    if rotary_type != "default":
        raise ConversionError(
            f"metadata.yaml: {rotary.where('type')} = {brief(rotary_type)} is not supported; the model uses "
            "Llama-style ('default', rotate_half) rotary embeddings over the whole head. A missing rotary section "
            "means no rotary in Fast-LLM."
        )
    theta = float(rotary.number("theta", _DEFAULT_ROPE_THETA, positive=True))
    rotary.finish()
    settings = {
        "num_attention_heads": mixer.size("heads", _ATTENTION_DEFAULTS["heads"]),
        "num_key_value_heads": mixer.size("head_groups", _ATTENTION_DEFAULTS["head_groups"]),
        "head_dim": mixer.size("head_size", _ATTENTION_DEFAULTS["head_size"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0},
        "attention_bias": attention_bias,
    }
    window = mixer.integer("window_size", None, minimum=1)
    if window is not None:
        settings["sliding_window"] = window
    mixer.finish(frozenset({"type"}))
    return {"settings": settings, "window": window}


def _gdn_settings(mixer: _Fields) -> dict[str, Any]:
    settings = {
        "gdn_num_key_heads": mixer.size("key_heads"),
        "gdn_num_value_heads": mixer.size("value_heads"),
        "gdn_key_head_dim": mixer.size("key_head_dim"),
        "gdn_value_head_dim": mixer.size("value_head_dim"),
        "gdn_conv_kernel_size": _convolution(mixer),
    }
    settings["gdn_norm_eps"], settings["gdn_gate_activation"] = _gated_norm(mixer)
    _linear_layers(mixer, ("qkv_projection_layer", "ba_projection_layer", "output_layer"), False)
    mixer.finish(frozenset({"type"}))
    return {"settings": settings}


def _kda_settings(mixer: _Fields) -> dict[str, Any]:
    settings = {
        "kda_num_heads": mixer.size("heads"),
        "kda_head_dim": mixer.size("head_dim"),
        "kda_conv_kernel_size": _convolution(mixer),
    }
    settings["kda_norm_eps"], settings["kda_gate_activation"] = _gated_norm(mixer)
    _linear_layers(mixer, tuple(f"{n}_projection_layer" for n in ("q", "k", "v", "f_a", "f_b", "g_a", "g_b", "beta",
                                                                   "output")), False)
    mixer.finish(frozenset({"type"}))
    return {"settings": settings}


_MIXER_READERS = {"attention": _attention_settings, "gdn": _gdn_settings, "kda": _kda_settings}


def _block_settings(block: _Fields) -> dict[str, Any]:
    block.expect("type", ("decoder", None), None, "the block type")
    mixer = block.sub("mixer")
    mixer_type = mixer.string("type", "attention")
    if mixer_type not in _MIXER_READERS:
        raise ConversionError(
            f"metadata.yaml: {mixer.where('type')} = {brief(mixer_type)}: unknown mixer type; this converter "
            f"supports {', '.join(sorted(_MIXER_READERS))} (attention, Gated DeltaNet, Kimi Delta Attention)."
        )
    result = {"mixer_type": mixer_type, **_MIXER_READERS[mixer_type](mixer)}
    mlp = block.sub("mlp")
    mlp.expect("type", ("mlp", None), None, "mixture-of-experts or other MLP types")
    mlp.expect("gated", (True,), False, "a non-gated MLP")
    activation = mlp.name("activation", tuple(ACTIVATION_TO_HF), "silu")
    block_fields = {"intermediate_size": mlp.size("intermediate_size"), "hidden_act": ACTIVATION_TO_HF[activation],
                    "mlp_bias": _shared_bias(mlp, ("layer_1", "layer_2"), "mlp_bias")}
    mlp.finish()
    norm = block.sub("normalization")
    norm.expect("type", ("rms_norm",), None, "the block norm must be RMSNorm; Fast-LLM's default is LayerNorm")
    norm.expect("zero_centered", (False,), False, "zero-centred norms")
    block_fields["rms_norm_eps"] = float(norm.number("epsilon", _DEFAULT_NORM_EPS, positive=True))
    norm.sub("weight").finish()
    norm.finish()
    block.finish()
    result["fields"] = {**result["settings"], **block_fields}  # every per-layer field of HybridLinearConfig it sets
    return result


def _num_blocks(decoder: _Fields) -> int:
    num_blocks = decoder.integer("num_blocks", minimum=1)
    if decoder.census is not None:  # before any per-block list is built
        decoder.census.check_block_count(num_blocks, f"metadata.yaml: {decoder.where('num_blocks')} is "
                                                     f"{brief(num_blocks)}")
    return num_blocks


def _decoder_blocks(decoder: _Fields) -> list[tuple[str, dict[str, Any]]]:
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
    settings = {}
    for name in blocks_field.data:
        settings[name] = _block_settings(blocks_field.sub(name))
    blocks_field.finish()
    missing = [name for name in pattern if name not in settings]
    if missing:
        raise ConversionError(f"metadata.yaml: {decoder.where('pattern')} names block(s) {brief(missing)} that "
                              f"{blocks_field.path} does not define")
    decoder.finish()
    return [(pattern[i % len(pattern)], settings[pattern[i % len(pattern)]]) for i in range(num_blocks)]


def _field_group(field: str) -> str:
    """Fields that the config validates together (heads and KV heads, GDN key and value heads, ...) take their
    defaults from one and the same layer, so that the defaults are themselves a valid setting."""
    if field.startswith(("gdn_", "kda_")):
        return field[:3]
    if field in ("intermediate_size", "hidden_act", "mlp_bias", "rms_norm_eps", "sliding_window"):
        return field  # checked alone
    return "attention"


def _defaults_and_overrides(layers: list[tuple[str, dict[str, Any]]], fixed: dict[str, Any]
                            ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The flat fields and, per layer, the fields where it differs from them: HybridLinearConfig's defaults plus
    `per_layer_config`. Each group of related fields takes the setting most layers have (ties: the first layer's);
    `fixed` fields are given."""
    counts: dict[str, dict[str, list]] = {}  # group -> repr(setting) -> [setting, layers with it]
    for _, block in layers:
        groups: dict[str, dict[str, Any]] = {}
        for field, value in block["fields"].items():
            groups.setdefault(_field_group(field), {})[field] = value
        for group, setting in groups.items():
            counts.setdefault(group, {}).setdefault(repr(sorted(setting.items())), [setting, 0])[1] += 1
    defaults: dict[str, Any] = {}
    for settings in counts.values():
        defaults.update(max(settings.values(), key=lambda entry: entry[1])[0])
    defaults.update(fixed)
    overrides = {}
    for index, (_, block) in enumerate(layers):
        differing = {field: value for field, value in block["fields"].items() if value != defaults[field]}
        if differing:
            overrides[index] = differing
    return defaults, overrides


def _config_error(error: Exception, layers: list[tuple[str, dict[str, Any]]]) -> ConversionError:
    """HybridLinearConfig's message, with the Fast-LLM block of the layer it names."""
    message = clip(str(error), 600)  # long enough for a per-layer message with its field names
    match = re.search(r"per_layer_config\[(\d+)\]", message)
    if match and int(match.group(1)) < len(layers):
        message += f" (layer {match.group(1)} is Fast-LLM block {brief(layers[int(match.group(1))][0])})"
    return ConversionError(f"metadata.yaml describes a model HybridLinearConfig rejects: {message}")


def fast_llm_to_hybrid_config(base_model: Mapping[str, Any], weights_hint: str = "",
                              census: TensorCensus | None = None) -> HybridLinearConfig:
    """Builds our config from Fast-LLM's `config.base_model`. `weights_hint` is appended to the message when
    `tied_embedding_weight` is missing (the reader knows whether an output weight was saved). With a `census` of the
    stored tensors, every size is checked against it as it is read, before any per-block table is built."""
    base = _Fields(base_model, "config.base_model", census)
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
    head.expect("final_logit_softcapping", (None,), None, "logit soft-capping")
    head.expect("prediction_heads", (1,), 1, "multi-token prediction heads")
    head_norm = head.sub("normalization")
    head_norm.expect("type", ("rms_norm",), None, "the final norm must be RMSNorm; Fast-LLM's default is LayerNorm")
    head_norm.expect("zero_centered", (False,), False, "zero-centred norms")
    final_eps = float(head_norm.number("epsilon", _DEFAULT_NORM_EPS, positive=True))
    head_norm.sub("weight").finish()
    head_norm.finish()
    head.finish()

    layers = _decoder_blocks(base.sub("decoder"))
    layer_types = []
    for _, block in layers:
        if block["mixer_type"] == "attention":
            layer_types.append("sliding_attention" if block.get("window") else "full_attention")
        else:
            layer_types.append(MIXER_TO_LAYER_TYPE[block["mixer_type"]])

    # The final norm has the flat rms_norm_eps; blocks with another epsilon override it.
    defaults, overrides = _defaults_and_overrides(layers, {"rms_norm_eps": final_eps})
    kwargs: dict[str, Any] = {
        **defaults,
        "vocab_size": vocab_size,
        "hidden_size": base.size("hidden_size"),
        "tie_word_embeddings": base.boolean("tied_embedding_weight", hint=weights_hint),
        "layer_types": layer_types,
        "attention_output_gate": False,
        "attention_qk_norm": False,
        "zero_centered_norms": False,
    }
    for field, value in (("sliding_window", None), ("attention_bias", False)):
        kwargs.setdefault(field, value)
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": _DEFAULT_ROPE_THETA,
                                          "partial_rotary_factor": 1.0})
    if overrides:
        kwargs["per_layer_config"] = overrides
    if max_positions is not None:
        kwargs["max_position_embeddings"] = max_positions
    base.finish(frozenset({"type"}))
    try:
        return HybridLinearConfig(**kwargs)
    except (ValueError, TypeError) as error:
        raise _config_error(error, layers) from None


# The HybridLinearConfig fields a Fast-LLM metadata.yaml carries, by the layer types that use them; the others
# (token ids, initializer_range, use_cache, ...) are not part of Fast-LLM's model config and are not written.
# Per-layer values are compared layer by layer (`fast_llm_carried_layer_fields`): every field of the layer's mixer
# (the config's own MIXER_FIELDS, from each mixer's registration) and of its block.
_CARRIED_ALWAYS = ("vocab_size", "hidden_size", "layer_types", "mlp_types", "num_hidden_layers", "rms_norm_eps",
                   "tie_word_embeddings", "zero_centered_norms")
_CARRIED_BLOCK = ("intermediate_size", "hidden_act", "mlp_bias", "rms_norm_eps")
def fast_llm_carried_fields(config: HybridLinearConfig) -> list[str]:
    """The model-wide fields of `config` that its Fast-LLM metadata expresses (and must read back unchanged)."""
    return list(_CARRIED_ALWAYS)


def fast_llm_carried_layer_fields(layer_type: str) -> tuple[str, ...]:
    """The fields of one layer's resolved config that Fast-LLM's block of that layer expresses."""
    return tuple(MIXER_FIELDS[layer_type]) + _CARRIED_BLOCK


# -------------------------------------------------------------------------------------------- -> Fast-LLM


def _unsupported_for_fast_llm(config: HybridLinearConfig) -> list[str]:
    problems = []
    if config.zero_centered_norms:
        problems.append("zero_centered_norms=True (Fast-LLM's RMSNorm is x_hat * w)")
    for index in distinct_layers(config).values():
        layer = layer_config(config, index)
        where = f"layer {index} ({config.layer_types[index]})"
        if config.mlp_types[index] != "dense":
            problems.append(f"{where}: mlp_types[{index}]={brief(config.mlp_types[index])} (this converter writes only "
                            "Fast-LLM's gated MLP, mlp type 'dense')")
            continue
        if layer.hidden_act not in ACTIVATION_FROM_HF:
            problems.append(f"{where}: hidden_act={brief(layer.hidden_act)} (Fast-LLM's gated MLP takes "
                            f"{', '.join(ACTIVATION_FROM_HF)})")
        if config.layer_types[index] not in ("full_attention", "sliding_attention"):
            continue
        if layer.attention_output_gate:
            problems.append(f"{where}: attention_output_gate=True (Qwen3-Next gated attention)")
        if layer.attention_qk_norm:
            problems.append(f"{where}: attention_qk_norm=True")
        rope = layer.rope_parameters
        if rope.get("rope_type", "default") != "default":
            problems.append(f"{where}: rope_parameters['rope_type']={brief(rope.get('rope_type'))}")
        if rope.get("partial_rotary_factor") != 1.0:
            problems.append(f"{where}: rope_parameters['partial_rotary_factor']="
                            f"{brief(rope.get('partial_rotary_factor'))} (Fast-LLM rotates the whole head)")
    return problems


def _norm(eps: float) -> dict[str, Any]:
    return {"type": "rms_norm", "epsilon": eps}


def _gated_norm_config(eps: float, activation: str) -> dict[str, Any]:
    norm: dict[str, Any] = {"type": "gated_rms_norm", "epsilon": eps}
    if activation != "silu":
        norm["activation"] = activation
    return norm


def _mixer_config(layer: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    """Fast-LLM's mixer config of one layer, from that layer's resolved config."""
    if layer_type in ("full_attention", "sliding_attention"):
        mixer = {"type": "attention", "heads": layer.num_attention_heads, "head_groups": layer.num_key_value_heads,
                 "head_size": layer.head_dim, "add_linear_biases": bool(layer.attention_bias),
                 "rotary": {"type": "default", "theta": float(layer.rope_parameters["rope_theta"])}}
        if layer_type == "sliding_attention":
            mixer["window_size"] = layer.sliding_window
        return mixer
    if layer_type == "gated_deltanet":
        return {"type": "gdn", "key_heads": layer.gdn_num_key_heads, "value_heads": layer.gdn_num_value_heads,
                "key_head_dim": layer.gdn_key_head_dim, "value_head_dim": layer.gdn_value_head_dim,
                "convolution_layer": {"kernel_size": layer.gdn_conv_kernel_size},
                "normalization": _gated_norm_config(layer.gdn_norm_eps, layer.gdn_gate_activation)}
    return {"type": "kda", "heads": layer.kda_num_heads, "head_dim": layer.kda_head_dim,
            "convolution_layer": {"kernel_size": layer.kda_conv_kernel_size},
            "normalization": _gated_norm_config(layer.kda_norm_eps, layer.kda_gate_activation)}


FAST_LLM_BLOCK_NAMES = {"full_attention": "attention", "sliding_attention": "sliding_attention",
                        "gated_deltanet": "gdn", "kimi_delta_attention": "kda"}


def _block_names(config: HybridLinearConfig) -> dict[str, str]:
    """layer setting -> Fast-LLM block name: the layer type's name for its first setting, then `_2`, `_3`, ..."""
    names: dict[str, str] = {}
    used: dict[str, int] = {}
    for setting, index in distinct_layers(config).items():
        base = FAST_LLM_BLOCK_NAMES[config.layer_types[index]]
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
            "mixer": _mixer_config(layer, config.layer_types[index]),
            "mlp": {"type": "mlp", "intermediate_size": layer.intermediate_size, "gated": True,
                    "activation": ACTIVATION_FROM_HF[layer.hidden_act], "add_linear_biases": bool(layer.mlp_bias)},
            "normalization": _norm(layer.rms_norm_eps),
        }
    return {
        "decoder": {"type": "pattern", "blocks": blocks,
                    "pattern": [names[setting] for setting in layer_settings(config)],
                    "num_blocks": config.num_hidden_layers},
        "embeddings": {"vocab_size": config.vocab_size},
        # the final norm's epsilon is the flat default, whatever the blocks override
        "head": {"normalization": _norm(config._getattr_without_heterogeneous_validation("rms_norm_eps"))},
        "hidden_size": config.hidden_size,
        "peft": {"type": "none"},
        "tied_embedding_weight": bool(config.tie_word_embeddings),
    }


__all__ = ["fast_llm_to_hybrid_config", "hybrid_config_to_fast_llm", "fast_llm_carried_fields",
           "fast_llm_carried_layer_fields", "FAST_LLM_VERSION", "MIXER_TO_LAYER_TYPE", "FAST_LLM_BLOCK_NAMES",
           "ACTIVATION_TO_HF", "ACTIVATION_FROM_HF"]

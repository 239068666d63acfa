"""Fast-LLM model config (metadata.yaml `config.base_model`) <-> `HybridLinearConfig`.

Fast-LLM omits fields left at their default. The defaults used here are the ones documented for the fixtures (conv
kernel 4; gated norms: silu gate, epsilon 1e-5; block norms epsilon 1e-5; causal attention with scale
1/sqrt(head_size), no window; rotary theta 1e4) and Fast-LLM's attention defaults (heads 8, head_groups 1,
head_size 128, biases on). Sizes whose default we cannot vouch for must be present. Every field is either mapped,
checked against the one value our model supports, or known to be training-only; anything else is an error naming
the field, never a silent approximation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from ..errors import ConversionError
from ..pipeline import TensorCensus
from ..untrusted import REQUIRED, Fields, brief, clip

FAST_LLM_VERSION = "0.4.0"
METADATA = "metadata.yaml"
_DEFAULT_NORM_EPS = 1e-5
_DEFAULT_CONV_KERNEL = 4
_DEFAULT_ROPE_THETA = 10_000.0
_ATTENTION_DEFAULTS = {"heads": 8, "head_groups": 1, "head_size": 128}

# Where each of our per-mixer fields comes from in a Fast-LLM block (for error messages).
_SOURCE_FIELDS = {
    "num_attention_heads": "mixer.heads", "num_key_value_heads": "mixer.head_groups", "head_dim": "mixer.head_size",
    "rope_theta": "mixer.rotary.theta", "gdn_num_key_heads": "mixer.key_heads",
    "gdn_num_value_heads": "mixer.value_heads", "gdn_key_head_dim": "mixer.key_head_dim",
    "gdn_value_head_dim": "mixer.value_head_dim", "gdn_conv_kernel_size": "mixer.convolution_layer.kernel_size",
    "gdn_norm_eps": "mixer.normalization.epsilon", "gdn_gate_activation": "mixer.normalization.activation",
    "kda_num_heads": "mixer.heads", "kda_head_dim": "mixer.head_dim",
    "kda_conv_kernel_size": "mixer.convolution_layer.kernel_size", "kda_norm_eps": "mixer.normalization.epsilon",
    "kda_gate_activation": "mixer.normalization.activation",
}

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
    biases = mixer.boolean("add_linear_biases", True)
    _linear_layers(mixer, ("query_layer", "key_layer", "value_layer", "dense_layer"), biases)
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
        "rope_theta": theta,
    }
    window = mixer.integer("window_size", None, minimum=1)
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
    mlp.expect("activation", ("silu",), "silu", "the gated MLP's activation")
    _linear_layers(mlp, ("layer_1", "layer_2"), mlp.boolean("add_linear_biases", True))
    result["intermediate_size"] = mlp.size("intermediate_size")
    mlp.finish()
    norm = block.sub("normalization")
    norm.expect("type", ("rms_norm",), None, "the block norm must be RMSNorm; Fast-LLM's default is LayerNorm")
    norm.expect("zero_centered", (False,), False, "zero-centred norms")
    result["rms_norm_eps"] = float(norm.number("epsilon", _DEFAULT_NORM_EPS, positive=True))
    norm.sub("weight").finish()
    norm.finish()
    block.finish()
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


def _merge(per_layer: list[tuple[str, dict[str, Any]]], field: str, value_of) -> Any:
    """The single value of a setting shared by the given layers; an error names the first two that differ."""
    first_name, first = per_layer[0]
    for name, block in per_layer[1:]:
        if value_of(block) != value_of(first):
            raise ConversionError(
                f"metadata.yaml: blocks {brief(first_name)} and {brief(name)} differ in {field} "
                f"({brief(value_of(first))} vs {brief(value_of(block))}); HybridLinearConfig has one value of it per "
                "model."
            )
    return value_of(first)


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

    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": base.size("hidden_size"),
        "tie_word_embeddings": base.boolean("tied_embedding_weight", hint=weights_hint),
        "layer_types": layer_types,
        "intermediate_size": _merge(layers, "mlp.intermediate_size", lambda b: b["intermediate_size"]),
        "rms_norm_eps": _merge(layers, "normalization.epsilon", lambda b: b["rms_norm_eps"]),
        "hidden_act": "silu",
        "mlp_bias": False,
        "attention_bias": False,
        "attention_output_gate": False,
        "attention_qk_norm": False,
        "zero_centered_norms": False,
        "sliding_window": None,
    }
    if final_eps != kwargs["rms_norm_eps"]:
        raise ConversionError(f"metadata.yaml: {head_norm.where('epsilon')} = {final_eps} differs from the blocks' "
                              f"norm epsilon {kwargs['rms_norm_eps']}; HybridLinearConfig has one rms_norm_eps.")
    if max_positions is not None:
        kwargs["max_position_embeddings"] = max_positions
    theta = _DEFAULT_ROPE_THETA
    for mixer_type in ("attention", "gdn", "kda"):
        of_type = [(name, block) for name, block in layers if block["mixer_type"] == mixer_type]
        if not of_type:
            continue
        for field in of_type[0][1]["settings"]:
            kwargs[field] = _merge(of_type, _SOURCE_FIELDS[field], lambda b, f=field: b["settings"][f])
        if mixer_type == "attention":
            theta = kwargs.pop("rope_theta")
            windowed = [(name, block) for name, block in of_type if block.get("window")]
            if windowed:
                kwargs["sliding_window"] = _merge(windowed, "mixer.window_size", lambda b: b["window"])
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0}
    base.finish(frozenset({"type"}))
    try:
        return HybridLinearConfig(**kwargs)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"metadata.yaml describes a model HybridLinearConfig rejects: {clip(str(error))}"
                              ) from None


# The HybridLinearConfig fields a Fast-LLM metadata.yaml carries, by the layer types that use them; the others
# (token ids, initializer_range, use_cache, ...) are not part of Fast-LLM's model config and are not written.
_CARRIED_ALWAYS = ("vocab_size", "hidden_size", "intermediate_size", "layer_types", "num_hidden_layers",
                   "rms_norm_eps", "tie_word_embeddings", "hidden_act", "mlp_bias", "zero_centered_norms")
_CARRIED_BY_LAYER_TYPE = {
    "full_attention": ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters", "attention_bias",
                       "attention_output_gate", "attention_qk_norm"),
    "sliding_attention": ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters",
                          "attention_bias", "attention_output_gate", "attention_qk_norm", "sliding_window"),
    "gated_deltanet": ("gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim", "gdn_value_head_dim",
                       "gdn_conv_kernel_size", "gdn_norm_eps", "gdn_gate_activation"),
    "kimi_delta_attention": ("kda_num_heads", "kda_head_dim", "kda_conv_kernel_size", "kda_norm_eps",
                             "kda_gate_activation"),
}


def fast_llm_carried_fields(config: HybridLinearConfig) -> list[str]:
    """The fields of `config` that its Fast-LLM metadata expresses (and must read back unchanged)."""
    fields = dict.fromkeys(_CARRIED_ALWAYS)
    for layer_type in dict.fromkeys(config.layer_types):
        fields.update(dict.fromkeys(_CARRIED_BY_LAYER_TYPE[layer_type]))
    return list(fields)


# -------------------------------------------------------------------------------------------- -> Fast-LLM


def _unsupported_for_fast_llm(config: HybridLinearConfig) -> list[str]:
    problems = []
    if config.zero_centered_norms:
        problems.append("zero_centered_norms=True (Fast-LLM's RMSNorm is x_hat * w)")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={brief(config.hidden_act)} (only a gated silu MLP converts)")
    if config.mlp_bias:
        problems.append("mlp_bias=True")
    if config.layers_of_type("full_attention", "sliding_attention"):
        if config.attention_output_gate:
            problems.append("attention_output_gate=True (Qwen3-Next gated attention)")
        if config.attention_qk_norm:
            problems.append("attention_qk_norm=True")
        if config.attention_bias:
            problems.append("attention_bias=True")
        rope = config.rope_parameters
        if rope.get("rope_type", "default") != "default":
            problems.append(f"rope_parameters['rope_type']={brief(rope.get('rope_type'))}")
        if rope.get("partial_rotary_factor") != 1.0:
            problems.append(f"rope_parameters['partial_rotary_factor']={brief(rope.get('partial_rotary_factor'))} "
                            "(Fast-LLM rotates the whole head)")
    return problems


def _norm(eps: float) -> dict[str, Any]:
    return {"type": "rms_norm", "epsilon": eps}


def _gated_norm_config(eps: float, activation: str) -> dict[str, Any]:
    norm: dict[str, Any] = {"type": "gated_rms_norm", "epsilon": eps}
    if activation != "silu":
        norm["activation"] = activation
    return norm


def _mixer_config(config: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    if layer_type in ("full_attention", "sliding_attention"):
        mixer = {"type": "attention", "heads": config.num_attention_heads, "head_groups": config.num_key_value_heads,
                 "head_size": config.head_dim, "add_linear_biases": False,
                 "rotary": {"type": "default", "theta": float(config.rope_parameters["rope_theta"])}}
        if layer_type == "sliding_attention":
            mixer["window_size"] = config.sliding_window
        return mixer
    if layer_type == "gated_deltanet":
        return {"type": "gdn", "key_heads": config.gdn_num_key_heads, "value_heads": config.gdn_num_value_heads,
                "key_head_dim": config.gdn_key_head_dim, "value_head_dim": config.gdn_value_head_dim,
                "convolution_layer": {"kernel_size": config.gdn_conv_kernel_size},
                "normalization": _gated_norm_config(config.gdn_norm_eps, config.gdn_gate_activation)}
    return {"type": "kda", "heads": config.kda_num_heads, "head_dim": config.kda_head_dim,
            "convolution_layer": {"kernel_size": config.kda_conv_kernel_size},
            "normalization": _gated_norm_config(config.kda_norm_eps, config.kda_gate_activation)}


FAST_LLM_BLOCK_NAMES = {"full_attention": "attention", "sliding_attention": "sliding_attention",
                        "gated_deltanet": "gdn", "kimi_delta_attention": "kda"}


def hybrid_config_to_fast_llm(config: HybridLinearConfig) -> dict[str, Any]:
    """Fast-LLM's `config.base_model` for our config, or a ConversionError listing what Fast-LLM cannot express."""
    problems = _unsupported_for_fast_llm(config)
    if problems:
        raise ConversionError("this model cannot be expressed as a Fast-LLM model: " + "; ".join(problems) + ".")
    blocks = {}
    for layer_type in dict.fromkeys(config.layer_types):
        blocks[FAST_LLM_BLOCK_NAMES[layer_type]] = {
            "type": "decoder",
            "mixer": _mixer_config(config, layer_type),
            "mlp": {"type": "mlp", "intermediate_size": config.intermediate_size, "gated": True,
                    "activation": "silu", "add_linear_biases": False},
            "normalization": _norm(config.rms_norm_eps),
        }
    return {
        "decoder": {"type": "pattern", "blocks": blocks,
                    "pattern": [FAST_LLM_BLOCK_NAMES[t] for t in config.layer_types],
                    "num_blocks": config.num_hidden_layers},
        "embeddings": {"vocab_size": config.vocab_size},
        "head": {"normalization": _norm(config.rms_norm_eps)},
        "hidden_size": config.hidden_size,
        "peft": {"type": "none"},
        "tied_embedding_weight": bool(config.tie_word_embeddings),
    }


__all__ = ["fast_llm_to_hybrid_config", "hybrid_config_to_fast_llm", "fast_llm_carried_fields", "FAST_LLM_VERSION",
           "MIXER_TO_LAYER_TYPE", "FAST_LLM_BLOCK_NAMES"]

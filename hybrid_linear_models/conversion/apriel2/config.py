"""Apriel2's `config.json` (model_type "apriel2_text", Fast-LLM's own Hugging Face export) -> `HybridLinearConfig`.

Apriel2 keeps Fast-LLM's decoder structure in Hugging Face spelling: `decoder.type` "fixed" (one `block` repeated
`num_blocks` times) or "pattern" (named `blocks`, a `pattern` of their names repeated to `num_blocks`), each block
with a `mixer`, an `mlp` and a `normalization`. Blocks that differ become per-layer settings through the same
defaults + `per_layer_config` logic as the Fast-LLM reader (`fast_llm.config._defaults_and_overrides`).

The math of a converted model is that of Apriel2's own modeling code (`modeling_apriel2.py`, Fast-LLM commit
7d61a1b), which agrees with Fast-LLM's model wherever the config records it. Where `config.json` does not record a
setting the math needs, this reader uses the default Apriel2's modeling code assumes, and says so here:

- Gated DeltaNet's output norm: Fast-LLM's exporter never writes it; Apriel2 reads `norm_eps` (default 1e-5) and
  always gates with silu. A model trained with another epsilon or a sigmoid gate converts to silu / 1e-5, exactly as
  Apriel2's own model would run it (and as the fixtures were trained).
- Kimi Delta Attention's output norm: `normalization.epsilon` is written; its gate `normalization.activation` is not
  (Apriel2 defaults to silu, Fast-LLM's default; Kimi's is sigmoid). Read when present, else silu.
- Short convolutions: kernel size written; the activation is silu (GDN reads `convolution_layer.activation`, KDA
  hard-codes silu); no bias.
- Attention: causal, softmax scale 1/sqrt(head_size) (Apriel2 ignores `softmax_scale_power`; only 0.5 is accepted),
  Llama-style rotary (`mistral_1d`) over the whole head. `head_groups` defaults to `heads`. Biases per projection
  (`{query,key,value,dense}_layer.bias.enabled`, else `add_linear_biases`): q, k and v must agree (our
  `attention_bias`), the dense layer's is `attention_output_bias`; q/k/v that differ are refused, naming the block.
- Block norms: Apriel2 builds every block's RMSNorm with the HEAD's epsilon (`head.normalization.epsilon`) and
  ignores the block's own `normalization.epsilon`; Fast-LLM uses the block's. A block epsilon that differs from the
  head's is refused (the two models disagree), so the converted model matches both.
- GDN/KDA head counts and dims, when absent, take Apriel2's modeling defaults (GDN 32 value heads, 8 key heads, dims
  64; KDA 32 heads of dim 64); the stored tensors' shapes then confirm them.

Refused, naming the block and field: mamba mixers, rotary other than `mistral_1d`, non-gated or biased MLPs (Apriel2
builds gated MLPs with transformers' MistralMLP, which has no biases, so a config asking for them describes weights
Apriel2 itself would not load), LayerNorm blocks, attention without an explicit `add_linear_biases` (Fast-LLM's
exporter omits it when biases are ON while Apriel2's modeling reads a missing value as OFF: ambiguous), bidirectional
attention, and any field not listed here.

Stochastic ("supernet") mixers hold several mixers under `mixers` and use `main_mixer_name` at inference (a
training model samples one per step): the main mixer is converted and the other mixers' tensors are skipped, each
one listed in the source's `skipped`. A stochastic mixer without `main_mixer_name` is refused: Apriel2's mixer
would then run its first mixer while its cache assumes attention.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...configuration_hybrid_linear import BLOCK_FIELDS, HybridLinearConfig
from ..errors import ConversionError
from ..fast_llm.config import ACTIVATION_FROM_HF, _defaults_and_overrides, pattern_layers
from ..pipeline import TensorCensus
from ..untrusted import REQUIRED, Fields, brief, clip

MODEL_TYPE = "apriel2_text"
CONFIG_FILE = "config.json"
BLOCK_PREFIX = "model.decoder.blocks."

_NORM_EPS = 1e-5  # Apriel2's default for every norm epsilon (configuration_apriel2 / modeling_apriel2)
_CONV_KERNEL = 4
_MAX_POSITIONS = 2048  # Apriel2TextConfig's default embeddings.max_position_embeddings
_GDN_DEFAULTS = {"value_heads": 32, "key_heads": 8, "key_head_dim": 64, "value_head_dim": 64}
_KDA_DEFAULTS = {"heads": 32, "head_dim": 64}
_TOKEN_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}  # Apriel2TextConfig's

# Top-level config.json keys that describe the file, not the model's math.
IRRELEVANT_TOP_LEVEL = frozenset({"architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"})
# Training-only mixer keys: initialisation, and how a supernet samples its mixers while training.
_TRAINING_ONLY = frozenset({"initialization", "lr_scale", "dt_bias_weight", "a_log_weight", "sampling_strategy",
                            "sampling_weights"})


class _Fields(Fields):
    """A mapping of config.json read through typed getters; sizes bounded by the stored tensors (`census`)."""

    def __init__(self, data: Any, path: str, census: TensorCensus | None = None):
        super().__init__(data, path, CONFIG_FILE)
        self.census = census

    def _child(self, data: Any, path: str) -> _Fields:
        return _Fields(data, path, self.census)

    def size(self, key: str, default: Any = REQUIRED) -> int:
        census = self.census
        return self.integer(key, default, minimum=1, maximum=census.elements if census else None,
                            too_large=census.elements_phrase if census else "")

    def finish(self, ignorable: frozenset = frozenset()) -> None:
        unknown = self.unread(_TRAINING_ONLY | ignorable)
        if unknown:
            raise ConversionError(f"{CONFIG_FILE}: field(s) {clip(', '.join(unknown))} not supported by the apriel2 "
                                  "converter (they may change the model's math, and HybridLinearConfig cannot "
                                  "express them); remove them if they are at Apriel2's defaults.")

    def refuse(self, key: str, value: Any, meaning: str) -> ConversionError:
        return ConversionError(f"{CONFIG_FILE}: {self.where(key)} = {brief(value)} is not supported ({meaning}).")


def _linear_biases(module: _Fields, names: tuple[str, ...], default: bool | None) -> dict[str, bool]:
    """Whether each linear layer `names` of `module` has a bias: `{name}.bias.enabled`, else `add_linear_biases`,
    else `default` (None: `add_linear_biases` must be given when a layer leaves its bias to it)."""
    explicit = {}
    for name in names:
        layer = module.sub(name)
        bias = layer.sub("bias")
        explicit[name] = bias.boolean("enabled", None)
        bias.finish()
        layer.finish()
    if default is None and None in explicit.values() and not module.has("add_linear_biases"):
        raise ConversionError(
            f"{CONFIG_FILE} does not give {module.where('add_linear_biases')}: Fast-LLM's exporter leaves it out when "
            "the attention HAS biases, while Apriel2's modeling code reads a missing value as no biases, so the file "
            "is ambiguous; add add_linear_biases: true or false as the model was trained.")
    shared = module.boolean("add_linear_biases", default)
    return {name: shared if value is None else value for name, value in explicit.items()}


def _bias_switch(module: _Fields, names: tuple[str, ...], default: bool | None, what: str) -> bool:
    """Whether the linear layers `names` of `module` have biases (`_linear_biases`). Our model has one switch for
    them, so they must agree."""
    enabled = _linear_biases(module, names, default)
    if len(set(enabled.values())) > 1:
        listing = ", ".join(f"{name}: {'bias' if on else 'no bias'}" for name, on in enabled.items())
        raise ConversionError(f"{CONFIG_FILE}: {module.path} mixes linear layers with and without biases ({listing}); "
                              f"HybridLinearConfig has one switch for the {what}, so give them the same bias.enabled.")
    return next(iter(enabled.values()))


def _convolution(mixer: _Fields, required: bool) -> int:
    if required and not mixer.has("convolution_layer"):
        raise mixer.missing("convolution_layer", " (Apriel2's Gated DeltaNet requires convolution_layer.kernel_size)")
    conv = mixer.sub("convolution_layer")
    kernel = conv.size("kernel_size", REQUIRED if required else _CONV_KERNEL)
    conv.expect("activation", ("silu",), "silu", "the short convolution's activation")
    conv.finish()
    return kernel


# ---------------------------------------------------------------------------------------------------- mixers


def _attention(mixer: _Fields) -> dict[str, Any]:
    mixer.expect("causal", (True,), True, "bidirectional attention")
    mixer.expect("softmax_scale_power", (0.5,), 0.5, "Apriel2 always scales by 1/sqrt(head_size)")
    mixer.boolean("cross_document_attention", None)  # only with Apriel2's `sequence_lengths` (images); irrelevant
    heads = mixer.size("heads")
    rotary = mixer.sub("rotary")
    rotary_type = rotary.string("type")
    if rotary_type != "mistral_1d":
        raise rotary.refuse("type", rotary_type, "Apriel2's text model builds 'mistral_1d' rotary embeddings "
                                                 "(Llama-style rotate_half over the whole head), the only kind "
                                                 "HybridLinearConfig expresses here")
    theta = float(rotary.number("theta", positive=True))
    rotary.finish()
    settings = {
        "num_attention_heads": heads,
        "num_key_value_heads": mixer.size("head_groups", heads),
        "head_dim": mixer.size("head_size"),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0},
        # Apriel2 gives each projection its own bias (modeling_apriel2.py, Apriel2Attention); ours switches q, k and
        # v together (attention_bias) and o_proj alone (attention_output_bias)
        "attention_bias": _bias_switch(mixer, ("query_layer", "key_layer", "value_layer"), None,
                                       "query, key and value projections (attention_bias; the dense layer has its "
                                       "own, attention_output_bias)"),
        "attention_output_bias": _linear_biases(mixer, ("dense_layer",), None)["dense_layer"],
    }
    window = mixer.integer("window_size", None, minimum=1)
    layer_type = "full_attention"
    if window is not None:
        settings["sliding_window"] = window
        layer_type = "sliding_attention"
    mixer.finish(frozenset({"type"}))
    return {"layer_type": layer_type, "settings": settings}


def _gdn(mixer: _Fields) -> dict[str, Any]:
    settings = {
        "gdn_num_value_heads": mixer.size("value_heads", _GDN_DEFAULTS["value_heads"]),
        "gdn_num_key_heads": mixer.size("key_heads", _GDN_DEFAULTS["key_heads"]),
        "gdn_key_head_dim": mixer.size("key_head_dim", _GDN_DEFAULTS["key_head_dim"]),
        "gdn_value_head_dim": mixer.size("value_head_dim", _GDN_DEFAULTS["value_head_dim"]),
        "gdn_conv_kernel_size": _convolution(mixer, required=True),
        "gdn_norm_eps": float(mixer.number("norm_eps", _NORM_EPS, positive=True)),
        "gdn_gate_activation": "silu",  # Apriel2's GatedRMSNormalization default; not configurable for GDN
    }
    mixer.finish(frozenset({"type"}))
    return {"layer_type": "gated_deltanet", "settings": settings}


def _kda(mixer: _Fields) -> dict[str, Any]:
    settings = {
        "kda_num_heads": mixer.size("heads", _KDA_DEFAULTS["heads"]),
        "kda_head_dim": mixer.size("head_dim", _KDA_DEFAULTS["head_dim"]),
        "kda_conv_kernel_size": _convolution(mixer, required=False),
    }
    norm = mixer.sub("normalization")
    settings["kda_norm_eps"] = float(norm.number("epsilon", _NORM_EPS, positive=True))
    settings["kda_gate_activation"] = norm.name("activation", ("silu", "sigmoid"), "silu")
    norm.finish()
    mixer.finish(frozenset({"type"}))
    return {"layer_type": "kimi_delta_attention", "settings": settings}


MIXER_READERS = {"attention": _attention, "gdn": _gdn, "kda": _kda}
_REFUSED_MIXERS = {"mamba": "Mamba (SSM) mixers are not one of HybridLinearConfig's layer types"}


def _leaf_mixer(mixer: _Fields) -> dict[str, Any]:
    mixer_type = mixer.string("type", "attention")
    if mixer_type in _REFUSED_MIXERS:
        raise mixer.refuse("type", mixer_type, _REFUSED_MIXERS[mixer_type])
    if mixer_type not in MIXER_READERS:
        nested = " inside a stochastic mixer" if mixer_type == "stochastic" else ""
        raise mixer.refuse("type", mixer_type, f"unknown mixer type{nested}; the apriel2 converter reads "
                                               f"{', '.join(sorted(MIXER_READERS))} and stochastic")
    return MIXER_READERS[mixer_type](mixer)


@dataclass(frozen=True)
class StochasticChoice:
    """A supernet mixer: the name of the one used at inference, and the names of those whose tensors are skipped."""

    main: str
    others: tuple[str, ...]


def _mixer(mixer: _Fields) -> dict[str, Any]:
    if mixer.string("type", "attention") != "stochastic":
        return {**_leaf_mixer(mixer), "stochastic": None}
    mixers = mixer.sub("mixers")
    names = list(mixers.data)
    if not names:
        raise mixer.refuse("mixers", mixers.data, "a stochastic mixer needs at least one mixer")
    main = mixer.string("main_mixer_name", None)
    if main is None:
        raise ConversionError(
            f"{CONFIG_FILE} does not give {mixer.where('main_mixer_name')}: which of the stochastic mixer's mixers "
            f"({clip(', '.join(map(str, names)))}) runs at inference is undefined (Apriel2's mixer would take the "
            "first, its cache would assume attention); add main_mixer_name naming the mixer to convert.")
    if main not in mixers.data:
        raise mixer.refuse("main_mixer_name", main, f"it names none of the mixers {clip(', '.join(map(str, names)))}")
    result = _leaf_mixer(mixers.sub(main))
    for name in names:  # the others are not converted: only their shape as mappings is checked
        if name != main:
            mixers.mapping(name)
    mixer.finish(frozenset({"type"}))
    return {**result, "stochastic": StochasticChoice(main, tuple(str(n) for n in names if n != main))}


# ---------------------------------------------------------------------------------------------------- blocks


def _block(block: _Fields, head_eps: float) -> dict[str, Any]:
    result = _mixer(block.sub("mixer"))
    mlp = block.sub("mlp")
    mlp_type = mlp.string("type", "mlp")
    if mlp_type != "mlp":
        raise mlp.refuse("type", mlp_type, "only the plain (gated) MLP converts")
    if mlp.get("gated", False) is not True:
        raise mlp.refuse("gated", mlp.get("gated"), "Apriel2 defaults to a non-gated MLP, which HybridLinearConfig "
                                                     "cannot express; only gated: true converts")
    activation = mlp.name("activation", tuple(ACTIVATION_FROM_HF), "silu")
    if _bias_switch(mlp, ("layer_1", "layer_2"), False, "MLP projections"):
        raise ConversionError(f"{CONFIG_FILE}: {mlp.path} asks for MLP biases, but Apriel2 builds gated MLPs with "
                              "transformers' MistralMLP, which has none (its own model would ignore them); convert "
                              "the fast_llm checkpoint instead, or set add_linear_biases: false if the model has none.")
    block_fields = {"intermediate_size": mlp.size("intermediate_size"), "hidden_act": activation, "mlp_bias": False}
    mlp.finish()
    norm = block.sub("normalization")
    norm_type = norm.string("type", "rms_norm")
    if norm_type != "rms_norm":
        raise norm.refuse("type", norm_type, "only RMSNorm blocks convert")
    eps = norm.number("epsilon", None, positive=True)
    if eps is not None and float(eps) != head_eps:
        raise ConversionError(
            f"{CONFIG_FILE}: {norm.where('epsilon')} is {brief(eps)} but head.normalization.epsilon is "
            f"{brief(head_eps)}: Apriel2 builds every block norm with the head's epsilon while Fast-LLM uses the "
            "block's, so the two models differ; convert the fast_llm checkpoint instead.")
    block_fields["rms_norm_eps"] = head_eps
    norm.finish()
    block.finish()
    result["fields"] = {**result["settings"], **block_fields}
    result["groups"] = {field: _field_group(result["layer_type"], field) for field in result["fields"]}
    return result


def _field_group(layer_type: str, field: str) -> str:
    """Fields whose flat defaults are chosen together, from one and the same layer, so that the defaults are
    themselves a valid setting: one mixer's fields; the block's fields and the window (only sliding layers have one)
    each alone. The grouping of the Fast-LLM reader, whose `_defaults_and_overrides` picks the defaults."""
    if field in BLOCK_FIELDS or field == "sliding_window":
        return field
    return "attention" if layer_type in ("full_attention", "sliding_attention") else layer_type


def _decoder_blocks(decoder: _Fields, head_eps: float) -> list[tuple[str, dict[str, Any]]]:
    """(block name, settings) per layer, for `fixed` and `pattern` decoders."""
    decoder_type = decoder.string("type", "fixed")
    num_blocks = decoder.integer("num_blocks", minimum=1)
    if decoder.census is not None:  # before any per-block list is built
        decoder.census.check_block_count(num_blocks, f"{CONFIG_FILE}: {decoder.where('num_blocks')} is "
                                                     f"{brief(num_blocks)}")
    if decoder_type == "fixed":
        block = _block(decoder.sub("block"), head_eps)
        decoder.finish()
        return [("block", block)] * num_blocks
    if decoder_type != "pattern":
        raise decoder.refuse("type", decoder_type, "the decoder is 'fixed' or 'pattern'")
    blocks = decoder.sub("blocks")
    pattern = decoder.sequence("pattern", item=str, non_empty=True)
    settings = {name: _block(blocks.sub(name), head_eps) for name in blocks.data}
    blocks.finish()
    missing = [name for name in pattern if name not in settings]
    if missing:
        raise ConversionError(f"{CONFIG_FILE}: {decoder.where('pattern')} names block(s) {brief(missing)} that "
                              f"{blocks.path} does not define; add them or fix the pattern.")
    decoder.finish()
    return pattern_layers(pattern, settings, num_blocks)


# ---------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Apriel2Model:
    """What config.json says: our config, and per layer the stochastic mixer choice (None for plain mixers)."""

    config: HybridLinearConfig
    stochastic: tuple[StochasticChoice | None, ...]


def _token_id(fields: _Fields, key: str) -> Any:
    value = fields.get(key, _TOKEN_DEFAULTS[key])
    ids = value if key == "eos_token_id" and isinstance(value, list) and value else [value]
    for entry in ids:
        if entry is not None and (not isinstance(entry, int) or isinstance(entry, bool) or entry < 0):
            raise fields.wrong(key, "a non-negative integer or null", value)
    return value


def _config_error(error: Exception, layers: list[tuple[str, dict[str, Any]]], defaults: dict[str, Any]
                  ) -> ConversionError:
    """HybridLinearConfig's message, with the Apriel2 block(s) it is about: the layer it names, else the blocks
    whose value of the first field it names became the flat default."""
    message = clip(str(error), 600)
    match = re.search(r"per_layer_config\[(\d+)\]", message)
    if match and int(match.group(1)) < len(layers):
        message += f" (layer {match.group(1)} is Apriel2 block {brief(layers[int(match.group(1))][0])})"
    else:
        field = next((name for name in re.findall(r"(\w+)=", message) if name in defaults), None)
        names = list(dict.fromkeys(name for name, block in layers if field in block["fields"]
                                   and block["fields"][field] == defaults[field]))
        if names:
            message += f" ({field} of Apriel2 block(s) {clip(', '.join(map(repr, names)))})"
    return ConversionError(f"{CONFIG_FILE} describes a model HybridLinearConfig rejects: {message}")


def check_model_type(data: Any, label: str = CONFIG_FILE) -> None:
    """config.json must be an apriel2_text model (the multimodal `apriel2` has a vision encoder we do not convert)."""
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type != MODEL_TYPE:
        hint = {"hybrid_linear": " It is this project's format: use --from hf.",
                "apriel2": " It is Apriel2's multimodal model; only the text model (apriel2_text) converts."}
        known = hint.get(model_type, "") if isinstance(model_type, str) else ""  # (a list is not a dict key)
        raise ConversionError(f"{label} has model_type {brief(model_type)}; --from apriel2 reads {MODEL_TYPE!r} "
                              f"folders (Fast-LLM's Hugging Face export).{known}")


def apriel2_to_hybrid_config(data: Any, census: TensorCensus | None = None) -> Apriel2Model:
    """Builds our config from Apriel2's config.json (parsed). With a `census` of the stored tensors, every size is
    checked against it as it is read, before any per-block table is built."""
    check_model_type(data)
    top = _Fields(data, "", census)
    top.get("model_type")
    head = top.sub("head")
    head_norm = head.sub("normalization")
    head_norm.expect("type", ("rms_norm",), "rms_norm", "the final norm is RMSNorm")
    head_eps = float(head_norm.number("epsilon", _NORM_EPS, positive=True))
    head_norm.finish()
    head.finish()
    embeddings = top.sub("embeddings")
    max_positions = embeddings.integer("max_position_embeddings", _MAX_POSITIONS, minimum=1)
    embeddings.finish()
    vocab_size, hidden_size = top.size("vocab_size"), top.size("hidden_size")

    layers = _decoder_blocks(top.sub("decoder"), head_eps)
    defaults, overrides = _defaults_and_overrides(layers, {"rms_norm_eps": head_eps})
    kwargs: dict[str, Any] = {
        **defaults,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "tie_word_embeddings": top.boolean("tie_word_embeddings", False),
        "layer_types": [block["layer_type"] for _, block in layers],
        "attention_output_gate": False,
        "attention_qk_norm": False,
        "zero_centered_norms": False,
        "max_position_embeddings": max_positions,
        "use_cache": top.boolean("use_cache", True),
        **{key: _token_id(top, key) for key in _TOKEN_DEFAULTS},
    }
    for field, value in (("sliding_window", None), ("attention_bias", False), ("attention_output_bias", False)):
        kwargs.setdefault(field, value)
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10_000.0,
                                          "partial_rotary_factor": 1.0})
    if overrides:
        kwargs["per_layer_config"] = overrides
    top.finish(IRRELEVANT_TOP_LEVEL)
    try:
        config = HybridLinearConfig(**kwargs)
    except (ValueError, TypeError) as error:
        raise _config_error(error, layers, defaults) from None
    return Apriel2Model(config, tuple(block["stochastic"] for _, block in layers))


__all__ = ["apriel2_to_hybrid_config", "check_model_type", "Apriel2Model", "StochasticChoice", "MODEL_TYPE",
           "CONFIG_FILE", "BLOCK_PREFIX", "IRRELEVANT_TOP_LEVEL", "MIXER_READERS"]

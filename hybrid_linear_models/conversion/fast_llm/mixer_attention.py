"""Fast-LLM's `attention` mixer <-> our `full_attention` / `sliding_attention` layers.

Fast-LLM's attention (fast_llm/layers/attention): `heads` query heads and `head_groups` KV heads of `head_size`,
causal softmax scaled by head_size^-1/2 (`softmax_scale_power` 0.5), Llama-style rotary (`rotary.type: default`,
rotate_half over the whole head), an optional `window_size` (a sliding window), and biases on the query, key, value
and dense layers (each layer's `bias.enabled`, else the mixer's `add_linear_biases`, default true). Keys and values
share one stored projection, `key_value` (K rows then V rows). Our attention can also gate its output and normalise
q/k per head (Qwen3-Next) and rotate part of the head: Fast-LLM's cannot, so such layers are refused when writing.

Biases: Fast-LLM builds `key_value` from `key_layer`'s config (its `value_layer` is declared but unused: read here
and ignored, as there), so q, k and v can differ only as query vs key/value; ours has one switch for the three
(`attention_bias`) and one for the dense layer (`attention_output_bias`). A block whose query_layer and key_layer
disagree is refused, naming them: no known model family (Llama, Mistral, Qwen2, Apriel) has such biases. The writer
gives `add_linear_biases` alone when the two switches agree, else `add_linear_biases: false` and each layer's
`bias.enabled`, as Fast-LLM's Qwen2 importer does (q/k/v true, dense false). The dense bias is not tensor-parallel
(its output is the hidden size), so in the `distributed` buffer it sorts with the norms, whether or not the q/k/v
biases exist.
"""

from __future__ import annotations

from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import IDENTITY, SPLIT_HALVES
from ..errors import ConversionError
from ..untrusted import brief
from .metadata_fields import MetadataFields, linear_biases
from .mixers import FastLlmMixer, register
from .parameter_spec import ALWAYS, NEVER, Parameter, Rule, bias, same

DEFAULT_ROPE_THETA = 10_000.0
_DEFAULTS = {"heads": 8, "head_groups": 1, "head_size": 128}  # Fast-LLM's AttentionConfig defaults
_QKV_LAYERS = ("query_layer", "key_layer", "value_layer")  # our attention_bias (written to all three)
_READ_QKV_LAYERS = ("query_layer", "key_layer")  # what Fast-LLM builds from (key_value follows key_layer)
_DENSE_LAYER = "dense_layer"  # our attention_output_bias


def _biases(mixer: MetadataFields) -> tuple[bool, bool]:
    """(attention_bias, attention_output_bias) of a Fast-LLM attention mixer config."""
    enabled = linear_biases(mixer, (*_QKV_LAYERS, _DENSE_LAYER))  # (value_layer's read, and not used)
    qk = {name: enabled[name] for name in _READ_QKV_LAYERS}
    if len(set(qk.values())) > 1:
        listing = ", ".join(f"{name}: {'bias' if on else 'no bias'}" for name, on in qk.items())
        raise ConversionError(
            f"metadata.yaml: {mixer.path} gives its query and key layers different biases ({listing}; Fast-LLM's "
            "key_value follows key_layer); HybridLinearConfig's attention_bias switches the q, k and v projections "
            "together (the dense layer has its own, attention_output_bias), so give query_layer and key_layer the "
            "same bias.enabled."
        )
    return enabled["query_layer"], enabled[_DENSE_LAYER]


def read(mixer: MetadataFields) -> tuple[str, dict[str, Any]]:
    mixer.expect("causal", (True,), True, "bidirectional attention")
    mixer.expect("softmax_scale_power", (0.5,), 0.5, "the softmax scale must be 1/sqrt(head_size)")
    for name in ("query_norm", "key_norm", "value_norm"):
        mixer.expect(name, (None,), None, "per-head q/k/v norms in Fast-LLM's layout")
    mixer.expect("shared_key_value", (False,), False, "one projection shared by keys and values")
    attention_bias, output_bias = _biases(mixer)
    rotary = mixer.sub("rotary")
    rotary_type = rotary.string("type", "none")
    if rotary_type != "default":
        raise ConversionError(
            f"metadata.yaml: {rotary.where('type')} = {brief(rotary_type)} is not supported; the model uses "
            "Llama-style ('default', rotate_half) rotary embeddings over the whole head. A missing rotary section "
            "means no rotary in Fast-LLM."
        )
    theta = float(rotary.number("theta", DEFAULT_ROPE_THETA, positive=True))
    rotary.finish()
    settings = {
        "num_attention_heads": mixer.size("heads", _DEFAULTS["heads"]),
        "num_key_value_heads": mixer.size("head_groups", _DEFAULTS["head_groups"]),
        "head_dim": mixer.size("head_size", _DEFAULTS["head_size"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0},
        "attention_bias": attention_bias,
        "attention_output_bias": output_bias,
    }
    window = mixer.integer("window_size", None, minimum=1)
    if window is not None:
        settings["sliding_window"] = window
    mixer.finish(frozenset({"type"}))
    return ("sliding_attention" if window else "full_attention"), settings


def write(layer: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    qkv_bias, output_bias = bool(layer.attention_bias), bool(layer.attention_output_bias)
    mixer = {"type": "attention", "heads": layer.num_attention_heads, "head_groups": layer.num_key_value_heads,
             "head_size": layer.head_dim, "add_linear_biases": qkv_bias and output_bias,
             "rotary": {"type": "default", "theta": float(layer.rope_parameters["rope_theta"])}}
    if qkv_bias != output_bias:  # per-layer overrides, as Fast-LLM's Qwen2 importer writes them
        mixer.update({name: {"bias": {"enabled": qkv_bias}} for name in _QKV_LAYERS})
        mixer[_DENSE_LAYER] = {"bias": {"enabled": output_bias}}
    if layer_type == "sliding_attention":
        mixer["window_size"] = layer.sliding_window
    return mixer


def unsupported(layer: HybridLinearConfig) -> list[str]:
    problems = []
    if layer.attention_output_gate:
        problems.append("attention_output_gate=True (Qwen3-Next gated attention)")
    if layer.attention_qk_norm:
        problems.append("attention_qk_norm=True")
    rope = layer.rope_parameters
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters['rope_type']={brief(rope.get('rope_type'))}")
    if rope.get("partial_rotary_factor") != 1.0:
        problems.append(f"rope_parameters['partial_rotary_factor']={brief(rope.get('partial_rotary_factor'))} "
                        "(Fast-LLM rotates the whole head)")
    return problems


_BIAS: Rule = lambda config: bool(config.attention_bias)  # noqa: E731
_OUTPUT_BIAS: Rule = lambda config: bool(config.attention_output_bias)  # noqa: E731
_KV_HEADS: Rule = lambda config: config.num_key_value_heads > 1  # noqa: E731  (MQA: key_value is not split)
PARAMETERS = (
    same("mixer.query.weight", "self_attn.q_proj.weight"),
    bias("mixer.query.bias", IDENTITY, "self_attn.q_proj.bias", ALWAYS, _BIAS),
    Parameter("mixer.key_value.weight", SPLIT_HALVES, ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              tensor_parallel=_KV_HEADS),
    bias("mixer.key_value.bias", SPLIT_HALVES, ("self_attn.k_proj.bias", "self_attn.v_proj.bias"), _KV_HEADS, _BIAS),
    same("mixer.dense.weight", "self_attn.o_proj.weight"),
    bias("mixer.dense.bias", IDENTITY, "self_attn.o_proj.bias", NEVER, _OUTPUT_BIAS),
)

ATTENTION = register(FastLlmMixer(
    type_name="attention",
    description="attention",
    block_names={"full_attention": "attention", "sliding_attention": "sliding_attention"},
    read=read,
    write=write,
    parameters=PARAMETERS,
    field_sources={"num_attention_heads": "mixer.heads", "num_key_value_heads": "mixer.head_groups",
                   "head_dim": "mixer.head_size", "rope_parameters": "mixer.rotary.theta",
                   "attention_bias": "mixer.add_linear_biases",
                   "attention_output_bias": "mixer.dense_layer.bias.enabled", "sliding_window": "mixer.window_size"},
    unsupported=unsupported,
    checked_alone=("sliding_window",),  # only sliding layers have one
    # what a model gets when no layer sets them, and what Fast-LLM's attention always is
    config_defaults={"sliding_window": None, "attention_bias": False, "attention_output_bias": False,
                     "attention_output_gate": False,
                     "attention_qk_norm": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA,
                                         "partial_rotary_factor": 1.0}},
))

__all__ = ["ATTENTION", "PARAMETERS", "DEFAULT_ROPE_THETA"]

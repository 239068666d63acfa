"""`HybridLinearConfig` -> Apriel2's `config.json` (model_type "apriel2_text"), the way Fast-LLM's exporter writes it.

One named block per distinct layer setting, named as the fast_llm writer names them (`attention`,
`sliding_attention`, `gdn`, `kda`, then `_2`, `_3`, ...), a `pattern` decoder over them. Only what Apriel2's
modeling code reads is written, so a model Fast-LLM exports and one exported here describe the same math in the same
fields: rotary `mistral_1d`; GDN's `norm_eps` only when it is not Apriel2's default 1e-5 (Fast-LLM never writes it);
KDA's `normalization.activation` only when not silu; attention biases as `add_linear_biases`, plus each layer's
`bias.enabled` when q/k/v and the output projection differ (Apriel2 reads both).

Refused, listing every problem: what Apriel2 cannot express (Qwen3-Next's gated attention and q/k norms, zero-centred
norms, partial or non-default rotary, MLP biases, activations outside Fast-LLM's table, a GDN gate other than silu)
and what it would silently change (a block epsilon unlike the final norm's: Apriel2 builds every block norm with the
head's epsilon).
"""

from __future__ import annotations

from typing import Any

import transformers

from ...configuration_hybrid_linear import HybridLinearConfig
from ..errors import ConversionError
from ..fast_llm.config import ACTIVATION_FROM_HF, _block_names  # Fast-LLM's block names: attention, gdn, ...
from ..hf_layout import distinct_layers, layer_config, layer_settings
from ..untrusted import brief
from .config import MODEL_TYPE

ARCHITECTURES = ["Apriel2ForCausalLM"]
AUTO_MAP = {  # Fast-LLM's modeling sources (fast_llm_external_models/apriel2), which a user adds to load the folder
    "AutoConfig": "configuration_apriel2.Apriel2TextConfig",
    "AutoModel": "modeling_apriel2.Apriel2TextModel",
    "AutoModelForCausalLM": "modeling_apriel2.Apriel2ForCausalLM",
}
_ATTENTION = ("full_attention", "sliding_attention")
_NORM_EPS = 1e-5


def _final_eps(config: HybridLinearConfig) -> float:
    return config._getattr_without_heterogeneous_validation("rms_norm_eps")


def unsupported_for_apriel2(config: HybridLinearConfig) -> list[str]:
    problems = []
    if config.zero_centered_norms:
        problems.append("zero_centered_norms=True (Apriel2's RMSNorm is x_hat * w)")
    final_eps = _final_eps(config)
    for index in distinct_layers(config).values():
        layer, layer_type = layer_config(config, index), config.mixer_types[index]
        where = f"layer {index} ({layer_type})"
        if config.mlp_types[index] != "dense":
            problems.append(f"{where}: mlp_types[{index}]={brief(config.mlp_types[index])} (this converter writes "
                            "only Apriel2's gated MLP, mlp type 'dense')")
        if layer_type == "kimi_delta_attention" and layer.kda_gate_bias:
            problems.append(f"{where}: kda_gate_bias=True (Apriel2's KDA output gate has no bias)")
        if layer.hidden_act not in ACTIVATION_FROM_HF:
            problems.append(f"{where}: hidden_act={brief(layer.hidden_act)} (Apriel2 takes "
                            f"{', '.join(ACTIVATION_FROM_HF)})")
        if layer.mlp_bias:
            problems.append(f"{where}: mlp_bias=True (Apriel2's gated MLP has no biases)")
        if layer.rms_norm_eps != final_eps:
            problems.append(f"{where}: rms_norm_eps={brief(layer.rms_norm_eps)} differs from the final norm's "
                            f"{brief(final_eps)} (Apriel2 builds every block norm with the final norm's epsilon)")
        if layer_type == "gated_deltanet" and layer.gdn_gate_activation != "silu":
            problems.append(f"{where}: gdn_gate_activation={brief(layer.gdn_gate_activation)} (Apriel2's GDN gates "
                            "with silu)")
        if layer_type not in _ATTENTION:
            continue
        if layer.attention_output_gate:
            problems.append(f"{where}: attention_output_gate=True (Qwen3-Next gated attention)")
        if layer.attention_qk_norm:
            problems.append(f"{where}: attention_qk_norm=True")
        rope = layer.rope_parameters
        if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor") != 1.0:
            problems.append(f"{where}: rope_parameters={brief(rope)} (Apriel2's 'mistral_1d' rotary is the default "
                            "kind over the whole head)")
    return problems


def _mixer(layer: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    if layer_type in _ATTENTION:
        qkv_bias, output_bias = bool(layer.attention_bias), bool(layer.attention_output_bias)
        mixer = {"type": "attention", "heads": layer.num_attention_heads, "head_groups": layer.num_key_value_heads,
                 "head_size": layer.head_dim, "add_linear_biases": qkv_bias and output_bias,
                 "rotary": {"type": "mistral_1d", "theta": float(layer.rope_parameters["rope_theta"])}}
        if qkv_bias != output_bias:  # each layer's bias.enabled, as Fast-LLM exports a Qwen2-style attention
            mixer.update({f"{name}_layer": {"bias": {"enabled": qkv_bias}} for name in ("query", "key", "value")})
            mixer["dense_layer"] = {"bias": {"enabled": output_bias}}
        if layer_type == "sliding_attention":
            mixer["window_size"] = layer.sliding_window
        return mixer
    if layer_type == "gated_deltanet":
        mixer = {"type": "gdn", "value_heads": layer.gdn_num_value_heads, "key_heads": layer.gdn_num_key_heads,
                 "key_head_dim": layer.gdn_key_head_dim, "value_head_dim": layer.gdn_value_head_dim,
                 "convolution_layer": {"kernel_size": layer.gdn_conv_kernel_size}}
        if layer.gdn_norm_eps != _NORM_EPS:
            mixer["norm_eps"] = layer.gdn_norm_eps
        return mixer
    norm: dict[str, Any] = {"epsilon": layer.kda_norm_eps}
    if layer.kda_gate_activation != "silu":
        norm["activation"] = layer.kda_gate_activation
    return {"type": "kda", "heads": layer.kda_num_heads, "head_dim": layer.kda_head_dim,
            "convolution_layer": {"kernel_size": layer.kda_conv_kernel_size}, "normalization": norm}


def hybrid_config_to_apriel2(config: HybridLinearConfig) -> dict[str, Any]:
    """Apriel2's config.json for our config, or a ConversionError listing what Apriel2 cannot express."""
    problems = unsupported_for_apriel2(config)
    if problems:
        raise ConversionError("this model cannot be expressed as an Apriel2 model: " + "; ".join(problems) + ".")
    eps = _final_eps(config)
    names = _block_names(config)
    blocks = {}
    for setting, index in distinct_layers(config).items():
        layer = layer_config(config, index)
        blocks[names[setting]] = {
            "mixer": _mixer(layer, config.mixer_types[index]),
            "mlp": {"type": "mlp", "intermediate_size": layer.intermediate_size, "gated": True,
                    "activation": layer.hidden_act, "add_linear_biases": False},
            "normalization": {"type": "rms_norm", "epsilon": eps},
        }
    return {
        "architectures": list(ARCHITECTURES),
        "auto_map": dict(AUTO_MAP),
        "bos_token_id": config.bos_token_id,
        "decoder": {"type": "pattern", "blocks": blocks, "pattern": [names[s] for s in layer_settings(config)],
                    "num_blocks": config.num_hidden_layers},
        "embeddings": {"max_position_embeddings": config.max_position_embeddings},
        "eos_token_id": config.eos_token_id,
        "head": {"normalization": {"type": "rms_norm", "epsilon": eps}},
        "hidden_size": config.hidden_size,
        "model_type": MODEL_TYPE,
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "transformers_version": transformers.__version__,
        "use_cache": bool(config.use_cache),
        "vocab_size": config.vocab_size,
    }


# The model-wide fields config.json carries (and must read back unchanged); per-layer fields are compared layer by
# layer, as for Fast-LLM's metadata (every field of the layer's mixer and block).
CARRIED_FIELDS = ("vocab_size", "hidden_size", "mixer_types", "num_hidden_layers", "rms_norm_eps",
                  "tie_word_embeddings", "zero_centered_norms", "max_position_embeddings", "bos_token_id",
                  "eos_token_id", "pad_token_id", "use_cache")

__all__ = ["hybrid_config_to_apriel2", "unsupported_for_apriel2", "CARRIED_FIELDS", "AUTO_MAP", "ARCHITECTURES"]

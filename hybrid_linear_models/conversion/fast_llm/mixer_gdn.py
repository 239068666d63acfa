"""Fast-LLM's `gdn` mixer (Gated DeltaNet, fast_llm/layers/ssm/gdn.py) <-> our `gated_deltanet` layers.

Fast-LLM's config: `key_heads` Hk, `value_heads` Hv, `key_head_dim` dk, `value_head_dim` dv, the short convolution
(`convolution_layer.kernel_size`, silu) and the gated output norm (`normalization`: epsilon, gate activation). Its
linear layers (`qkv_projection_layer`, `ba_projection_layer`, `output_layer`) and the convolution default to no bias;
a bias enabled there is refused (our GDN, like Qwen3-Next's, has none).

Fast-LLM stores the projections FLAT (`in_proj_qkvz` = [Q_all | K_all | V_all | Z_all], `in_proj_ba` =
[beta_all | alpha_all]); ours are grouped by key head as Qwen3-Next's are (`GdnKeyHeadGrouping`, a row permutation).
"""

from __future__ import annotations

from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import GdnKeyHeadGrouping
from .metadata_fields import MetadataFields, convolution, gated_norm, gated_norm_config, linear_layers_without_bias
from .mixers import FastLlmMixer, register
from .parameter_spec import NEVER, Parameter, Rule, same

_LINEAR_LAYERS = ("qkv_projection_layer", "ba_projection_layer", "output_layer")


def read(mixer: MetadataFields) -> tuple[str, dict[str, Any]]:
    settings = {
        "gdn_num_key_heads": mixer.size("key_heads"),
        "gdn_num_value_heads": mixer.size("value_heads"),
        "gdn_key_head_dim": mixer.size("key_head_dim"),
        "gdn_value_head_dim": mixer.size("value_head_dim"),
        "gdn_conv_kernel_size": convolution(mixer),
    }
    settings["gdn_norm_eps"], settings["gdn_gate_activation"] = gated_norm(mixer)
    linear_layers_without_bias(mixer, _LINEAR_LAYERS)
    mixer.finish(frozenset({"type"}))
    return "gated_deltanet", settings


def write(layer: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    return {"type": "gdn", "key_heads": layer.gdn_num_key_heads, "value_heads": layer.gdn_num_value_heads,
            "key_head_dim": layer.gdn_key_head_dim, "value_head_dim": layer.gdn_value_head_dim,
            "convolution_layer": {"kernel_size": layer.gdn_conv_kernel_size},
            "normalization": gated_norm_config(layer.gdn_norm_eps, layer.gdn_gate_activation)}


def distributed_unverified(layer: HybridLinearConfig) -> str | None:
    if min(layer.gdn_num_key_heads, layer.gdn_num_value_heads) == 1:
        return ("mixer.key_heads or mixer.value_heads is 1, and the distributed layout of a Gated DeltaNet mixer with "
                "a single key or value head is not verified")
    return None


_HEADS: Rule = lambda config: config.gdn_num_value_heads > 1  # noqa: E731
PARAMETERS = (
    Parameter("mixer.in_proj_qkvz.weight", GdnKeyHeadGrouping("qkvz"), "linear_attn.in_proj_qkvz.weight",
              tensor_parallel=_HEADS),
    Parameter("mixer.in_proj_ba.weight", GdnKeyHeadGrouping("ba"), "linear_attn.in_proj_ba.weight",
              tensor_parallel=_HEADS),
    same("mixer.convolution.weight", "linear_attn.conv1d.weight", tensor_parallel=_HEADS),  # flat [Q | K | V]
    same("mixer.out_proj.weight", "linear_attn.out_proj.weight", tensor_parallel=_HEADS),
    same("mixer.dt_bias", "linear_attn.dt_bias", weight_decay=False, tensor_parallel=_HEADS),
    same("mixer.A_log", "linear_attn.A_log", weight_decay=False, tensor_parallel=_HEADS),
    same("mixer.norm.weight", "linear_attn.norm.weight", weight_decay=False, tensor_parallel=NEVER),
)

GATED_DELTANET = register(FastLlmMixer(
    type_name="gdn",
    description="Gated DeltaNet",
    block_names={"gated_deltanet": "gdn"},
    read=read,
    write=write,
    parameters=PARAMETERS,
    field_sources={
        "gdn_num_key_heads": "mixer.key_heads",
        "gdn_num_value_heads": "mixer.value_heads",
        "gdn_key_head_dim": "mixer.key_head_dim",
        "gdn_value_head_dim": "mixer.value_head_dim",
        "gdn_conv_kernel_size": "mixer.convolution_layer.kernel_size",
        "gdn_norm_eps": "mixer.normalization.epsilon",
        "gdn_gate_activation": "mixer.normalization.activation",
    },
    distributed_unverified=distributed_unverified,
))

__all__ = ["GATED_DELTANET", "PARAMETERS"]

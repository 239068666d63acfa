"""Fast-LLM's `kda` mixer (Kimi Delta Attention, fast_llm/layers/ssm/kda.py) <-> our `kimi_delta_attention` layers.

Fast-LLM's config: `heads` Hd of `head_dim` d, the short convolution (`convolution_layer.kernel_size`, silu; one
config for the q, k and v convolutions) and the gated output norm (`normalization`: epsilon, gate activation, silu by
default in Fast-LLM, sigmoid in Kimi). Its nine linear layers (`{q,k,v,f_a,f_b,g_a,g_b,beta,output}_projection_layer`)
and the convolutions default to no bias; a bias enabled there is refused (our KDA, like Kimi's, has none). Every
parameter is stored as ours is; only names differ (`beta_proj` is our `b_proj`, `norm` our `o_norm`).
"""

from __future__ import annotations

from typing import Any

from ...configuration_hybrid_linear import HybridLinearConfig
from .metadata_fields import MetadataFields, convolution, gated_norm, gated_norm_config, linear_layers_without_bias
from .mixers import FastLlmMixer, register
from .parameter_spec import NEVER, Rule, same

_LINEAR_LAYERS = tuple(f"{n}_projection_layer" for n in ("q", "k", "v", "f_a", "f_b", "g_a", "g_b", "beta", "output"))


def read(mixer: MetadataFields) -> tuple[str, dict[str, Any]]:
    settings = {
        "kda_num_heads": mixer.size("heads"),
        "kda_head_dim": mixer.size("head_dim"),
        "kda_conv_kernel_size": convolution(mixer),
    }
    settings["kda_norm_eps"], settings["kda_gate_activation"] = gated_norm(mixer)
    linear_layers_without_bias(mixer, _LINEAR_LAYERS)
    settings["kda_gate_bias"] = False  # g_b_projection_layer's bias is refused just above
    mixer.finish(frozenset({"type"}))
    return "kimi_delta_attention", settings


def write(layer: HybridLinearConfig, layer_type: str) -> dict[str, Any]:
    return {"type": "kda", "heads": layer.kda_num_heads, "head_dim": layer.kda_head_dim,
            "convolution_layer": {"kernel_size": layer.kda_conv_kernel_size},
            "normalization": gated_norm_config(layer.kda_norm_eps, layer.kda_gate_activation)}


def unsupported(layer: HybridLinearConfig) -> list[str]:
    if layer.kda_gate_bias:  # fla's g_proj.1 has one (conversion/fla); Fast-LLM's g_b_projection_layer is bias-free
        return ["kda_gate_bias=True (Fast-LLM's KDA output gate g_b has no bias)"]
    return []


def distributed_unverified(layer: HybridLinearConfig) -> str | None:
    if layer.kda_num_heads == 1:
        return ("mixer.heads is 1, and the distributed layout of a Kimi Delta Attention mixer with a single head is "
                "not verified")
    return None


_HEADS: Rule = lambda config: config.kda_num_heads > 1  # noqa: E731
PARAMETERS = (
    *(same(f"mixer.{n}_proj.weight", f"linear_attn.{n}_proj.weight", tensor_parallel=_HEADS) for n in "qkv"),
    *(same(f"mixer.{n}_conv.weight", f"linear_attn.{n}_conv1d.weight", tensor_parallel=_HEADS) for n in "qkv"),
    same("mixer.f_a_proj.weight", "linear_attn.f_a_proj.weight", tensor_parallel=NEVER),  # (head_dim, hidden)
    same("mixer.f_b_proj.weight", "linear_attn.f_b_proj.weight", tensor_parallel=_HEADS),
    same("mixer.g_a_proj.weight", "linear_attn.g_a_proj.weight", tensor_parallel=NEVER),
    same("mixer.g_b_proj.weight", "linear_attn.g_b_proj.weight", tensor_parallel=_HEADS),
    same("mixer.beta_proj.weight", "linear_attn.b_proj.weight", tensor_parallel=_HEADS),
    same("mixer.o_proj.weight", "linear_attn.o_proj.weight", tensor_parallel=_HEADS),
    same("mixer.dt_bias", "linear_attn.dt_bias", weight_decay=False, tensor_parallel=_HEADS),
    same("mixer.A_log", "linear_attn.A_log", weight_decay=False, tensor_parallel=_HEADS),
    same("mixer.norm.weight", "linear_attn.o_norm.weight", weight_decay=False, tensor_parallel=NEVER),
)

KIMI_DELTA = register(FastLlmMixer(
    type_name="kda",
    description="Kimi Delta Attention",
    block_names={"kimi_delta_attention": "kda"},
    read=read,
    write=write,
    parameters=PARAMETERS,
    field_sources={
        "kda_num_heads": "mixer.heads",
        "kda_head_dim": "mixer.head_dim",
        "kda_conv_kernel_size": "mixer.convolution_layer.kernel_size",
        "kda_norm_eps": "mixer.normalization.epsilon",
        "kda_gate_activation": "mixer.normalization.activation",
        "kda_gate_bias": "mixer.g_b_projection_layer.bias.enabled",
    },
    distributed_unverified=distributed_unverified,
    unsupported=unsupported,
))

__all__ = ["KIMI_DELTA", "PARAMETERS"]

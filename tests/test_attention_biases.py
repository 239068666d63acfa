"""Attention biases per projection: `attention_bias` (q, k, v) and `attention_output_bias` (o_proj), whose unset
value follows attention_bias, per layer too, so configs and folders written before it keep their meaning.

The model with Qwen2-style biases (q/k/v, none on o_proj) is checked against a forward pass written here from the
math with torch.nn.functional ops and the model's own weights.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hybrid_linear_models  # noqa: F401
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.component_registry import ConfigField

_TINY = dict(hidden_size=32, vocab_size=64, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, attention_output_gate=False, attention_qk_norm=False, zero_centered_norms=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})


def _biases(model: HybridLinearForCausalLM, index: int) -> dict[str, bool]:
    attention = model.model.layers[index].self_attn
    return {name: getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_unset_output_bias_follows_attention_bias_globally_and_per_layer():
    """A config without attention_output_bias means what it meant when attention_bias switched all four, layer by
    layer; given explicitly, it wins, and a saved config reads back the same."""
    config = HybridLinearConfig(layer_types=["full_attention"] * 3, **_TINY,
                                per_layer_config={1: {"attention_bias": True},
                                                  2: {"attention_bias": True, "attention_output_bias": False}})
    model = HybridLinearForCausalLM(config)
    assert _biases(model, 0) == dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), False)
    assert _biases(model, 1) == dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), True)
    assert _biases(model, 2) == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
    again = HybridLinearConfig.from_dict(config.to_dict())
    assert [again.per_layer_config[i].attention_output_bias for i in range(3)] == [False, True, False]
    assert HybridLinearConfig(layer_types=["full_attention"], **_TINY, attention_bias=True).attention_output_bias
    explicit = HybridLinearConfig(layer_types=["full_attention"] * 2, **_TINY, attention_output_bias=False,
                                  per_layer_config={1: {"attention_bias": True}})
    assert not explicit.per_layer_config[1].attention_output_bias  # set globally: a layer's attention_bias is its own


def test_an_old_config_json_without_the_field_keeps_its_biases():
    """config.json as written before the field existed (no attention_output_bias key)."""
    old = HybridLinearConfig(layer_types=["full_attention"] * 2, **_TINY,
                             per_layer_config={1: {"attention_bias": True}}).to_dict()
    old.pop("attention_output_bias")
    loaded = HybridLinearConfig.from_dict(old)
    assert [loaded.per_layer_config[i].attention_output_bias for i in range(2)] == [False, True]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"attention_output_bias": "no"}, "attention_output_bias must be True or False (a bool), got 'no'"),
    ({"per_layer_config": {0: {"attention_output_bias": 1}}},
     "per_layer_config[0].attention_output_bias must be True or False (a bool), got 1"),
    ({"per_layer_config": {1: {"attention_output_bias": True}}},
     "per_layer_config[1].attention_output_bias is not read by layer 1, a 'gated_deltanet' layer"),
])
def test_bad_values_are_named(kwargs, fragment):
    with pytest.raises(ValueError) as caught:
        HybridLinearConfig(layer_types=["full_attention", "gated_deltanet"], **{**_TINY, **kwargs})
    assert fragment in str(caught.value)


def test_a_layer_may_override_the_output_bias_alone():
    config = HybridLinearConfig(layer_types=["full_attention", "sliding_attention"], sliding_window=4, **_TINY,
                                attention_bias=True, per_layer_config={1: {"attention_output_bias": False}})
    model = HybridLinearForCausalLM(config)
    assert _biases(model, 0)["o_proj"] and not _biases(model, 1)["o_proj"] and _biases(model, 1)["q_proj"]


def test_per_layer_default_from_needs_default_from():
    problems = ConfigField(kind="bool", default=None, per_layer_default_from=True, doc="x.").problems("f")
    assert problems == ["field 'f': per_layer_default_from needs default_from (the field whose layer overrides it "
                        "follows)"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_logits(model: HybridLinearForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """One attention layer and its MLP, from the math: q, k, v with biases, Llama rotary over the whole head, causal
    GQA softmax, o_proj (bias or not), SwiGLU MLP, plain RMSNorms."""
    config, layer = model.config, model.model.layers[0]
    attention, mlp, eps = layer.self_attn, layer.mlp, config.rms_norm_eps
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B, T = input_ids.shape
    x = model.model.embed_tokens.weight[input_ids]
    h = _rms_norm(x, layer.input_layernorm.weight, eps)
    q = F.linear(h, attention.q_proj.weight, attention.q_proj.bias).view(B, T, heads, d).transpose(1, 2)
    k = F.linear(h, attention.k_proj.weight, attention.k_proj.bias).view(B, T, kv_heads, d).transpose(1, 2)
    v = F.linear(h, attention.v_proj.weight, attention.v_proj.bias).view(B, T, kv_heads, d).transpose(1, 2)
    inv_freq = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotate(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * d)
    x = x + F.linear(o, attention.o_proj.weight, attention.o_proj.bias)
    h = _rms_norm(x, layer.post_attention_layernorm.weight, eps)
    x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)
    return F.linear(_rms_norm(x, model.model.norm.weight, eps), model.lm_head.weight)


@pytest.mark.parametrize("output_bias", [False, True])
def test_qkv_biases_without_output_bias_match_the_math(output_bias):
    torch.manual_seed(0)
    config = HybridLinearConfig(layer_types=["full_attention"], **_TINY, attention_bias=True,
                                attention_output_bias=output_bias)
    config._attn_implementation = "eager"
    model = HybridLinearForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # biases away from zero, so that each one counts
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
        input_ids = torch.randint(0, config.vocab_size, (2, 7))
        logits = model(input_ids).logits
        reference = _reference_logits(model, input_ids)
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == output_bias
    # float32, the same products summed in another order (repeat_kv, softmax): measured 6e-8 on logits of ~1
    assert (logits - reference).abs().max().item() <= 1e-6
    assert logits.abs().max().item() > 0.1

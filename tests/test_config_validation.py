"""HybridLinearConfig refuses every invalid value of a field that changes the math with one ValueError naming the
field, at construction, at load (from_dict / from_pretrained, overrides included) and before config.json is written."""

from __future__ import annotations

import json
import math

import pytest
import torch
from model_helpers import tiny_config
from work_bounds import bounded_work

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM

ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}

INVALID = [
    # (field named in the message, overrides)
    ("rms_norm_eps", dict(rms_norm_eps=0.0)),
    ("rms_norm_eps", dict(rms_norm_eps=float("nan"))),
    ("gdn_norm_eps", dict(gdn_norm_eps=-1e-6)),
    ("kda_norm_eps", dict(kda_norm_eps=float("inf"))),
    ("kda_norm_eps", dict(kda_norm_eps="1e-6")),
    ("rope_theta", dict(rope_parameters={**ROPE, "rope_theta": 0})),
    ("rope_theta", dict(rope_parameters={**ROPE, "rope_theta": float("inf")})),
    ("rope_type", dict(rope_parameters={**ROPE, "rope_type": "bogus"})),
    ("rope_type", dict(rope_parameters={**ROPE, "rope_type": "proportional"})),
    ("factor", dict(rope_parameters={**ROPE, "rope_type": "linear"})),
    ("factor", dict(rope_parameters={**ROPE, "rope_type": "yarn", "factor": float("nan")})),
    ("high_freq_factor", dict(rope_parameters={**ROPE, "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0})),
    ("long_factor", dict(rope_parameters={**ROPE, "rope_type": "longrope", "short_factor": [1.0, 1.0],
                                          "long_factor": [1.0]})),
    ("partial_rotary_factor", dict(rope_parameters={**ROPE, "partial_rotary_factor": True})),
    ("partial_rotary_factor", dict(rope_parameters={**ROPE, "partial_rotary_factor": 1.5})),
    ("rope_parameters", dict(rope_parameters="default")),
    ("partial_rotary_factor", dict(rope_parameters={**ROPE, "rope_type": "dynamic", "factor": 2.0,
                                                    "partial_rotary_factor": 0.125})),  # 2 dims: dim / (dim - 2)
    ("head_dim", dict(head_dim=10**400)),  # not to overflow in head_dim * partial_rotary_factor
    ("sliding_window", dict(sliding_window=0)),
    ("sliding_window", dict(layer_types=["full_attention"], sliding_window=0)),
    ("sliding_window", dict(sliding_window=True)),
    ("sliding_window", dict(sliding_window=6.0)),
    ("pad_token_id", dict(pad_token_id=128)),
    ("pad_token_id", dict(pad_token_id=[1])),
    ("bos_token_id", dict(bos_token_id=-1)),
    ("bos_token_id", dict(bos_token_id=True)),
    ("eos_token_id", dict(eos_token_id=[1, 500])),
    ("eos_token_id", dict(eos_token_id=[])),
    ("attention_dropout", dict(attention_dropout=1.0)),
    ("attention_dropout", dict(attention_dropout=-0.1)),
    ("initializer_range", dict(initializer_range=-0.02)),
    ("initializer_range", dict(initializer_range=float("nan"))),
    ("max_position_embeddings", dict(max_position_embeddings=0)),
    ("max_position_embeddings", dict(max_position_embeddings=True)),
    ("hidden_size", dict(hidden_size="64")),
    ("vocab_size", dict(vocab_size=12.0)),
    ("num_hidden_layers", dict(layer_types=None, num_hidden_layers=10**12)),
    ("layer_types", dict(layer_types="full_attention")),
    ("layer_types", dict(layer_types=[["full_attention"]])),
    ("mlp_types", dict(mlp_types="dense")),
    ("mlp_types", dict(mlp_types=[])),
    ("mlp_types has 3 entries but layer_types has 4", dict(mlp_types=["dense"] * 3)),
    ("mlp_types has unknown entries \\['moe'\\]; each entry must be one of \\('dense',", dict(
        mlp_types=["dense", "moe", "dense", "moe"])),
    ("mlp_types has unknown entries", dict(mlp_types=[["dense"]] * 4)),
    ("hidden_act", dict(hidden_act=["silu"])),
    ("vocab_size", dict(vocab_size=2**40)),  # embeddings of 2**46 weights
    ("intermediate_size", dict(intermediate_size=2**40)),  # one layer's MLP over the limit
    *[(name, {name: "false"}) for name in ("attention_bias", "mlp_bias", "attention_output_gate", "attention_qk_norm",
                                           "zero_centered_norms", "tie_word_embeddings", "fuse_linear_cross_entropy",
                                           "use_cache")],
    *[(name, {name: 1}) for name in ("attention_bias", "use_cache")],
]


@pytest.mark.parametrize("field, overrides", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_field_raises_one_value_error_naming_it(field, overrides):
    with pytest.raises(ValueError, match=field) as caught:
        tiny_config(**overrides)
    message = str(caught.value)
    assert message.startswith("Invalid HybridLinearConfig: ") and "\n" not in message
    assert len(message) < 600


@pytest.mark.parametrize("rope", [
    {**ROPE, "rope_type": "linear", "factor": 2.0},
    {**ROPE, "rope_type": "dynamic", "factor": 2.0},
    {**ROPE, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
    {**ROPE, "rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0},
    {**ROPE, "rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0],
     "original_max_position_embeddings": 16},
])
def test_every_accepted_rope_type_runs(rope):
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(tiny_config(["full_attention"], rope_parameters=rope, max_position_embeddings=32))
    logits = model(torch.randint(0, 128, (1, 40))).logits  # past max_position_embeddings: dynamic/longrope rescale
    assert torch.isfinite(logits).all()


def test_valid_values_at_the_edges_are_accepted():
    config = tiny_config(attention_dropout=0.0, initializer_range=0.0, sliding_window=1, pad_token_id=0,
                         bos_token_id=127, eos_token_id=[1, 2], rms_norm_eps=1, max_position_embeddings=1)
    assert config.eos_token_id == [1, 2] and config.sliding_window == 1


@pytest.mark.parametrize("overrides", [
    dict(layer_types=["x" * 10**6]),
    dict(layer_types=[object()] * 10**6),
    dict(layer_types=["full_attention"] * 10**6),
    dict(mlp_types=["x" * 10**6] * 4),
    dict(mlp_types=[object()] * 10**6),
    dict(hidden_act="y" * 10**6),
    dict(vocab_size=10**5000),
    dict(rope_parameters={**ROPE, "rope_type": list(range(10**6))}),
])
def test_hostile_values_fail_fast_with_a_short_message(overrides):
    # work linear in the entries given, with a small constant: nothing driven by a size the input claims
    entries = sum(len(value) for value in overrides.values() if isinstance(value, list))
    with bounded_work(lines=50_000 + 4 * entries), pytest.raises(ValueError) as caught:
        tiny_config(**overrides)
    assert len(str(caught.value)) < 400


def test_legacy_rope_keys_are_validated_too():
    with pytest.raises(ValueError, match="rope_type"):
        tiny_config(rope_parameters=None, rope_scaling={"rope_type": "bogus", "rope_theta": 1e4})
    assert tiny_config(rope_parameters=None, rope_theta=5e5).rope_parameters["rope_theta"] == 5e5


def test_from_dict_validates_overrides_given_after_construction():
    data = tiny_config().to_dict()
    with pytest.raises(ValueError, match="sliding_window"):
        HybridLinearConfig.from_dict(data, sliding_window=0)
    data["rms_norm_eps"] = -1.0
    with pytest.raises(ValueError, match="rms_norm_eps"):
        HybridLinearConfig.from_dict(data)


def test_from_pretrained_validates_the_file_and_overrides(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_dropout"):
        HybridLinearConfig.from_pretrained(tmp_path, attention_dropout=2.0)
    data = json.loads((tmp_path / "config.json").read_text())
    data["use_cache"] = "false"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="use_cache"):
        HybridLinearConfig.from_pretrained(tmp_path)


def test_a_config_mutated_after_construction_is_not_saved(tmp_path):
    config = tiny_config()
    config.rms_norm_eps = math.nan
    with pytest.raises(ValueError, match="rms_norm_eps"):
        config.save_pretrained(tmp_path / "config")
    assert not (tmp_path / "config" / "config.json").exists()
    model = HybridLinearForCausalLM(tiny_config(["full_attention"]))
    model.config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window"):
        model.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model" / "config.json").exists()


def test_a_size_that_may_be_zero_takes_none_as_zero_and_names_bad_values_in_one_sentence():
    """q_lora_rank=None (DeepSeek's and Kimi's spelling of no q LoRA) is 0; a negative one is refused, the message
    one sentence: "... must be a positive integer or 0 (none), got -3"."""
    mla = {"mixer_types": ["mla_attention"], "hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 16,
           "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    assert HybridLinearConfig(**mla, q_lora_rank=None).q_lora_rank == 0
    with pytest.raises(ValueError, match=r"q_lora_rank must be a positive integer or 0 \(none\), got -3\.$"):
        HybridLinearConfig(**mla, q_lora_rank=-3)

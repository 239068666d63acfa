"""Property-based fuzzing of HybridLinearConfig (hypothesis).

1. Any keyword arguments, valid or not (wrong types, huge numbers, NaN/inf, strings for numbers, unknown rope types;
   per_layer_config with any keys and fields):
   HybridLinearConfig(**kwargs) either raises a ValueError naming one of the fuzzed fields, or builds a config that
   round-trips unchanged through to_dict/from_dict and save_pretrained/from_pretrained. Nothing else escapes
   (TypeError, KeyError, OverflowError, a giant message).
2. Valid tiny configs (sizes capped, some layers with settings of their own) build a model that runs a forward on a
   few tokens with finite logits.

Runs are reproducible (derandomize=True) and bounded (max_examples, deadline) to stay within seconds on a CPU.
"""

from __future__ import annotations

import copy
import functools
import math
import tempfile

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from model_helpers import tiny_config

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.configuration_hybrid_linear import MIXER_TYPES, PER_LAYER_FIELDS, ROPE_REQUIRED_KEYS

FUZZ = settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MODELS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------------------- values of every kind

junk = st.one_of(st.none(), st.text(max_size=8), st.lists(st.integers(-2, 3), max_size=3), st.just({"a": 1}))
numbers_as_strings = st.sampled_from(["8", "1e-6", "nan", "0.5", "false", ""])
huge_ints = st.integers(min_value=2**31, max_value=2**80) | st.just(10**400)
any_float = st.floats(allow_nan=True, allow_infinity=True)


# each starts with a branch of mostly valid values, so that about half the fuzzed fields are valid


def int_values(low: int = -2, high: int = 128):
    return st.one_of(st.integers(1, 32), st.integers(low, high), huge_ints, st.booleans(), any_float,
                     numbers_as_strings, junk)


def float_values():
    return st.one_of(st.floats(1e-6, 0.5), any_float, st.integers(-3, 3), huge_ints, st.booleans(),
                     numbers_as_strings, junk)


def bool_values():
    return st.one_of(st.booleans(), st.sampled_from(["false", "true", 0, 1, 0.0]), st.none())


def token_id_values():
    return st.one_of(st.none() | st.integers(0, 127), st.integers(-2, 200), st.lists(st.integers(-2, 200), max_size=3),
                     st.booleans(), numbers_as_strings, huge_ints)


def name_values(names):
    return st.one_of(st.sampled_from(names), st.text(max_size=6), st.integers(), st.none(), st.just(["silu"]))


rope_type_values = st.one_of(st.sampled_from([*ROPE_REQUIRED_KEYS, "proportional", "bogus"]), st.integers(), st.none())
rope_values = st.one_of(
    st.none(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
    st.fixed_dictionaries(
        {"rope_type": rope_type_values},
        optional={
            "rope_theta": float_values(), "partial_rotary_factor": float_values(), "factor": float_values(),
            "low_freq_factor": float_values(), "high_freq_factor": float_values(), "attention_factor": float_values(),
            "original_max_position_embeddings": int_values(), "beta_fast": float_values(),
            "short_factor": st.lists(float_values(), max_size=5), "long_factor": st.lists(float_values(), max_size=5),
        },
    ),
)
layer_types_values = st.one_of(
    st.lists(st.sampled_from([*MIXER_TYPES, "mamba", "attention", ""]), max_size=6),
    st.lists(st.sampled_from(MIXER_TYPES), min_size=1, max_size=6),
    st.text(max_size=12), st.none(), st.lists(st.integers(), max_size=3),
)

FIELDS = {
    **{name: int_values() for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim", "gdn_value_head_dim", "gdn_conv_kernel_size",
        "kda_num_heads", "kda_head_dim", "kda_conv_kernel_size", "max_position_embeddings", "num_hidden_layers",
        "sliding_window", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    **{name: float_values() for name in (
        "rms_norm_eps", "gdn_norm_eps", "kda_norm_eps", "mla_norm_eps", "initializer_range", "attention_dropout")},
    **{name: bool_values() for name in (
        "attention_bias", "mlp_bias", "attention_output_gate", "attention_qk_norm", "zero_centered_norms",
        "tie_word_embeddings", "fuse_linear_cross_entropy", "use_cache", "mla_use_nope")},
    **{name: token_id_values() for name in ("pad_token_id", "bos_token_id", "eos_token_id")},
    "hidden_act": name_values(["silu", "gelu", "relu", "tanh"]),
    "gdn_gate_activation": name_values(["silu", "sigmoid"]),
    "kda_gate_activation": name_values(["silu", "sigmoid"]),
    "rope_parameters": rope_values,
    "layer_types": layer_types_values,
}

# per_layer_config: layer keys valid or not (ints, their JSON strings, out of range, junk), each with a few fields
# (per-layer ones, fields that cannot vary, unknown names) set to values fuzzed as the flat fields are.
layer_keys = st.one_of(st.integers(0, 3), st.sampled_from(["0", "1", "03", "-1", "x", ""]), st.integers(-2, 9))
per_layer_names = st.sampled_from([*PER_LAYER_FIELDS, "hidden_size", "vocab_size", "tie_word_embeddings", "skip",
                                   "bogus"])


@st.composite
def layer_settings(draw) -> dict:
    names = draw(st.lists(per_layer_names, max_size=3, unique=True))
    return {name: draw(FIELDS.get(name, int_values())) for name in names}


# mostly valid overrides of tiny_config's layers (GDN, full attention, KDA, sliding), so that many configs build
block_overrides = {"intermediate_size": st.integers(1, 64), "rms_norm_eps": st.floats(1e-6, 0.1),
                   "hidden_act": st.sampled_from(["silu", "gelu"]), "mlp_bias": st.booleans()}
attention_overrides = {"num_key_value_heads": st.sampled_from([1, 2, 4, 3]), "head_dim": st.sampled_from([8, 16, 6]),
                       "attention_output_gate": st.booleans(), "attention_qk_norm": st.booleans(),
                       "rope_parameters": st.fixed_dictionaries({"rope_theta": st.floats(10.0, 1e6)}),
                       **block_overrides}
mixer_overrides = {
    0: {"gdn_num_key_heads": st.integers(1, 2), "gdn_value_head_dim": st.integers(1, 16),
        "gdn_gate_activation": st.sampled_from(["silu", "sigmoid"]), **block_overrides},
    1: attention_overrides,
    2: {"kda_num_heads": st.integers(1, 3), "kda_conv_kernel_size": st.integers(1, 4), **block_overrides},
    3: {"sliding_window": st.integers(0, 8), **attention_overrides},
}
valid_per_layer = st.tuples(*(st.fixed_dictionaries({}, optional=fields) for fields in mixer_overrides.values())).map(
    lambda layers: {str(i): fields for i, fields in enumerate(layers) if fields})
per_layer_values = st.one_of(valid_per_layer, st.dictionaries(layer_keys, layer_settings(), max_size=3), junk)
FIELDS["per_layer_config"] = per_layer_values


@functools.cache
def _tiny_config_dict() -> dict:
    return tiny_config().to_dict()


def tiny_fields() -> dict:
    """tiny_config()'s fields, a fresh copy for each case: the config is built once, not for each of the ~2,000
    draws (building one validates every field: 3 ms, a copy 0.1 ms)."""
    return copy.deepcopy(_tiny_config_dict())


@st.composite
def fuzzed_kwargs(draw) -> tuple[dict, dict]:
    """(kwargs, the fuzzed subset): tiny valid settings with a few fields replaced by arbitrary values."""
    kwargs = tiny_fields()
    kwargs = {name: kwargs[name] for name in FIELDS if name in kwargs}
    kwargs["num_hidden_layers"] = None  # follows layer_types unless fuzzed
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True))
    fuzzed = {name: draw(FIELDS[name]) for name in names}
    kwargs.update(fuzzed)
    return kwargs, fuzzed


def comparable(config: HybridLinearConfig) -> dict:
    """The config's fields, without the bookkeeping that saving adds (version, source path, remote-code map)."""
    data = config.to_dict()
    for key in ("transformers_version", "_name_or_path", "auto_map"):
        data.pop(key, None)
    return data


@FUZZ
@given(fuzzed_kwargs())
def test_config_either_names_a_fuzzed_field_or_round_trips(case):
    kwargs, fuzzed = case
    try:
        config = HybridLinearConfig(**kwargs)
    except ValueError as error:
        event("refused")
        message = str(error)
        assert any(name in message for name in fuzzed), message
        assert "\n" not in message and len(message) < 2000, message[:300]
        return
    event("built, heterogeneous" if config.is_heterogeneous else "built")
    data = comparable(config)
    assert comparable(HybridLinearConfig.from_dict(config.to_dict())) == data
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        assert comparable(HybridLinearConfig.from_pretrained(folder)) == data


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(per_layer_values)
def test_per_layer_config_is_either_refused_naming_it_or_round_trips(per_layer):
    """The same property with only per_layer_config fuzzed, over tiny_config's four layer types (most cases build)."""
    kwargs = {name: value for name, value in tiny_fields().items() if name in FIELDS}
    test_config_either_names_a_fuzzed_field_or_round_trips.hypothesis.inner_test(
        ({**kwargs, "per_layer_config": per_layer}, {"per_layer_config": per_layer}))


# ------------------------------------------------------------------------------------------ valid tiny models


@st.composite
def tiny_valid_kwargs(draw) -> dict:
    kv_heads = draw(st.integers(1, 2))
    gdn_keys = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    rope_type = draw(st.sampled_from(list(ROPE_REQUIRED_KEYS)))
    least = 4 if rope_type == "dynamic" else 2  # rotated dims: even, and as many as the rope type needs
    factor = draw(st.sampled_from([f for f in (0.5, 1.0) if int(head_dim * f) % 2 == 0 and head_dim * f >= least]))
    rotated_pairs = int(head_dim * factor) // 2
    rope = {"rope_type": rope_type, "rope_theta": draw(st.floats(10.0, 1e6)), "partial_rotary_factor": factor,
            "factor": draw(st.floats(1.0, 8.0)), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "short_factor": [1.0] * rotated_pairs, "long_factor": [2.0] * rotated_pairs}
    rope = {key: value for key, value in rope.items()
            if key in ("rope_type", "partial_rotary_factor") or key in ROPE_REQUIRED_KEYS[rope_type]}
    vocab = draw(st.integers(8, 64))
    layer_types = draw(st.lists(st.sampled_from(MIXER_TYPES), min_size=1, max_size=3))
    per_layer = {}  # some layers with settings of their own, valid for their mixer
    for index, layer_type in enumerate(layer_types):
        options = {"intermediate_size": st.integers(1, 24), "rms_norm_eps": st.floats(1e-8, 1e-2),
                   "hidden_act": st.sampled_from(["silu", "gelu"]), "mlp_bias": st.booleans(),
                   **{"full_attention": {"num_key_value_heads": st.just(1), "attention_output_gate": st.booleans()},
                      "sliding_attention": {"num_key_value_heads": st.just(1), "sliding_window": st.integers(1, 8)},
                      "gated_deltanet": {"gdn_num_key_heads": st.just(1), "gdn_value_head_dim": st.integers(1, 8),
                                         "gdn_conv_kernel_size": st.integers(1, 4)},
                      "kimi_delta_attention": {"kda_num_heads": st.integers(1, 3), "kda_head_dim": st.integers(1, 8),
                                               "kda_gate_activation": st.sampled_from(["silu", "sigmoid"])},
                      "mla_attention": {"kv_lora_rank": st.integers(1, 8), "q_lora_rank": st.integers(0, 4),
                                        "mla_use_nope": st.booleans(), "attention_bias": st.booleans()},
                      }[layer_type]}
        per_layer[index] = draw(st.fixed_dictionaries({}, optional=options))
    eos = draw(st.one_of(st.none(), st.integers(0, vocab - 1), st.lists(st.integers(0, vocab - 1), min_size=1,
                                                                          max_size=2)))
    return dict(
        layer_types=layer_types, per_layer_config=per_layer,
        vocab_size=vocab, hidden_size=draw(st.integers(1, 4)) * 8, intermediate_size=draw(st.integers(1, 24)),
        num_attention_heads=kv_heads * draw(st.integers(1, 2)), num_key_value_heads=kv_heads, head_dim=head_dim,
        gdn_num_key_heads=gdn_keys, gdn_num_value_heads=gdn_keys * draw(st.integers(1, 2)),
        gdn_key_head_dim=draw(st.integers(1, 3)) * 4, gdn_value_head_dim=draw(st.integers(1, 3)) * 4,
        gdn_conv_kernel_size=draw(st.integers(1, 4)), kda_num_heads=draw(st.integers(1, 2)),
        kda_head_dim=draw(st.integers(1, 3)) * 4, kda_conv_kernel_size=draw(st.integers(1, 4)),
        sliding_window=draw(st.integers(1, 8)), rope_parameters=rope, max_position_embeddings=draw(st.integers(4, 64)),
        rms_norm_eps=draw(st.floats(1e-8, 1e-2)), initializer_range=draw(st.floats(0.0, 0.1)),
        attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        attention_output_gate=draw(st.booleans()), attention_qk_norm=draw(st.booleans()),
        zero_centered_norms=draw(st.booleans()), tie_word_embeddings=draw(st.booleans()),
        hidden_act=draw(st.sampled_from(["silu", "gelu", "relu"])),
        gdn_gate_activation=draw(st.sampled_from(["silu", "sigmoid"])),
        kda_gate_activation=draw(st.sampled_from(["silu", "sigmoid"])),
        # MLA: its rotated slice as wide as attention's rotated dims (valid for every rope type), or none
        kv_lora_rank=draw(st.integers(1, 8)), q_lora_rank=draw(st.integers(0, 4)),
        qk_nope_head_dim=draw(st.integers(1, 8)), qk_rope_head_dim=draw(st.sampled_from([0, rotated_pairs * 2])),
        v_head_dim=draw(st.integers(1, 8)), mla_use_nope=draw(st.booleans()),
        pad_token_id=draw(st.one_of(st.none(), st.integers(0, vocab - 1))), eos_token_id=eos,
    )


@MODELS
@given(tiny_valid_kwargs(), st.integers(1, 9), st.integers(1, 2))
def test_valid_tiny_config_builds_a_model_that_runs(kwargs, length, batch):
    config = HybridLinearConfig(**kwargs)
    event("heterogeneous" if config.is_heterogeneous else "homogeneous")
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (batch, length))
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (batch, length, config.vocab_size)
    assert torch.isfinite(logits).all()
    assert math.isfinite(float(logits.float().abs().max()))

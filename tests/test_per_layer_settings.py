"""Per-layer settings (`per_layer_config`): the config holds, validates and saves them; the model follows them.

The heterogeneous model of the issue's "done when": two GDN blocks of different head counts, a 1-KV-head sliding block
and a 2-KV-head full block (plus a KDA block and different MLP widths, epsilons and rotary settings)."""

from __future__ import annotations

import json

import pytest
from model_helpers import tiny_config
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from hybrid_linear_models import HybridLinearConfig

LAYER_TYPES = ["gated_deltanet", "sliding_attention", "gated_deltanet", "full_attention", "kimi_delta_attention"]
PER_LAYER = {
    0: {"gdn_num_key_heads": 1, "gdn_num_value_heads": 2, "gdn_value_head_dim": 16, "intermediate_size": 48},
    1: {"num_key_value_heads": 1, "head_dim": 8, "sliding_window": 3, "rope_parameters": {"rope_theta": 500.0},
        "attention_output_gate": False, "rms_norm_eps": 1e-5},
    3: {"num_key_value_heads": 2, "num_attention_heads": 2, "attention_qk_norm": False, "hidden_act": "gelu"},
    4: {"kda_num_heads": 1, "kda_conv_kernel_size": 3, "kda_gate_activation": "silu", "mlp_bias": True},
}


def heterogeneous_config(**overrides) -> HybridLinearConfig:
    return tiny_config(LAYER_TYPES, per_layer_config=PER_LAYER, **overrides)


# ------------------------------------------------------------------------------------------------------ config


def test_each_layer_reads_its_overrides_and_the_defaults_elsewhere():
    config = heterogeneous_config()
    layers = config.per_layer_config
    assert [layers[i].gdn_num_value_heads for i in (0, 2)] == [2, 4]
    assert [layers[i].num_key_value_heads for i in (1, 3)] == [1, 2]
    assert layers[1].sliding_window == 3 and layers[1].head_dim == 8 and layers[3].head_dim == 16
    # a per-layer rope dict is completed from the global one (partial_rotary_factor 0.25 by default)
    assert layers[1].rope_parameters == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
    assert layers[0].intermediate_size == 48 and layers[2].intermediate_size == 96
    with pytest.raises(AmbiguousGlobalPerLayerAttributeError):
        config.num_key_value_heads  # noqa: B018 (a field that varies is not read from the global config)
    assert config.hidden_size == 64  # one that cannot vary is


def test_round_trips_are_exact_and_config_json_keys_are_strings(tmp_path):
    config = heterogeneous_config()
    data = config.to_dict()
    assert set(data["per_layer_config"]) == {"0", "1", "3", "4"}
    assert HybridLinearConfig.from_dict(data).to_dict() == data
    config.save_pretrained(tmp_path)  # runs validate() (transformers' strict-config hook) on the heterogeneous config
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["per_layer_config"]["1"]["num_key_value_heads"] == 1
    loaded = HybridLinearConfig.from_pretrained(tmp_path).to_dict()
    for entry in (loaded, data):
        for key in ("_name_or_path", "auto_map", "transformers_version"):
            entry.pop(key, None)
    assert loaded == data


def test_overrides_equal_to_the_defaults_leave_a_homogeneous_config():
    config = tiny_config(per_layer_config={1: {"num_key_value_heads": 2}, "2": {}})
    assert not config.is_heterogeneous and "per_layer_config" not in config.to_dict()
    assert config.num_key_value_heads == 2


@pytest.mark.parametrize("per_layer, expected", [
    ({1: {"num_key_value_heads": 3}},
     "per_layer_config[1].num_attention_heads=4 must be a multiple of per_layer_config[1].num_key_value_heads=3"),
    ({1: {"num_key_value_heads": "2"}}, "per_layer_config[1].num_key_value_heads must be a positive integer"),
    ({3: {"sliding_window": 0}}, "per_layer_config[3].sliding_window must be a positive integer"),
    ({1: {"attention_bias": 1}}, "per_layer_config[1].attention_bias must be True or False"),
    ({0: {"gdn_num_key_heads": 3}}, "per_layer_config[0].gdn_num_value_heads=4 must be a multiple of"),
    ({2: {"kda_norm_eps": 0.0}}, "per_layer_config[2].kda_norm_eps must be in (0.0, inf)"),
    ({1: {"rope_parameters": {"rope_type": "yarn"}}}, "per_layer_config[1].rope_parameters with rope_type 'yarn'"),
    ({1: {"head_dim": 2, "rope_parameters": {"partial_rotary_factor": 0.5}}}, "per_layer_config[1].head_dim * "),
    ({1: {"hidden_act": "nope"}}, "per_layer_config[1].hidden_act='nope' is not a known activation"),
    ({1: {"head_dim": 2**39}}, "reduce per_layer_config[1].hidden_size"),
    ({1: {"hidden_size": 32}}, "per_layer_config[1].hidden_size cannot differ between layers"),
    ({1: {"zero_centered_norms": False}}, "per_layer_config[1].zero_centered_norms cannot differ between layers"),
    ({1: {"gdn_num_key_heads": 1}}, "per_layer_config[1].gdn_num_key_heads is not read by layer 1, a "
                                    "'full_attention' layer"),
    ({1: {"sliding_window": 4}}, "per_layer_config[1].sliding_window is not read by layer 1"),
    ({1: {"skip": ["mlp"]}}, "per_layer_config[1].skip: every layer of this model runs its mixer and its MLP"),
    ({1: {"bogus": 1}}, "per_layer_config[1].bogus is not a field of HybridLinearConfig"),
    ({4: {"intermediate_size": 8}}, "per_layer_config has the key 4; its keys must be layer indices in [0, "),
    ({"one": {}}, "per_layer_config has the key 'one'"),
    ({1: {}, "01": {}}, "per_layer_config names layer 1 twice"),
    ({1: 5}, "per_layer_config[1] must be a dict"),
    ([1, 2], "per_layer_config must be a dict"),
])
def test_bad_per_layer_settings_name_the_layer_and_the_field(per_layer, expected):
    with pytest.raises(ValueError) as caught:
        tiny_config(per_layer_config=per_layer)  # layers: GDN, full attention, KDA, sliding attention
    message = str(caught.value)
    assert expected in message, message
    assert "\n" not in message and len(message) < 1000


def test_a_sliding_layer_needs_a_window_globally_or_its_own():
    config = tiny_config(["sliding_attention", "sliding_attention"], sliding_window=None,
                         per_layer_config={0: {"sliding_window": 2}, 1: {"sliding_window": 5}})
    assert [layer.sliding_window for layer in config.per_layer_config] == [2, 5]
    with pytest.raises(ValueError, match="so sliding_window must be a positive integer, got None"):
        tiny_config(["sliding_attention", "sliding_attention"], sliding_window=None,
                    per_layer_config={0: {"sliding_window": 2}})


def test_hostile_per_layer_configs_give_a_bounded_message():
    per_layer = {i: {"num_key_value_heads": -1, "bogus" * 1000: 1} for i in range(4)}
    with pytest.raises(ValueError) as caught:
        tiny_config(per_layer_config=per_layer)
    assert len(str(caught.value)) < 2000

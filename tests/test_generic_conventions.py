"""The conventions transformers' generic machinery reads: config.json holds transformers' words in `layer_types`
("full_attention", "sliding_attention", "linear_attention") and `mlp_layer_types` ("dense", "sparse"), each layer's
mixer and MLP in fields of their own (`mixer_types`, `mlp_types`); transformers builds each layer's cache from its
layer type with its own cache layer classes; importing the package changes none of transformers' tables; and a
saved folder opens with transformers' generic config and `AutoTokenizer` where the package is not installed."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from model_helpers import (
    WITHOUT_THE_PACKAGE_PRELUDE,
    run_without_the_package,
    tiny_config,
    word_tokenizer,
)
from torch import nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.configuration_utils import (
    ALLOWED_ATTN_LAYER_TYPES,
    ALLOWED_MLP_LAYER_TYPES,
)

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer
from hybrid_linear_models.mixer_registry import MIXERS, MixerSpec, register

EVERY_MIXER = ["gated_deltanet", "kimi_delta_attention", "sliding_attention", "mla_attention", "full_attention"]
TRANSFORMERS_WORDS = ["linear_attention", "linear_attention", "sliding_attention", "full_attention", "full_attention"]
EVERY_MLP = ["dense", "sparse_moe", "kimi_moe", "dense", "sparse_moe"]


def every_kind_config(**overrides) -> HybridLinearConfig:
    settings = dict(mlp_types=EVERY_MLP, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    return tiny_config(EVERY_MIXER, **{**settings, **overrides})


def settings(config: HybridLinearConfig) -> dict:
    return {key: value for key, value in config.to_diff_dict().items() if key != "auto_map"}


def test_config_json_holds_transformers_words_beside_the_mixers(tmp_path):
    every_kind_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layer_types"] == TRANSFORMERS_WORDS and set(saved["layer_types"]) <= set(ALLOWED_ATTN_LAYER_TYPES)
    assert saved["mixer_types"] == EVERY_MIXER
    assert saved["mlp_layer_types"] == ["dense", "sparse", "sparse", "dense", "sparse"]
    assert set(saved["mlp_layer_types"]) <= set(ALLOWED_MLP_LAYER_TYPES) and saved["mlp_types"] == EVERY_MLP
    assert settings(HybridLinearConfig.from_pretrained(tmp_path)) == settings(every_kind_config())


def test_transformers_words_alone_pick_the_default_mixer_and_mlp():
    config = tiny_config(layer_types=["linear_attention", "full_attention", "sliding_attention"],
                         mlp_layer_types=["dense", "sparse", "dense"], num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16)
    assert config.mixer_types == ["gated_deltanet", "full_attention", "sliding_attention"]  # Qwen3-Next's choice
    assert config.mlp_types == ["dense", "sparse_moe", "dense"]


def test_a_config_json_naming_mixers_in_layer_types_loads_silently_and_saves_both_lists(tmp_path, caplog):
    every_kind_config().save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    old = {key: value for key, value in written.items() if key not in ("mixer_types", "mlp_layer_types")}
    old["layer_types"] = EVERY_MIXER
    (tmp_path / "config.json").write_text(json.dumps(old))
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error")
        loaded = HybridLinearConfig.from_pretrained(tmp_path)
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
    assert settings(loaded) == settings(every_kind_config())
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["layer_types"] == TRANSFORMERS_WORDS


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["full_attention", "full_attention"], mixer_types=["gated_deltanet", "full_attention"]),
     r"layer_types\[0\]='full_attention' but mixer_types\[0\]='gated_deltanet' is a 'linear_attention' layer"),
    (dict(layer_types=["full_attention"], mixer_types=["full_attention", "full_attention"]),
     r"layer_types must be a list of one entry per layer \(2, as mixer_types\)"),
    (dict(layer_types=["full_attention", "mamba2"]), r"layer_types has unknown entries \['mamba2'\]"),
    (dict(mixer_types=["linear_attention"]), r"mixer_types has unknown entries \['linear_attention'\]"),
    (dict(layer_types=["full_attention"], mlp_types=["dense"], mlp_layer_types=["sparse"]),
     r"mlp_layer_types\[0\]='sparse' but mlp_types\[0\]='dense' is a 'dense' layer"),
])
def test_lists_that_disagree_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as caught:
        HybridLinearConfig(**overrides)
    assert "\n" not in str(caught.value)


def test_transformers_builds_each_layer_cache_from_its_layer_type():
    config = every_kind_config()
    assert [type(layer) for layer in DynamicCache(config=config).layers] == [
        LinearAttentionLayer, LinearAttentionLayer, DynamicSlidingWindowLayer, DynamicLayer, DynamicLayer]
    static = StaticCache(config=config, max_cache_len=16)
    assert [type(layer) for layer in static.layers] == [
        LinearAttentionLayer, LinearAttentionLayer, StaticSlidingWindowLayer, StaticLayer, StaticLayer]
    model = HybridLinearForCausalLM(config).eval()
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 5)), cache=static, use_cache=True)
    # the recurrent states live in transformers' LinearAttentionLayer, with this package's in-place layout
    assert all(type(layer) is LinearStateLayer for layer in static.layers[:2])
    assert all(isinstance(layer, LinearAttentionLayer) for layer in static.layers[:2])


def test_a_mixer_whose_layer_type_holds_another_state_is_refused():
    spec = dict(fields={}, module_class=nn.Identity, attribute="linear_attn", parameter_count=lambda s: 0)
    with pytest.raises(ValueError, match=r"MixerSpec of 'toy': layer_type must be a transformers layer type whose "
                                         r"cache holds a recurrent state, one of \(.*'linear_attention'"):
        register(MixerSpec(mixer_type="toy", layer_type="full_attention", state="recurrent", **spec))
    with pytest.raises(ValueError, match="holds a kv state"):
        register(MixerSpec(mixer_type="toy", layer_type="gated_deltanet", state="kv", **spec))
    assert "toy" not in MIXERS


GENERIC_TOOLS = WITHOUT_THE_PACKAGE_PRELUDE + """
from transformers import AutoTokenizer, PreTrainedConfig

folder = sys.argv[1]
config = PreTrainedConfig.from_pretrained(folder)  # transformers' generic config: checks layer_types
tokenizer = AutoTokenizer.from_pretrained(folder)
config.validate_layer_type()
assert "hybrid_linear_models" not in sys.modules
print(json.dumps({"layer_types": config.layer_types, "mlp_layer_types": config.mlp_layer_types,
                  "ids": tokenizer("the cat")["input_ids"]}))
"""


@pytest.mark.slow  # a subprocess that imports transformers' tokenizers
def test_generic_config_and_auto_tokenizer_read_a_saved_folder_without_the_package(tmp_path):
    folder = tmp_path / "model"
    every_kind_config().save_pretrained(folder)
    word_tokenizer(["the", "cat"]).save_pretrained(folder)
    script = tmp_path / "generic_tools.py"
    script.write_text(GENERIC_TOOLS)
    result = run_without_the_package(script, folder, cwd=tmp_path)
    last = result.stdout.strip().splitlines()[-1]  # (after transformers' remote-code question, answered no)
    report = json.loads(last[last.index("{"):])
    assert report == {"layer_types": TRANSFORMERS_WORDS, "mlp_layer_types": ["dense", "sparse", "sparse", "dense",
                                                                             "sparse"], "ids": [2, 3]}


TABLES_UNTOUCHED = """
import json
from transformers import cache_utils, configuration_utils, masking_utils

def tables():
    return json.dumps({
        "allowed": [list(configuration_utils.ALLOWED_ATTN_LAYER_TYPES), list(configuration_utils.ALLOWED_LAYER_TYPES),
                    list(configuration_utils.ALLOWED_MLP_LAYER_TYPES)],
        "caches": [{k: v.__qualname__ for k, v in table.items()}
                   for table in (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, cache_utils.STATIC_LAYER_TYPE_MAPPING)],
        "masks": sorted(masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING),
    }, sort_keys=True)

before = tables()
import torch
import hybrid_linear_models
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
config = HybridLinearConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, gdn_num_key_heads=1, gdn_num_value_heads=1,
                            gdn_key_head_dim=8, gdn_value_head_dim=8, layer_types=["gated_deltanet", "full_attention"])
HybridLinearForCausalLM(config)(torch.tensor([[1, 2, 3]]))
assert tables() == before, (before, tables())
print("unchanged")
"""


@pytest.mark.slow  # a subprocess that imports the package
def test_importing_the_package_leaves_transformers_tables_alone(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", TABLES_UNTOUCHED], capture_output=True, text=True, check=False,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and result.stdout.strip().endswith("unchanged"), result.stderr[-3000:]

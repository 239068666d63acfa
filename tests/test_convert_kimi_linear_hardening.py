"""Bad Kimi-Linear folders: each is refused with one ConversionError line naming the file, field or tensor, the
problem and the fix, before any output is written; an existing DST is left alone; and a fuzzer: mutated config.json
and safetensors headers are read or refused with a ConversionError, never another exception, within the deadline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conversion_helpers import edit_tensors, Reading, edit_config
from fuzz_strategies import FUZZ_SETTINGS, mutated, safetensors_file, split_safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from test_convert_kimi_linear import as_hub_layout, save_kimi

from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.formats import get_format


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi_linear") / "model"
    save_kimi(folder)
    as_hub_layout(folder)
    return folder


READING = Reading("kimi_linear")
read_and_plan, refused, outcome = READING.read_and_plan, READING.refused, READING.outcome


def test_the_unedited_folder_reads(folder):
    read_and_plan(folder)
    read_and_plan(folder, to_format="kimi_linear")


@pytest.mark.parametrize("edit, fragments", [
    (lambda t: t.pop("model.layers.1.self_attn.A_log"), ("is missing tensor(s) model.layers.1.self_attn.A_log",)),
    (lambda t: t.update({"model.layers.0.self_attn.q_conv1d.bias": torch.zeros(16)}),
     ("has tensor(s) model.layers.0.self_attn.q_conv1d.bias that its config does not account for",)),
    (lambda t: t.update({"model.layers.0.self_attn.dt_bias": torch.zeros(16, dtype=torch.int32)}),
     ("tensor 'model.layers.0.self_attn.dt_bias' has dtype int32, but model weights are floating point",)),
    (lambda t: t.update({"model.layers.2.self_attn.A_log": torch.zeros(2)}),
     ("tensor model.layers.2.self_attn.A_log has shape [2], but the config implies [1, 1, 2, 1]",)),
    (lambda t: t.update({"model.layers.2.self_attn.k_conv1d.weight": torch.zeros(16, 1, 3)}),
     ("tensor model.layers.2.self_attn.k_conv1d.weight has shape [16, 1, 3], but the config implies [16, 1, 4]",)),
])
def test_bad_tensors_are_refused_by_name(folder, edit, fragments):
    edit_tensors(folder, edit)
    refused(folder, *fragments)


def test_truncated_file_is_refused(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    refused(folder, "model.safetensors is not a valid safetensors file", "truncated or corrupt")


LISTS = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4}


@pytest.mark.parametrize("field, value, fragments", [
    ("model_type", "llama", ("has model_type 'llama'; --from kimi_linear reads 'kimi_linear' models",)),
    ("model_type", "hybrid_linear", ("(use --from hf)",)),
    ("hidden_act", "gelu", ("hidden_act is 'gelu'", "only 'silu' converts")),
    ("linear_attn_config", {**LISTS, "kda_layers": [1, 2, 4], "full_attn_layers": []},
     ("linear_attn_config.kda_layers[2] is 4, not a layer number (1 to 3: these lists count from 1)",)),
    ("linear_attn_config", {**LISTS, "kda_layers": [1, 2, 2], "full_attn_layers": []},
     ("layer 2 is listed twice",)),
    ("linear_attn_config", {**LISTS, "kda_layers": [1, 2], "full_attn_layers": []},
     ("layer(s) [3] are in neither linear_attn_config.kda_layers nor full_attn_layers",)),
    ("linear_attn_config", {**LISTS, "kda_layers": [1, 2, 3], "full_attn_layers": [], "gate_lower_bound": -5.0},
     ("linear_attn_config field(s) ['linear_attn_config.gate_lower_bound'] are not Kimi-Linear settings",)),
    ("linear_attn_config", {**LISTS, "num_heads": 4, "kda_layers": [1, 2, 3], "full_attn_layers": []},
     ("linear_attn_config.num_heads (4) and linear_num_heads (2) name the same setting and disagree",)),
    ("layer_types", ["linear_attention", "full_attention", "linear_attention"],
     ("layer_types[1] is 'full_attention' but linear_attn_config makes layer 2 (1-indexed) 'linear_attention'",)),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention"],
     ("layer_types[1] is 'sliding_attention'; Kimi-Linear layers are",)),
    ("layer_types", ["linear_attention"], ("layer_types lists 1 layers but num_hidden_layers is 3",)),
    ("mlp_layer_types", ["dense", "sparse", "sparse"],
     ("mlp_layer_types (['dense', 'sparse', 'sparse']) disagrees with first_k_dense_replace (3)",)),
    ("mlp_layer_types", ["dense", "moe", "dense"], ("mlp_layer_types[1] is 'moe'",)),
    ("moe_layer_freq", 2, ("moe_layer_freq is 2", "only 1 converts")),
    ("max_position_embeddings", 77, ("model_max_length (1048576) and max_position_embeddings (77) name the same "
                                     "setting and disagree",)),
    ("num_nextn_predict_layers", 1, ("num_nextn_predict_layers is 1",)),
    ("tie_word_embeddings", True, ("tie_word_embeddings true but the folder stores lm_head.weight",)),
    ("quantization_config", {"quant_method": "fp8"}, ("quantization_config", "refuses rather than guess")),
    ("num_hidden_layers", 10**9, ("num_hidden_layers is 1000000000 but the checkpoint holds tensors for 3 blocks",)),
    ("hidden_size", 10**12, ("hidden_size is 1000000000000, more than the",)),
    ("intermediate_size", 64, ("model.layers.0.mlp.gate_proj.weight has shape [48, 32], but the config implies "
                               "[64, 32]",)),
    ("rms_norm_eps", -1.0, ("config.json: rms_norm_eps should be a positive number, got a number -1.0",)),
    ("tie_word_embeddings", "false", ("tie_word_embeddings should be true or false",)),
    ("eos_token_id", "x", ("eos_token_id should be a token id",)),
])
def test_bad_config_values_are_refused_by_name(folder, field, value, fragments):
    edit_config(folder, lambda config: config.__setitem__(field, value))
    refused(folder, *fragments)


def test_mla_without_nope_is_refused(folder):
    """transformers' KimiLinear never applies RoPE in MLA: a folder asking for it is refused by name."""
    def edit(config):
        config["linear_attn_config"] = {**LISTS, "kda_layers": [1, 2], "full_attn_layers": [3]}
        config["layer_types"] = ["linear_attention", "linear_attention", "full_attention"]
        config["mla_use_nope"] = False
    edit_config(folder, edit)
    refused(folder, "mla_use_nope is false", "only true converts")


def test_hf_reader_points_to_kimi_linear(folder):
    with pytest.raises(ConversionError, match=r"model_type 'kimi_linear'; --from hf reads .* --from kimi_linear"):
        get_format("hf", "read").read(folder)


def test_refused_source_writes_nothing(folder, tmp_path):
    edit_config(folder, lambda config: config.__setitem__("hidden_act", "gelu"))
    with pytest.raises(ConversionError, match="hidden_act"):
        convert_checkpoint(folder, tmp_path / "out", from_format="kimi_linear", to_format="hf")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_left_alone(folder, tmp_path):
    """An existing DST is refused without --force; --force replaces a Kimi-Linear folder but not one holding other
    files (named, left alone)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists; choose another path or pass --force"):
        convert_checkpoint(folder, out, from_format="kimi_linear", to_format="kimi_linear")
    with pytest.raises(ConversionError, match="notes.txt"):
        convert_checkpoint(folder, out, from_format="kimi_linear", to_format="kimi_linear", force=True)
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    (out / "notes.txt").unlink()
    convert_checkpoint(folder, out, from_format="kimi_linear", to_format="kimi_linear", force=True)
    convert_checkpoint(folder, out, from_format="kimi_linear", to_format="kimi_linear", force=True)  # its own output
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_linear"


# --------------------------------------------------------------------------------------------- fuzzing


@settings(FUZZ_SETTINGS, max_examples=50)  # half the others' examples: one small folder, two files
@given(data=st.data())
def test_fuzz_kimi_linear_config_json(mutable, data):
    config = data.draw(mutated(json.loads(mutable.originals["config.json"])))
    outcome(mutable.with_file("config.json", json.dumps(config)))


@settings(FUZZ_SETTINGS, max_examples=50)  # half the others' examples: one small folder, two files
@given(data=st.data())
def test_fuzz_kimi_linear_safetensors_header(mutable, data):
    header, tensor_data = split_safetensors(mutable.originals["model.safetensors"])
    blob = data.draw(safetensors_file(data.draw(mutated(header)), tensor_data))
    outcome(mutable.with_file("model.safetensors", blob))


# --------------------------------------------------------------------------------------------- MLA and MoE folders


@pytest.fixture(scope="module")
def moe_original(tmp_path_factory) -> Path:
    from test_convert_kimi_linear import MOE_CASES, save_kimi_moe

    folder = tmp_path_factory.mktemp("kimi_moe") / "model"
    save_kimi_moe(folder, **MOE_CASES["grouped"])  # dense, MLA... layer 1 (0-indexed) is MLA, layers 1-2 MoE
    return folder


@pytest.mark.parametrize("tensor_edit, config_edit, fragment", [
    (lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight"), None,
     "is missing tensor(s) model.layers.2.block_sparse_moe.experts.3.w3.weight"),
    (lambda t: t.update({"model.layers.2.block_sparse_moe.experts.4.w1.weight": torch.zeros(16, 32)}), None,
     "has tensor(s) model.layers.2.block_sparse_moe.experts.4.w1.weight that its config does not account for"),
    (lambda t: t.pop("model.layers.1.self_attn.kv_a_layernorm.weight"), None,
     "is missing tensor(s) model.layers.1.self_attn.kv_a_layernorm.weight"),
    (None, lambda c: c.update(num_experts_per_token=5), "num_experts_per_token (5) is more than num_experts (4)"),
    (None, lambda c: c.update(num_experts_per_tok=3),
     "num_experts_per_token (2) and num_experts_per_tok (3) name the same setting and disagree"),
    (None, lambda c: c.update(num_shared_experts=0), "num_shared_experts should be an integer >= 1, got an integer 0"),
    (None, lambda c: c.update(moe_router_activation_func="softmax"), "moe_router_activation_func is 'softmax'"),
    (None, lambda c: c.update(use_grouped_topk=False), "use_grouped_topk is false with num_expert_group 2"),
    (None, lambda c: c.update(num_experts=10**12), "num_experts is 1000000000000, more than the"),
    (None, lambda c: c.update(num_key_value_heads=1), "num_key_value_heads (1) differs from num_attention_heads (2)"),
    (None, lambda c: c.update(attention_bias=True),
     "is missing tensor(s) model.layers.1.self_attn.kv_a_proj_with_mqa.bias"),
    (None, lambda c: c.update(q_lora_rank=0), "q_lora_rank should be an integer >= 1, got an integer 0"),
    (None, lambda c: c.update(kv_lora_rank=16),
     "model.layers.1.self_attn.kv_a_proj_with_mqa.weight has shape [12, 32], but the config implies [20, 32]"),
])
def test_bad_mla_and_moe_folders_are_refused_by_name(tmp_path, moe_original, tensor_edit, config_edit, fragment):
    folder = Path(shutil.copytree(moe_original, tmp_path / "model"))
    if tensor_edit:
        edit_tensors(folder, tensor_edit)
    if config_edit:
        edit_config(folder, config_edit)
    refused(folder, fragment)

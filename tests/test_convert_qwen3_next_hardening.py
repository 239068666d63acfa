"""Bad Qwen3-Next folders: each is refused with one ConversionError line naming the file, field or tensor, the
problem and the fix, before any output is written; and a fuzzer: mutated config.json and safetensors headers are
read or refused with a ConversionError, never another exception, within the deadline."""

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
from safetensors.torch import save_file
from test_convert_qwen3_next import save_qwen3_next

from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.formats import get_format


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_next") / "model"
    save_qwen3_next(folder, num_experts=0)
    return folder


READING = Reading("qwen3_next")
read_and_plan, refused, outcome = READING.read_and_plan, READING.refused, READING.outcome


def test_the_unedited_folder_reads(folder):
    read_and_plan(folder)


@pytest.mark.parametrize("edit, fragments", [
    (lambda t: t.pop("model.layers.1.linear_attn.A_log"),
     ("is missing tensor(s) model.layers.1.linear_attn.A_log",)),
    (lambda t: t.update({"model.layers.0.linear_attn.lora_A.weight": torch.zeros(2, 32)}),
     ("has tensor(s) model.layers.0.linear_attn.lora_A.weight that its config does not account for",)),
    (lambda t: t.update({"model.layers.0.linear_attn.A_log": torch.zeros(4, dtype=torch.int32)}),
     ("tensor 'model.layers.0.linear_attn.A_log' has dtype int32, but model weights are floating point",)),
    (lambda t: t.update({"model.layers.2.linear_attn.conv1d.weight": torch.zeros(64, 1, 3)}),
     ("tensor model.layers.2.linear_attn.conv1d.weight has shape [64, 1, 3], but the config implies [64, 1, 4]",)),
])
def test_bad_tensors_are_refused_by_name(folder, edit, fragments):
    edit_tensors(folder, edit)
    refused(folder, *fragments)


def test_truncated_file_is_refused(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    refused(folder, "model.safetensors is not a valid safetensors file", "truncated or corrupt")


@pytest.mark.parametrize("field, value, fragments", [
    ("model_type", "llama", ("has model_type 'llama'; --from qwen3_next reads 'qwen3_next' models",)),
    ("model_type", "hybrid_linear", ("(use --from hf)",)),
    ("hidden_act", "gelu", ("hidden_act is 'gelu'", "only 'silu' converts")),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
     ("layer_types[1] is 'sliding_attention'",)),
    ("layer_types", ["linear_attention"], ("layer_types lists 1 layers but num_hidden_layers is 4",)),
    ("layer_types", "linear_attention", ("layer_types should be a non-empty list of strings",)),
    ("use_sliding_window", True, ("use_sliding_window is True",)),
    ("sliding_window", 128, ("sliding_window is 128",)),
    ("quantization_config", {"quant_method": "fp8"}, ("quantization_config.weight_block_size is None",
                                                      "a weight_block_size of two positive integers")),
    ("quantization_config", {"quant_method": "gptq", "bits": 4}, ("quantization_config.quant_method is 'gptq'",)),
    ("num_hidden_layers", 10**9, ("num_hidden_layers is 1000000000 but the checkpoint holds tensors for 4 blocks",)),
    ("hidden_size", 10**12, ("hidden_size is 1000000000000, more than the",)),
    ("linear_value_head_dim", 16, ("model.layers.0.linear_attn.in_proj_qkvz.weight has shape [96, 32], but the "
                                   "config implies [160, 32]",)),
    ("linear_num_value_heads", 3, ("not a valid model once mapped", "gdn_num_value_heads")),
    ("rms_norm_eps", -1.0, ("config.json: rms_norm_eps should be a positive number, got a number -1.0",)),
    ("rms_norm_eps", "1e-6", ("rms_norm_eps should be a positive number",)),
    ("tie_word_embeddings", "false", ("tie_word_embeddings should be true or false",)),
    ("eos_token_id", "x", ("eos_token_id should be a token id",)),
    ("mlp_only_layers", [0, 7], ("mlp_only_layers[1] is 7, not a layer index (0 to 3)",)),
    ("rope_parameters", {"rope_type": "nonsense", "rope_theta": 1.0}, ("not a valid model once mapped", "rope_param")),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1.0}, ("the rotary settings (rope_parameters) are not "
                                                                  "valid for Qwen3NextConfig",)),
    ("rope_parameters", [1, 2], ("config.json: rope_parameters should be a mapping",)),
])
def test_bad_config_values_are_refused_by_name(folder, field, value, fragments):
    edit_config(folder, lambda config: config.__setitem__(field, value))
    refused(folder, *fragments)


def test_hf_reader_points_to_qwen3_next(folder):
    with pytest.raises(ConversionError, match=r"model_type 'qwen3_next'; --from hf reads .* use --from qwen3_next\."):
        get_format("hf", "read").read(folder)


def test_refused_source_writes_nothing(folder, tmp_path):
    edit_config(folder, lambda config: config.__setitem__("hidden_act", "gelu"))
    with pytest.raises(ConversionError, match="hidden_act"):
        convert_checkpoint(folder, tmp_path / "out", from_format="qwen3_next", to_format="hf")
    assert not (tmp_path / "out").exists()


def test_carried_tensors_from_elsewhere_are_not_written_as_qwen3_next(folder, tmp_path):
    """An extra tensors file whose origin is another format: --to qwen3_next refuses it by origin."""
    convert_checkpoint(folder, tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    save_file({"vision.patch.weight": torch.zeros(2, 2)}, tmp_path / "hf" / "extra_tensors.safetensors",
              metadata={"carried_from": "some_format", "carried_fields": "{}"})
    with pytest.raises(ConversionError, match="carries tensors from some_format"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "out", from_format="hf", to_format="qwen3_next")
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, tmp_path / "hf" / "extra_tensors.safetensors",
              metadata={"carried_from": "../x"})
    with pytest.raises(ConversionError, match="'carried_from' should name the format"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "out", from_format="hf", to_format="hf")


# --------------------------------------------------------------------------------------------- fuzzing


@settings(FUZZ_SETTINGS, max_examples=50)  # half the others' examples: one small folder, two files
@given(data=st.data())
def test_fuzz_qwen3_next_config_json(mutable, data):
    config = data.draw(mutated(json.loads(mutable.originals["config.json"])))
    outcome(mutable.with_file("config.json", json.dumps(config)))


@settings(FUZZ_SETTINGS, max_examples=50)  # half the others' examples: one small folder, two files
@given(data=st.data())
def test_fuzz_qwen3_next_safetensors_header(mutable, data):
    header, tensor_data = split_safetensors(mutable.originals["model.safetensors"])
    blob = data.draw(safetensors_file(data.draw(mutated(header)), tensor_data))
    outcome(mutable.with_file("model.safetensors", blob))


def test_bad_moe_folders_are_refused_by_name(tmp_path):
    moe = dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
               mlp_only_layers=[1, 2, 3])
    save_qwen3_next(tmp_path / "moe", **moe)
    cases = [
        (lambda t: t.pop("model.layers.0.mlp.experts.2.up_proj.weight"), None,
         "is missing tensor(s) model.layers.0.mlp.experts.2.up_proj.weight"),
        (lambda t: t.update({"model.layers.0.mlp.experts.3.up_proj.weight": torch.zeros(8, 32)}), None,
         "has tensor(s) model.layers.0.mlp.experts.3.up_proj.weight that its config does not account for"),
        (None, lambda c: c.update(num_experts_per_tok=4), "num_experts_per_tok (4) is more than num_experts (3)"),
        (None, lambda c: c.update(shared_expert_intermediate_size=0),
         "shared_expert_intermediate_size is 0; Qwen3-Next then still has a shared-expert gate"),
        (None, lambda c: c.update(num_experts=10**12), "num_experts is 1000000000000, more than the"),
        (None, lambda c: c.update(decoder_sparse_step=0), "decoder_sparse_step should be an integer >= 1"),
    ]
    for index, (tensor_edit, config_edit, fragment) in enumerate(cases):
        folder = Path(shutil.copytree(tmp_path / "moe", tmp_path / f"case{index}"))
        if tensor_edit:
            edit_tensors(folder, tensor_edit)
        if config_edit:
            edit_config(folder, config_edit)
        refused(folder, fragment)

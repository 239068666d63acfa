"""Bad Apriel2 folders: each is refused with one ConversionError line naming the file, the block / field or tensor,
the problem and the fix, before anything is converted. Copies of the real fixture (`hybrid_attn_gdn_kda`, blocks
`attn`, `gdn`, `kda`) with one thing broken each; then property-based fuzzing of config.json and the safetensors
header (reading either succeeds or raises ConversionError, one line, within the deadline). The index is read by the
hf reader's code, fuzzed in test_fuzz_checkpoints."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conversion_helpers import edit_tensors as shared_edit_tensors, FuzzFolder, Reading, edit_config
from fuzz_strategies import FUZZ_SETTINGS, mutated, safetensors_file, split_safetensors
from work_bounds import bounded_work
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from test_reader_hardening import configs

from hybrid_linear_models import HybridLinearConfig
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.apriel2 import checkpoint as apriel2_checkpoint
from hybrid_linear_models.conversion.apriel2 import config_writer
from hybrid_linear_models.conversion.apriel2.checkpoint import check_config_reads_back, config_json
from hybrid_linear_models.conversion.apriel2 import apriel2_to_hybrid_config, read_apriel2
from hybrid_linear_models.conversion.hf import read_hf
from hybrid_linear_models.conversion.pipeline import TensorCensus
from hybrid_linear_models.conversion.synthetic import write_random_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "apriel2_text"
WEIGHTS = "model_0.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def folder(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "apriel2"))


READING = Reading("apriel2")
refused, outcome = READING.refused, READING.outcome


def edit_tensors(folder: Path, edit: Callable[[dict], None]) -> None:
    shared_edit_tensors(folder, edit, WEIGHTS)
    tensors = load_file(folder / WEIGHTS)
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, WEIGHTS)}))


def setter(dotted: str, value) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        *parents, last = dotted.split(".")
        node = config
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


def deleter(dotted: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        *parents, last = dotted.split(".")
        node = config
        for key in parents:
            node = node[key]
        del node[last]
    return edit


BLOCKS = "decoder.blocks"


# --------------------------------------------------------------------------------------------- config values


@pytest.mark.parametrize("edit, fragments", [
    # unsupported mixers and settings: named by block and field
    (setter(f"{BLOCKS}.gdn.mixer.type", "mamba"), ("decoder.blocks.gdn.mixer.type = 'mamba'", "Mamba")),
    (setter(f"{BLOCKS}.kda.mixer.type", "retnet"), ("decoder.blocks.kda.mixer.type = 'retnet'",
                                                    "unknown mixer type")),
    (setter(f"{BLOCKS}.attn.mixer.rotary.type", "yarn"), ("decoder.blocks.attn.mixer.rotary.type = 'yarn'",
                                                          "mistral_1d")),
    (setter(f"{BLOCKS}.attn.mixer.causal", False), ("decoder.blocks.attn.mixer.causal = False", "bidirectional")),
    (setter(f"{BLOCKS}.attn.mixer.softmax_scale_power", 1.0), ("softmax_scale_power = 1.0",)),
    (deleter(f"{BLOCKS}.attn.mixer.add_linear_biases"), ("decoder.blocks.attn.mixer.add_linear_biases",
                                                         "ambiguous")),
    (setter(f"{BLOCKS}.attn.mixer.query_layer", {"bias": {"enabled": True}}),
     ("decoder.blocks.attn.mixer mixes linear layers", "query_layer: bias, key_layer: no bias")),
    (setter(f"{BLOCKS}.gdn.mlp.gated", False), ("decoder.blocks.gdn.mlp.gated = False", "non-gated")),
    (deleter(f"{BLOCKS}.gdn.mlp.gated"), ("decoder.blocks.gdn.mlp.gated = None", "only gated: true converts")),
    (setter(f"{BLOCKS}.gdn.mlp.add_linear_biases", True), ("decoder.blocks.gdn.mlp asks for MLP biases",
                                                           "MistralMLP")),
    (setter(f"{BLOCKS}.gdn.mlp.type", "moe"), ("decoder.blocks.gdn.mlp.type = 'moe'",)),
    (setter(f"{BLOCKS}.gdn.mlp.activation", "tanh"), ("decoder.blocks.gdn.mlp.activation should be one of",)),
    (setter(f"{BLOCKS}.kda.normalization.type", "layer_norm"), ("decoder.blocks.kda.normalization.type = "
                                                                "'layer_norm'",)),
    (setter(f"{BLOCKS}.kda.normalization.epsilon", 1e-6), ("decoder.blocks.kda.normalization.epsilon is 1e-06",
                                                           "head's epsilon")),
    (setter(f"{BLOCKS}.kda.mixer.normalization.activation", "tanh"),
     ("decoder.blocks.kda.mixer.normalization.activation should be one of 'silu', 'sigmoid'",)),
    (setter(f"{BLOCKS}.gdn.mixer.convolution_layer.activation", "identity"),
     ("decoder.blocks.gdn.mixer.convolution_layer.activation = 'identity'",)),
    (deleter(f"{BLOCKS}.gdn.mixer.convolution_layer"), ("decoder.blocks.gdn.mixer.convolution_layer",
                                                        "kernel_size")),
    (setter(f"{BLOCKS}.gdn.mixer.normalization", {"epsilon": 1e-3}), ("decoder.blocks.gdn.mixer.normalization",
                                                                      "not supported")),
    (setter(f"{BLOCKS}.attn.mixer.window_size", 0), ("decoder.blocks.attn.mixer.window_size should be an integer "
                                                     ">= 1",)),
    (setter("decoder.type", "parallel"), ("decoder.type = 'parallel'",)),
    (setter("decoder.pattern", ["attn", "ssm"]), ("decoder.pattern names block(s) ['ssm']",)),
    (setter("decoder.pattern", []), ("decoder.pattern should be a non-empty list",)),
    (setter("head.normalization.type", "layer_norm"), ("head.normalization.type = 'layer_norm'",)),
    (setter("vision_encoder", {"hidden_size": 8}), ("field(s) vision_encoder not supported",)),
    (setter("model_type", "apriel2"), ("model_type 'apriel2'", "only the text model")),
    (setter("model_type", "hybrid_linear"), ("model_type 'hybrid_linear'", "--from hf")),
    # hostile values: types and sizes, bounded by the stored tensors before any per-layer table
    (setter("decoder.num_blocks", 10**12), ("decoder.num_blocks is 1000000000000", "tensors for 4 blocks")),
    (setter("decoder.num_blocks", "4"), ("decoder.num_blocks should be an integer", "a string '4'")),
    (setter("hidden_size", 10**18), ("hidden_size is 1000000000000000000", "weight elements")),
    (setter("vocab_size", 0), ("vocab_size should be an integer >= 1",)),
    (setter(f"{BLOCKS}.attn.mixer.heads", True), ("decoder.blocks.attn.mixer.heads should be an integer",)),
    (setter(f"{BLOCKS}.attn.mixer.heads", 3), ("HybridLinearConfig rejects", "Apriel2 block")),
    (setter(f"{BLOCKS}.gdn.mixer.value_heads", -4), ("decoder.blocks.gdn.mixer.value_heads should be an integer",)),
    (setter(f"{BLOCKS}.attn.mixer.rotary.theta", "1e4"), ("rotary.theta should be a positive number",)),
    (setter("head.normalization.epsilon", float("nan")), ("head.normalization.epsilon is nan; JSON has no NaN",)),
    (setter("eos_token_id", "</s>"), ("eos_token_id should be a non-negative integer or null",)),
    (setter("tie_word_embeddings", "false"), ("tie_word_embeddings should be true or false",)),
    (setter("decoder", [1, 2]), ("config.json: decoder should be a mapping",)),
])
def test_bad_config_is_refused_naming_the_field(folder, edit, fragments):
    edit_config(folder, edit)
    refused(folder, "config.json", *fragments)


def test_shape_mismatch_names_the_tensor(folder):
    edit_config(folder, setter(f"{BLOCKS}.attn.mlp.intermediate_size", 40))
    refused(folder, "model.decoder.blocks.0.mlp.gate_proj.weight", "has shape [48, 64]", "implies [40, 64]")


def test_huge_block_count_fails_fast():
    config = json.loads((FIXTURE / "config.json").read_text())
    config["decoder"]["num_blocks"] = 10**15
    with bounded_work(), pytest.raises(ConversionError):  # refused before a 10^15-entry list could be built
        apriel2_to_hybrid_config(config, TensorCensus(elements=10**6, block_indices=frozenset(range(4)),
                                                      block_prefix="model.decoder.blocks."))


# --------------------------------------------------------------------------------------------- tensors and files


def test_missing_tensor_is_named(folder):
    edit_tensors(folder, lambda tensors: tensors.pop("model.decoder.blocks.1.mixer.A_log"))
    refused(folder, "missing tensor(s) model.decoder.blocks.1.mixer.A_log", "apriel2 format")


def test_extra_tensor_is_named(folder):
    edit_tensors(folder, lambda tensors: tensors.__setitem__("model.decoder.blocks.0.mixer.q_proj.bias",
                                                             torch.zeros(64)))
    refused(folder, "has tensor(s) model.decoder.blocks.0.mixer.q_proj.bias", "does not account for")


def test_stochastic_tensors_without_a_stochastic_mixer_are_extra(folder):
    edit_tensors(folder, lambda tensors: tensors.__setitem__(
        "model.decoder.blocks.1.mixer.mixers.other.A_log", torch.zeros(4)))
    refused(folder, "model.decoder.blocks.1.mixer.mixers.other.A_log", "does not account for")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_non_floating_weight_is_refused(folder, dtype):
    edit_tensors(folder, lambda tensors: tensors.__setitem__("model.norm.weight",
                                                             tensors["model.norm.weight"].to(dtype)))
    refused(folder, "tensor 'model.norm.weight' has dtype", "floating point")


def test_truncated_safetensors_is_refused(folder):
    blob = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(blob[: len(blob) // 2])
    refused(folder, WEIGHTS, "truncated or corrupt")


def test_index_pointing_outside_the_folder_is_refused(folder):
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "../model_0.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    refused(folder, "weight_map['model.norm.weight']", "plain file name")


@pytest.mark.parametrize("text, fragments", [
    ("{", ("config.json is not valid JSON",)),
    ('{"model_type": "apriel2_text", "model_type": "apriel2_text"}', ("appears twice",)),
    ("[" * 100 + "]" * 100, ("nests deeper than",)),
])
def test_unreadable_config_json_is_refused(folder, text, fragments):
    (folder / "config.json").write_text(text)
    refused(folder, *fragments)


def test_a_list_model_type_is_refused_in_one_line(folder):
    edit_config(folder, setter("model_type", []))
    refused(folder, "config.json has model_type []")


def test_a_fast_llm_folder_is_pointed_to_its_reader():
    refused(FIXTURE.parent / "fast_llm", "has no config.json", "--from fast_llm")


# --------------------------------------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def fuzz_folder(tmp_path_factory) -> FuzzFolder:
    return FuzzFolder(Path(shutil.copytree(FIXTURE, tmp_path_factory.mktemp("fuzz") / "apriel2")))


with_file = FuzzFolder.with_file  # with_file(folder, name, content): the fuzz tests' examples follow their source


def test_the_unmutated_folder_reads(fuzz_folder):
    assert outcome(with_file(fuzz_folder, "config.json", (FIXTURE / "config.json").read_text())) == "read"


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_config_json(fuzz_folder, data):
    config = data.draw(mutated(json.loads((FIXTURE / "config.json").read_text())))
    outcome(with_file(fuzz_folder, "config.json", json.dumps(config)))


@settings(FUZZ_SETTINGS, max_examples=50)  # the header parser is shared with the hf reader, fuzzed there too
@given(data=st.data())
def test_fuzz_safetensors_header(fuzz_folder, data):
    header, tensor_data = split_safetensors((FIXTURE / WEIGHTS).read_bytes())
    outcome(with_file(fuzz_folder, WEIGHTS, data.draw(safetensors_file(data.draw(mutated(header)), tensor_data))))


def test_the_hf_reader_points_an_apriel2_folder_to_its_reader():
    with pytest.raises(ConversionError, match="model_type 'apriel2_text'.*use --from apriel2"):
        read_hf(FIXTURE)


# --------------------------------------------------------------------------------------------- the writer


@FUZZ_SETTINGS
@given(config=configs(fast_llm=True))
def test_apriel2_config_written_reads_back_equal_or_is_refused(config):
    """Any config either is refused up front, naming what Apriel2 cannot express, or its config.json reads back to
    the same model in every field Apriel2 carries, layer by layer."""
    try:
        text = config_json(config)
    except ConversionError as error:
        assert "cannot be expressed as an Apriel2 model" in str(error) and "\n" not in str(error)
        return
    check_config_reads_back(config, text)


def test_a_config_json_that_would_not_read_back_is_refused_before_writing(tmp_path, monkeypatch):
    """A writer bug dropping a field (here the KDA gate) must stop the conversion before any file is written."""
    config = HybridLinearConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                layer_types=["kimi_delta_attention"], kda_num_heads=2, kda_head_dim=8,
                                kda_gate_activation="sigmoid", zero_centered_norms=False)
    write_random_checkpoint(tmp_path / "hf", config, "hf")
    real = config_writer.hybrid_config_to_apriel2

    def dropping_the_gate(config):
        written = real(config)
        del written["decoder"]["blocks"]["kda"]["mixer"]["normalization"]["activation"]
        return written
    monkeypatch.setattr(apriel2_checkpoint, "hybrid_config_to_apriel2", dropping_the_gate)
    with pytest.raises(ConversionError, match="kda_gate_activation of layer 0 .'sigmoid' reads back as 'silu'"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "apriel2", from_format="hf", to_format="apriel2")
    assert not (tmp_path / "apriel2").exists()


def test_sharded_apriel2_output_reads_back(tmp_path):
    hf = convert_checkpoint(FIXTURE, tmp_path / "hf", from_format="apriel2", to_format="hf").destination
    sharded = convert_checkpoint(hf, tmp_path / "sharded", from_format="hf", to_format="apriel2",
                                 max_shard_size="40KB").destination
    assert (sharded / INDEX).is_file() and len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    original = load_file(FIXTURE / WEIGHTS)
    returned = {}
    for path in sharded.glob("*.safetensors"):
        returned.update(load_file(path))
    assert sorted(returned) == sorted(original) and all(torch.equal(original[k], returned[k]) for k in original)
    assert read_apriel2(sharded).config.to_dict() == read_apriel2(FIXTURE).config.to_dict()

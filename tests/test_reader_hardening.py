"""The checkpoint readers under hostile input: values of the wrong type, deep nesting, YAML alias bombs, sizes that
the tensors contradict, path escapes in index files, integer weights, unbounded values in messages, and writers
whose config would not read back. Each failure is one ConversionError line naming the file and the key, raised fast
and with bounded memory."""

from __future__ import annotations

import itertools
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from fuzz_strategies import FUZZ_SETTINGS
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from work_bounds import bounded_work

from hybrid_linear_models import HybridLinearConfig
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint, untrusted
from hybrid_linear_models.conversion.fast_llm import checkpoint as fast_llm_checkpoint
from hybrid_linear_models.conversion.fast_llm import check_metadata_reads_back, metadata_yaml, read_fast_llm
from hybrid_linear_models.conversion.fast_llm.distributed import read_fast_llm_distributed
from hybrid_linear_models.conversion.formats import get_format
from hybrid_linear_models.conversion.hf import check_config_reads_back, export_config, read_hf
from hybrid_linear_models.conversion.pipeline import plan_conversion
from hybrid_linear_models.conversion.safetensors_io import SafetensorsFile
from hybrid_linear_models.conversion.synthetic import write_random_checkpoint
from hybrid_linear_models.conversion.untrusted import MAX_DEPTH, brief, clip, describe, parse_json, parse_yaml

FIXTURE = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"
READERS = {"fast_llm": read_fast_llm, "distributed": read_fast_llm_distributed, "hf": read_hf}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return convert_checkpoint(FIXTURE / "fast_llm", tmp_path_factory.mktemp("hf") / "hf", from_format="fast_llm",
                              to_format="hf").destination


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory) -> Path:
    return convert_checkpoint(FIXTURE / "fast_llm", tmp_path_factory.mktemp("hf") / "sharded", from_format="fast_llm",
                              to_format="hf", max_shard_size="100KB").destination


@pytest.fixture
def copy_of(tmp_path, hf_folder, hf_sharded):
    """copy_of(kind) -> a writable copy of a checkpoint folder: fast_llm, distributed, hf or hf_sharded."""
    copies = itertools.count()

    def make(kind: str) -> Path:
        source = {"hf": hf_folder, "hf_sharded": hf_sharded}.get(kind) or FIXTURE / kind
        return Path(shutil.copytree(source, tmp_path / f"{kind}_{next(copies)}"))
    return make


def edit_yaml(path: Path, edit) -> None:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def set_at(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    data[last] = value


def refused(folder: Path, kind: str, *fragments: str) -> str:
    """Reading (and planning a conversion of) `folder` raises one ConversionError line with every fragment."""
    with pytest.raises(ConversionError) as caught:
        source = READERS[kind](folder)
        plan_conversion(source, get_format("hf", "write").target_rows(source.config))
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --------------------------------------------------------------------------------------------- 1. types


@pytest.mark.parametrize("key, value, fragments", [
    ("decoder.num_blocks", True, ("config.base_model.decoder.num_blocks should be an integer >= 1",
                                  "got a boolean True")),
    ("decoder.num_blocks", 4.0, ("decoder.num_blocks should be an integer", "got a number 4.0")),
    ("decoder.num_blocks", 1e9, ("decoder.num_blocks should be an integer", "got a number 1000000000.0")),
    ("decoder.num_blocks", "4", ("decoder.num_blocks should be an integer", "got a string '4'")),
    ("head.final_logit_softcap", 30.0, ("head.final_logit_softcap = 30.0 is not supported (logit soft-capping)",)),
    ("tied_embedding_weight", "false", ("config.base_model.tied_embedding_weight should be true or false",
                                        "got a string 'false'")),
    ("hidden_size", [64], ("config.base_model.hidden_size should be an integer", "got a list [64]")),
    ("decoder.blocks.gdn.mixer.key_heads", {"a": 1}, ("blocks.gdn.mixer.key_heads should be an integer",
                                                      "got a mapping {'a': 1}")),
    ("decoder.blocks.attn.normalization.epsilon", "1e-5", ("normalization.epsilon should be a positive number",
                                                           "got a string '1e-5'", "write 1.0e-05")),
    ("decoder.blocks.attn.normalization.epsilon", float("nan"), ("should be a positive number", "nan")),
    ("decoder.blocks.kda.mixer.normalization.activation", 1, ("activation should be a string", "got an integer 1")),
    ("decoder.blocks.kda.mixer.normalization.activation", "relu", ("activation should be one of 'silu', 'sigmoid'",
                                                                   "got a string 'relu'")),
    ("decoder.pattern", [["attn"]], ("config.base_model.decoder.pattern[0] should be a string", "got a list")),
    ("decoder.pattern", "attn", ("decoder.pattern should be a non-empty list of strings", "got a string 'attn'")),
    ("decoder.blocks.attn.mixer.causal", 1, ("mixer.causal = 1 is not supported",)),  # 1 is not true
    ("decoder.blocks.attn.mlp.add_linear_biases", "false", ("mlp.add_linear_biases should be true or false",)),
    ("decoder.blocks.attn.mixer", ["x"], ("blocks.attn.mixer should be a mapping", "got a list ['x']")),
    ("head.prediction_heads", True, ("prediction_heads should be an integer >= 1", "got a boolean True")),
    ("head.prediction_heads", 0, ("prediction_heads should be an integer >= 1", "got an integer 0")),
])
def test_metadata_values_are_type_checked(copy_of, key, value, fragments):
    folder = copy_of("fast_llm")
    edit_yaml(folder / "metadata.yaml", lambda m: set_at(m["config"]["base_model"], key, value))
    message = refused(folder, "fast_llm", "metadata.yaml", *fragments)
    assert len(message) < 600


@pytest.mark.parametrize("edit, fragments", [
    (lambda m: m.__setitem__("metadata", [1, 2]), ("metadata.yaml: metadata should be a mapping", "a list [1, 2]")),
    (lambda m: m.__setitem__("shards", "weights"), ("shards should be a list of strings", "a string 'weights'")),
    (lambda m: m.__setitem__("shards", ["weights", 1]), ("shards[1] should be a string", "an integer 1")),
    (lambda m: m["metadata"].__setitem__("state_index", ["model_0.safetensors"]),
     ("metadata.state_index should map tensor names to file names", "a list")),
    (lambda m: m.__setitem__("format", ["fast_llm"]), ("says format ['fast_llm']",)),
])
def test_metadata_top_level_is_type_checked(copy_of, edit, fragments):
    folder = copy_of("fast_llm")
    edit_yaml(folder / "metadata.yaml", edit)
    refused(folder, "fast_llm", *fragments)


@pytest.mark.parametrize("field, value, fragments", [
    ("distributed", [1], ("config.distributed should be a mapping", "a list [1]")),
    ("distributed.world_size", "1", ("config.distributed.world_size = '1'", "single-rank")),
    ("distributed.world_size", True, ("config.distributed.world_size = True",)),
])
def test_distributed_metadata_is_type_checked(copy_of, field, value, fragments):
    folder = copy_of("distributed")
    edit_yaml(folder / "metadata.yaml", lambda m: set_at(m["config"], field, value))
    refused(folder, "distributed", "metadata.yaml", *fragments)


@pytest.mark.parametrize("field, value, fragments", [
    ("num_hidden_layers", True, ("config.json: num_hidden_layers should be an integer >= 1", "a boolean True")),
    ("hidden_size", "64", ("config.json: hidden_size should be an integer", "a string '64'")),
    ("hidden_size", 64.0, ("config.json: hidden_size should be an integer", "a number 64.0")),
    ("layer_types", [1, 2, 3, 4], ("config.json: layer_types[0] should be a string", "an integer 1")),
    ("rope_parameters", [1, 2], ("config.json: rope_parameters should be a mapping", "a list [1, 2]")),
    ("dtype", 5, ("config.json: dtype should be a string", "an integer 5")),
    ("dtype", "banana", ("config.json: dtype should be the name of a torch dtype", "'banana'")),
    ("id2label", [], ("config.json: id2label should be a mapping",)),
])
def test_config_json_values_are_type_checked(copy_of, field, value, fragments):
    folder = copy_of("hf")
    edit_json(folder / "config.json", lambda c: c.__setitem__(field, value))
    refused(folder, "hf", *fragments)


def rewrite_header(path: Path, edit) -> None:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + length:])


@pytest.mark.parametrize("edit, fragments", [
    (lambda h: h["model.norm.weight"].__setitem__("shape", [True, 64]), ("has shape a list [True, 64]",)),
    (lambda h: h["model.norm.weight"].__setitem__("shape", [64.0]), ("has shape a list [64.0]",)),
    (lambda h: h["model.norm.weight"].__setitem__("dtype", 5), ("has dtype an integer 5",)),
    (lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0, "8"]), ("has data_offsets a list [0, '8']",)),
    (lambda h: h["model.norm.weight"].__setitem__("data_offsets", [False, 256]), ("data_offsets a list [False",)),
    (lambda h: h.__setitem__("__metadata__", {"format": 1}), ("__metadata__ should map names to strings",)),
    (lambda h: h.__setitem__("model.norm.weight", [1]), ("header entry of 'model.norm.weight' should be an object",)),
])
def test_safetensors_header_values_are_type_checked(copy_of, edit, fragments):
    folder = copy_of("hf")
    rewrite_header(folder / "model.safetensors", edit)
    refused(folder, "hf", "model.safetensors is not a valid safetensors file", *fragments)


@pytest.mark.parametrize("edit, fragments", [
    (lambda i: i.__setitem__("weight_map", ["a"]), ("weight_map should map tensor names to file names", "a list")),
    (lambda i: i["weight_map"].__setitem__("model.norm.weight", 3),
     ("weight_map['model.norm.weight'] should be a plain file name", "an integer 3")),
])
def test_index_values_are_type_checked(copy_of, edit, fragments):
    folder = copy_of("hf_sharded")
    edit_json(folder / "model.safetensors.index.json", edit)
    refused(folder, "hf", "model.safetensors.index.json", *fragments)


def test_duplicate_json_keys_are_refused(copy_of):
    folder = copy_of("hf")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace('"hidden_size": 64,', '"hidden_size": 64, "hidden_size": 32,'))
    refused(folder, "hf", "config.json: key 'hidden_size' appears twice")


# --------------------------------------------------------------------------------------------- 2. nesting


@pytest.mark.parametrize("text", [
    "config: " + "[" * 100_000,
    "config: " + "{a: " * 100_000,
    "".join(" " * i + "- \n" for i in range(0, 400, 2)) + " " * 400 + "x\n",  # block-style nesting
    "config:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(MAX_DEPTH + 5)),
])
def test_deep_yaml_is_refused(copy_of, text):
    folder = copy_of("fast_llm")
    (folder / "metadata.yaml").write_text(text)
    with bounded_work():
        message = refused(folder, "fast_llm", "metadata.yaml")
    assert "nests deeper than" in message or "not readable YAML" in message


@pytest.mark.parametrize("file, text", [
    ("config.json", "[" * 100_000),
    ("config.json", '{"a": ' * 100_000),
    ("config.json", '{"model_type": "hybrid_linear", "x": ' + "[" * 5000 + "]" * 5000 + "}"),
])
def test_deep_json_is_refused(copy_of, file, text):
    folder = copy_of("hf")
    (folder / file).write_text(text)
    with bounded_work():
        refused(folder, "hf", f"{file} nests deeper than {MAX_DEPTH} levels")


def test_deep_index_and_header_are_refused(copy_of):
    folder = copy_of("hf_sharded")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000)
    refused(folder, "hf", "model.safetensors.index.json nests deeper")
    folder = copy_of("hf")
    rewrite_header(folder / "model.safetensors", lambda h: h.__setitem__("__metadata__", {"x": "["}))
    blob = bytearray((folder / "model.safetensors").read_bytes())
    raw = b'{"a": ' + b"[" * 100_000
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(blob[8:]))
    refused(folder, "hf", "model.safetensors is not a valid safetensors file", "nests deeper")


def test_depth_limit_is_exact():
    for depth, accepted in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        json_text, yaml_text = "[" * depth + "]" * depth, "[" * depth + "]" * depth
        block_yaml = "".join("  " * i + f"k{i}:\n" for i in range(depth - 1)) + "  " * (depth - 1) + "k: 1\n"
        for parse, text in ((parse_json, json_text), (parse_yaml, yaml_text), (parse_yaml, block_yaml)):
            if accepted:
                parse(text, "x")
            else:
                with pytest.raises(ConversionError, match="nests deeper"):
                    parse(text, "x")


def test_brackets_inside_strings_are_not_nesting():
    deep_string = "[" * 10_000 + '\\"{'
    assert parse_json(json.dumps({"a": deep_string}), "x.json") == {"a": deep_string}
    assert parse_yaml(yaml.safe_dump({"a": deep_string}), "x.yaml") == {"a": deep_string}


# --------------------------------------------------------------------------------------------- 3. alias bombs


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_fails_fast_with_bounded_memory(copy_of):
    folder = copy_of("fast_llm")
    (folder / "metadata.yaml").write_text(billion_laughs())
    with bounded_work(megabytes=16):
        refused(folder, "fast_llm", "metadata.yaml expands to more than", "aliases")
    # Hidden inside a real metadata file (a key nobody reads would still be walked by a consumer).
    text = (FIXTURE / "fast_llm" / "metadata.yaml").read_text() + "bomb:\n" + "".join(
        "  " + line + "\n" for line in billion_laughs().splitlines())
    (folder / "metadata.yaml").write_text(text)
    with bounded_work(megabytes=16):
        refused(folder, "fast_llm", "expands to more than")


def test_yaml_merge_key_bomb_is_refused():
    text = "a: &a {x: 1, y: 2, z: 3}\n" + "".join(
        f"b{i}: &b{i}\n  <<: [" + ", ".join([f"*b{i - 1}" if i else "*a"] * 10) + "]\n" for i in range(8))
    with bounded_work(megabytes=16), pytest.raises(ConversionError, match="expands to more than"):
        parse_yaml(text, "m.yaml")


def test_legitimate_aliases_still_load(copy_of, tmp_path):
    """yaml.safe_dump writes anchors for a sub-config that appears twice: such a file converts like the plain one."""
    folder = copy_of("fast_llm")

    def share(metadata):
        blocks = metadata["config"]["base_model"]["decoder"]["blocks"]
        blocks["kda"]["mlp"] = blocks["gdn"]["mlp"] = blocks["attn"]["mlp"]  # the same object three times
    edit_yaml(folder / "metadata.yaml", share)
    assert "&id001" in (folder / "metadata.yaml").read_text() and "*id001" in (folder / "metadata.yaml").read_text()
    converted = convert_checkpoint(folder, tmp_path / "a", from_format="fast_llm", to_format="hf").destination
    plain = convert_checkpoint(FIXTURE / "fast_llm", tmp_path / "b", from_format="fast_llm", to_format="hf").destination
    assert (converted / "config.json").read_text() == (plain / "config.json").read_text()


# --------------------------------------------------------------------------------------------- 4. sizes


@pytest.mark.parametrize("key, value, fragments", [
    ("decoder.num_blocks", 1_000_000, ("decoder.num_blocks is 1000000 but the checkpoint holds tensors for 4 blocks",
                                       "(decoder.0 ... decoder.3)")),
    ("decoder.num_blocks", 10**12, ("decoder.num_blocks is 1000000000000 but",)),
    ("hidden_size", 10**12, ("config.base_model.hidden_size is 1000000000000, more than the 155332 weight elements",)),
    ("embeddings.vocab_size", 10**12, ("embeddings.vocab_size is 1000000000000",)),
    ("decoder.blocks.kda.mixer.head_dim", 10**12, ("blocks.kda.mixer.head_dim is 1000000000000",)),
    ("decoder.blocks.attn.mixer.heads", 100_000, ("model.layers.0.self_attn.q_proj.weight of shape",
                                                  "more than the 155332 weight elements")),
])
def test_fast_llm_sizes_checked_against_tensors(copy_of, key, value, fragments):
    folder = copy_of("fast_llm")
    edit_yaml(folder / "metadata.yaml", lambda m: set_at(m["config"]["base_model"], key, value))
    with bounded_work():
        refused(folder, "fast_llm", "metadata.yaml", *fragments)


def test_products_of_sizes_are_bounded_before_any_row_table(copy_of):
    """Each GDN size alone fits, their product would make a permutation table of ~10^8 rows: within the config's own
    bound on weights per layer (HybridLinearConfig refuses larger products itself), far past what the tensors hold."""
    folder = copy_of("fast_llm")
    edit_yaml(folder / "metadata.yaml", lambda m: m["config"]["base_model"]["decoder"]["blocks"]["gdn"][
        "mixer"].update(key_heads=5_000, value_heads=5_000, key_head_dim=5_000, value_head_dim=5_000))
    with bounded_work():
        refused(folder, "fast_llm", "linear_attn.in_proj_qkvz.weight of shape", "more than")


@pytest.mark.parametrize("value", [1_000_000, 10**12])
def test_distributed_block_count_bounded_by_the_buffer(copy_of, value):
    folder = copy_of("distributed")
    edit_yaml(folder / "metadata.yaml", lambda m: m["config"]["base_model"]["decoder"].__setitem__("num_blocks",
                                                                                                    value))
    with bounded_work():
        refused(folder, "distributed", f"decoder.num_blocks is {value}, more blocks than the 155360 weight elements")


def test_distributed_buffer_length_checked_before_the_stage_table(copy_of):
    folder = copy_of("distributed")
    edit_yaml(folder / "metadata.yaml", lambda m: m["config"]["base_model"]["decoder"].__setitem__("num_blocks",
                                                                                                    5000))
    # the config of the 5,000 blocks claimed is built (some 265k lines); its stage table would be 960k more
    with bounded_work(lines=400_000):
        refused(folder, "distributed", "weights_shard has shape [155360]", "implies [")


@pytest.mark.parametrize("field, value, fragments", [
    ("num_hidden_layers", 10**12, ("config.json: num_hidden_layers is 1000000000000 but the checkpoint holds",
                                   "tensors for 4 blocks (model.layers.0 ... model.layers.3)")),
    ("layer_types", ["gated_deltanet"] * 1_000_000, ("config.json: layer_types lists 1000000 layers but",)),
    ("hidden_size", 10**12, ("config.json: hidden_size is 1000000000000, more than",)),
    ("head_dim", 10**6, ("config.json: head_dim is 1000000, more than the 155332 weight elements",)),
    ("num_attention_heads", 100_000, ("model.layers.0.self_attn.q_proj.weight of shape [1600000, 64]",)),
])
def test_hf_sizes_checked_against_tensors(copy_of, field, value, fragments):
    folder = copy_of("hf")
    edit_json(folder / "config.json", lambda c: c.update({field: value, "num_key_value_heads": 1}))
    # the 1M-entry layer_types list is read and checked entry by entry: work linear in the entries the file holds
    entries = len(value) if isinstance(value, list) else 0
    with bounded_work(lines=100_000 + 4 * entries, megabytes=256):
        refused(folder, "hf", *fragments)


def write_raw_safetensors(path: Path, header_length: int, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", header_length) + header + data)


def test_safetensors_header_length_is_bounded(tmp_path):
    path = tmp_path / "x.safetensors"
    write_raw_safetensors(path, 2**63, b"{}")
    with bounded_work(), pytest.raises(ConversionError, match="more than the 104857600 a safetensors header may have"):
        SafetensorsFile(path)
    write_raw_safetensors(path, 1000, b"{}")
    with pytest.raises(ConversionError, match="header length field says 1000 bytes but the file has 10 bytes"):
        SafetensorsFile(path)


def test_safetensors_offsets_stay_inside_the_file(tmp_path):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}).encode()
    write_raw_safetensors(path, len(header), header, bytes(8))
    with bounded_work(), pytest.raises(ConversionError, match="ends at data offset 4398046511104, past the end"):
        SafetensorsFile(path)


@pytest.mark.parametrize("name", ["../model.safetensors", "/etc/passwd", "sub/model.safetensors", "..", "",
                                  "a\\b.safetensors"])
def test_index_names_only_files_inside_the_folder(copy_of, tmp_path, name):
    folder = copy_of("hf_sharded")
    shutil.copy(folder / "model-00001-of-00007.safetensors", tmp_path / "model.safetensors")  # a real file outside
    edit_json(folder / "model.safetensors.index.json", lambda i: i["weight_map"].__setitem__("model.norm.weight",
                                                                                             name))
    refused(folder, "hf", "weight_map['model.norm.weight'] should be a plain file name inside the checkpoint folder")


def test_state_index_names_only_files_inside_the_folder(copy_of):
    folder = copy_of("fast_llm")
    edit_yaml(folder / "metadata.yaml", lambda m: m["metadata"]["state_index"].__setitem__(
        "decoder.0.norm_1.weight/weights", "../fast_llm/model_0.safetensors"))
    refused(folder, "fast_llm", "metadata.state_index['decoder.0.norm_1.weight/weights'] should be a plain file name")


def test_oversized_text_files_are_refused_before_reading(copy_of, monkeypatch):
    monkeypatch.setattr(untrusted, "MAX_TEXT_BYTES", 1000)
    refused(copy_of("fast_llm"), "fast_llm", "metadata.yaml has", "bytes, more than the 1000")
    refused(copy_of("hf"), "hf", "config.json has", "bytes, more than the 1000")


def test_overlong_file_names_in_an_index_are_refused(copy_of):
    folder = copy_of("hf_sharded")
    edit_json(folder / "model.safetensors.index.json",
              lambda i: i["weight_map"].__setitem__("model.norm.weight", "m" * 100_000 + ".safetensors"))
    message = refused(folder, "hf", "should be a plain file name")
    assert len(message) < 600


# --------------------------------------------------------------------------------------------- 5. dtypes


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_non_floating_weights_are_refused_in_every_reader(copy_of, dtype):
    folder = copy_of("fast_llm")
    tensors = load_file(folder / "model_0.safetensors")
    tensors["decoder.0.norm_1.weight/weights"] = tensors["decoder.0.norm_1.weight/weights"].to(dtype)
    save_file(tensors, folder / "model_0.safetensors")
    name = str(dtype).removeprefix("torch.")
    refused(folder, "fast_llm", f"tensor 'decoder.0.norm_1.weight/weights' has dtype {name}", "floating point")

    folder = copy_of("hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    refused(folder, "hf", f"tensor 'model.norm.weight' has dtype {name}")

    folder = copy_of("distributed")
    buffer = load_file(folder / "rank_0.safetensors")["weights_shard"]
    save_file({"weights_shard": buffer.to(dtype)}, folder / "rank_0.safetensors")
    refused(folder, "distributed", f"has dtype {name}", "floating point")


# --------------------------------------------------------------------------------------------- 6. bounded messages


def test_brief_bounds_any_value():
    assert brief("x" * 10**6).startswith("'xxx") and len(brief("x" * 10**6)) <= 100
    assert brief(10**5000) == "<integer of about 5000 digits>"
    nested: list = []
    for _ in range(10_000):
        nested = [nested] * 3
    assert len(brief(nested)) <= 100  # shared structure of 3^10000 leaves: never walked
    assert len(brief({str(i): i for i in range(10**5)})) <= 100
    assert describe(True) == "a boolean True" and describe(None) == "null" and describe(2.0) == "a number 2.0"
    clipped = clip("a\nb" * 1000, 50)
    assert "\n" not in clipped and len(clipped) <= 50 and clipped.startswith("a\\nb") and "..." in clipped


def test_huge_user_values_are_cut_in_messages(copy_of):
    folder = copy_of("fast_llm")
    edit_yaml(folder / "metadata.yaml", lambda m: m["config"]["base_model"]["decoder"]["blocks"]["gdn"][
        "mixer"].__setitem__("type", "mamba" * 100_000))
    message = refused(folder, "fast_llm", "blocks.gdn.mixer.type = 'mambamamba", "...")
    assert len(message) < 400
    folder = copy_of("fast_llm")

    def rename_block(metadata):
        decoder = metadata["config"]["base_model"]["decoder"]
        decoder["blocks"]["b" * 100_000] = decoder["blocks"].pop("kda")
        decoder["blocks"]["b" * 100_000]["mixer"]["surprise"] = 1
        decoder["pattern"] = ["b" * 100_000 if name == "kda" else name for name in decoder["pattern"]]
    edit_yaml(folder / "metadata.yaml", rename_block)
    message = refused(folder, "fast_llm", "config.base_model.decoder.blocks.bbbb", "not supported")
    assert len(message) < 600
    folder = copy_of("hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["x\n" * 100_000] = torch.zeros(1)
    save_file(tensors, folder / "model.safetensors")
    message = refused(folder, "hf", "does not account for")
    assert len(message) < 800


# --------------------------------------------------------------------------------------------- 7. read-back


@st.composite
def _fast_llm_overrides(draw, layer_types: list[str], eps) -> dict[int, dict]:
    """Per-layer settings a Fast-LLM block can carry: some layers differ from the defaults."""
    overrides = {}
    for index, layer_type in enumerate(layer_types):
        if not draw(st.booleans()):
            continue
        fields = {"intermediate_size": draw(st.integers(4, 96)), "rms_norm_eps": draw(eps),
                  "mlp_bias": draw(st.booleans()),
                  "hidden_act": draw(st.sampled_from(["silu", "gelu_pytorch_tanh", "relu", "relu2"]))}
        if layer_type in ("full_attention", "sliding_attention"):
            kv = draw(st.integers(1, 3))
            fields.update(num_key_value_heads=kv, num_attention_heads=kv * draw(st.integers(1, 3)),
                          head_dim=draw(st.sampled_from([4, 8])), attention_bias=draw(st.booleans()),
                          rope_parameters={"rope_type": "default", "rope_theta": draw(st.floats(1.0, 1e7)),
                                           "partial_rotary_factor": 1.0})
            if layer_type == "sliding_attention":
                fields["sliding_window"] = draw(st.integers(1, 100))
        elif layer_type == "gated_deltanet":
            keys = draw(st.integers(1, 3))
            fields.update(gdn_num_key_heads=keys, gdn_num_value_heads=keys * draw(st.integers(1, 2)),
                          gdn_value_head_dim=draw(st.integers(1, 16)), gdn_conv_kernel_size=draw(st.integers(1, 6)),
                          gdn_norm_eps=draw(eps), gdn_gate_activation=draw(st.sampled_from(["silu", "sigmoid"])))
        else:
            fields.update(kda_num_heads=draw(st.integers(1, 4)), kda_head_dim=draw(st.integers(1, 16)),
                          kda_norm_eps=draw(eps))
        overrides[index] = fields
    return overrides


def configs(fast_llm: bool) -> st.SearchStrategy[HybridLinearConfig]:
    """Small valid configs; with `fast_llm`, only what Fast-LLM's metadata can express."""
    @st.composite
    def build(draw):
        layer_types = draw(st.lists(st.sampled_from(["full_attention", "sliding_attention", "gated_deltanet",
                                                     "kimi_delta_attention"]), min_size=1, max_size=5))
        eps = st.one_of(st.sampled_from([1e-5, 1e-6]), st.floats(1e-9, 1e-2))
        kv_heads, gdn_keys = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        kwargs = {
            "layer_types": layer_types, "vocab_size": draw(st.integers(8, 512)),
            "hidden_size": draw(st.integers(4, 64)), "intermediate_size": draw(st.integers(4, 96)),
            "num_key_value_heads": kv_heads, "num_attention_heads": kv_heads * draw(st.integers(1, 3)),
            "head_dim": draw(st.sampled_from([4, 8, 16])), "gdn_num_key_heads": gdn_keys,
            "gdn_num_value_heads": gdn_keys * draw(st.integers(1, 3)), "gdn_key_head_dim": draw(st.integers(1, 16)),
            "gdn_value_head_dim": draw(st.integers(1, 16)), "gdn_conv_kernel_size": draw(st.integers(1, 6)),
            "kda_num_heads": draw(st.integers(1, 4)), "kda_head_dim": draw(st.integers(1, 16)),
            "kda_conv_kernel_size": draw(st.integers(1, 6)), "rms_norm_eps": draw(eps), "gdn_norm_eps": draw(eps),
            "kda_norm_eps": draw(eps), "gdn_gate_activation": draw(st.sampled_from(["silu", "sigmoid"])),
            "kda_gate_activation": draw(st.sampled_from(["silu", "sigmoid"])),
            "tie_word_embeddings": draw(st.booleans()),
            "sliding_window": draw(st.integers(1, 10**6)) if "sliding_attention" in layer_types else None,
            "rope_parameters": {"rope_type": "default", "rope_theta": draw(st.floats(1.0, 1e7)),
                                "partial_rotary_factor": 1.0},
        }
        if fast_llm:
            kwargs.update(zero_centered_norms=False, attention_output_gate=False, attention_qk_norm=False)
            kwargs["per_layer_config"] = draw(_fast_llm_overrides(layer_types, eps))
        else:
            kwargs.update(zero_centered_norms=draw(st.booleans()), attention_output_gate=draw(st.booleans()),
                          attention_qk_norm=draw(st.booleans()), bos_token_id=draw(st.none() | st.integers(0, 7)),
                          max_position_embeddings=draw(st.integers(1, 10**6)))
        return HybridLinearConfig(**kwargs)
    return build()


@FUZZ_SETTINGS
@given(config=configs(fast_llm=False), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_hf_config_written_reads_back_equal(config, dtype):
    exported = export_config(config, dtype)
    check_config_reads_back(exported, exported.to_json_string(use_diff=False))


@FUZZ_SETTINGS
@given(config=configs(fast_llm=True))
def test_fast_llm_metadata_written_reads_back_equal(config):
    check_metadata_reads_back(config, metadata_yaml(config, {"a/weights": "model_0.safetensors"}))


def test_a_field_that_does_not_survive_is_refused_before_writing(tmp_path):
    """A rope parameter Fast-LLM has no place for: hf -> fast_llm would silently drop it."""
    try:
        config = HybridLinearConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                    layer_types=["full_attention"], num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=8, zero_centered_norms=False, attention_output_gate=False,
                                    attention_qk_norm=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                              "partial_rotary_factor": 1.0,
                                                                              "factor": 2.0})
    except ValueError:
        pytest.skip("HybridLinearConfig refuses extra rope parameters itself")
    src = write_random_checkpoint(tmp_path / "hf", config, "hf")
    with pytest.raises(ConversionError, match=r"refusing to write metadata.yaml: the config field rope_parameters"):
        convert_checkpoint(src, tmp_path / "dst", from_format="hf", to_format="fast_llm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written, no staging folder left


def test_a_writer_whose_config_would_not_read_back_writes_nothing(tmp_path, monkeypatch):
    def wrong_metadata(config, state_index):
        return metadata_yaml(config, state_index).replace("hidden_size: 64", "hidden_size: 32")
    monkeypatch.setattr(fast_llm_checkpoint, "metadata_yaml", wrong_metadata)
    with pytest.raises(ConversionError, match=r"refusing to write metadata.yaml: the config field hidden_size \(64 "
                                              r"reads back as 32\)"):
        convert_checkpoint(FIXTURE / "fast_llm", tmp_path / "dst", from_format="fast_llm", to_format="fast_llm")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(fast_llm_checkpoint, "metadata_yaml", lambda config, state_index: "config: [")
    with pytest.raises(ConversionError, match=r"refusing to write metadata.yaml: it would not read back"):
        convert_checkpoint(FIXTURE / "fast_llm", tmp_path / "dst", from_format="fast_llm", to_format="fast_llm")
    exported = export_config(HybridLinearConfig(layer_types=["full_attention"], head_dim=16), torch.float32)
    text = exported.to_json_string(use_diff=False).replace('"head_dim": 16', '"head_dim": 8')
    with pytest.raises(ConversionError, match=r"refusing to write config.json: the config field head_dim \(16 reads "
                                              r"back as 8\)"):
        check_config_reads_back(exported, text)

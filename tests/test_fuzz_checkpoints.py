"""Property-based fuzzing of the checkpoint readers: mutated metadata.yaml (fast_llm and distributed), config.json,
safetensors headers and index files, and raw text. Property: reading and planning the conversion either succeeds
or raises ConversionError, within the deadline (FUZZ_SETTINGS); never any other exception.

Each test writes its one mutated file into a folder copied once per module, so an example costs a read, not a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conversion_helpers import FuzzFolder as Folder
from conversion_helpers import Reading
from fast_llm_layout import PATTERN, heterogeneous_blocks, pattern_decoder, write_fast_llm_checkpoint
from fuzz_strategies import FUZZ_SETTINGS, hostile_values, mutated, safetensors_file, split_safetensors
from hypothesis import given
from hypothesis import strategies as st

from hybrid_linear_models.conversion import convert_checkpoint

MESSAGES: list[str] = []  # for a look at what the fuzzer reached: pytest -s
FIXTURE = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda"


def outcome(folder: Path, from_format: str) -> str:
    return Reading(from_format).outcome(folder, MESSAGES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Folder]:
    root = tmp_path_factory.mktemp("fuzz")
    result = {name: Path(shutil.copytree(FIXTURE / name, root / name)) for name in ("fast_llm", "distributed")}
    result["hf"] = convert_checkpoint(FIXTURE / "fast_llm", root / "hf", from_format="fast_llm",
                                      to_format="hf").destination
    result["hf_sharded"] = convert_checkpoint(FIXTURE / "fast_llm", root / "hf_sharded", from_format="fast_llm",
                                              to_format="hf", max_shard_size="100KB").destination
    # a pattern decoder whose blocks differ, as Fast-LLM lays it out, and its HF conversion
    blocks = heterogeneous_blocks()
    write_fast_llm_checkpoint(root / "hetero", blocks, PATTERN, pattern_decoder(blocks, PATTERN))
    result["hetero_fast_llm"] = root / "hetero" / "fast_llm"
    result["hetero_distributed"] = root / "hetero" / "distributed"
    result["hetero_hf"] = convert_checkpoint(result["hetero_fast_llm"], root / "hetero_hf", from_format="fast_llm",
                                             to_format="hf").destination
    return {name: Folder(path) for name, path in result.items()}


def test_the_unmutated_folders_read(folders):
    assert (folders["hf_sharded"].path / "model.safetensors.index.json").is_file()
    for name, from_format in (("fast_llm", "fast_llm"), ("distributed", "fast_llm_distributed"), ("hf", "hf"),
                              ("hf_sharded", "hf"), ("hetero_fast_llm", "fast_llm"),
                              ("hetero_distributed", "fast_llm_distributed"), ("hetero_hf", "hf")):
        assert outcome(folders[name].path, from_format) == "read"


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_fast_llm_metadata(folders, data):
    folder = folders["fast_llm"]
    metadata = data.draw(mutated(yaml.safe_load(folder.original("metadata.yaml"))))
    outcome(folder.with_file("metadata.yaml", yaml.safe_dump(metadata)), "fast_llm")


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_distributed_metadata(folders, data):
    folder = folders["distributed"]
    metadata = data.draw(mutated(yaml.safe_load(folder.original("metadata.yaml"))))
    outcome(folder.with_file("metadata.yaml", yaml.safe_dump(metadata)), "fast_llm_distributed")


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_config_json(folders, data):
    folder = folders["hf"]
    config = data.draw(mutated(json.loads(folder.original("config.json"))))
    outcome(folder.with_file("config.json", json.dumps(config)), "hf")


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_safetensors_header(folders, data):
    folder = folders["hf"]
    header, tensor_data = split_safetensors(folder.original("model.safetensors"))
    blob = data.draw(safetensors_file(data.draw(mutated(header)), tensor_data))
    outcome(folder.with_file("model.safetensors", blob), "hf")


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_index_file(folders, data):
    folder = folders["hf_sharded"]
    index = data.draw(mutated(json.loads(folder.original("model.safetensors.index.json"))))
    outcome(folder.with_file("model.safetensors.index.json", json.dumps(index)), "hf")


@FUZZ_SETTINGS
@given(text=st.one_of(st.text(max_size=200), st.text(alphabet="[]{}:,-&*! \n\"'ab01", max_size=400)),
       value=hostile_values())
def test_fuzz_raw_text(folders, text, value):
    """Arbitrary text (and arbitrary documents) as metadata.yaml and as config.json."""
    for content in (text, yaml.safe_dump(value)):
        outcome(folders["fast_llm"].with_file("metadata.yaml", content), "fast_llm")
    for content in (text, json.dumps(value)):
        outcome(folders["hf"].with_file("config.json", content), "hf")


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_heterogeneous_metadata(folders, data):
    """Blocks that differ: mutations of one block's settings, of the pattern and of the block names."""
    for name, from_format in (("hetero_fast_llm", "fast_llm"), ("hetero_distributed", "fast_llm_distributed")):
        folder = folders[name]
        metadata = data.draw(mutated(yaml.safe_load(folder.original("metadata.yaml"))))
        outcome(folder.with_file("metadata.yaml", yaml.safe_dump(metadata)), from_format)


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_heterogeneous_config_json(folders, data):
    """A config.json with per_layer_config: mutations reach the overrides too."""
    folder = folders["hetero_hf"]
    config = json.loads(folder.original("config.json"))
    assert config["per_layer_config"]  # the folder is heterogeneous
    outcome(folder.with_file("config.json", json.dumps(data.draw(mutated(config)))), "hf")

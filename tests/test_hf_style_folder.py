"""The steps every HF-style folder format shares (`conversion/hf_style_folder.py`), checked once per format: the same
folder checks and messages (with the format's name), a tensor stored twice refused wherever the second copy is, and
the writer's read-back check run before any file exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conversion_helpers import FAST_LLM_FIXTURES
from safetensors.torch import load_file, save_file

from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.formats import get_format
from hybrid_linear_models.conversion.hf_style_folder import write_hf_style_folder
from hybrid_linear_models.conversion.pipeline import WriteOptions, plan_conversion

FAST_LLM_FOLDER = FAST_LLM_FIXTURES / "hybrid_attn_gdn_kda" / "fast_llm"
APRIEL2_FOLDER = FAST_LLM_FIXTURES / "hybrid_attn_gdn_kda" / "apriel2_text"
HF_STYLE_FORMATS = [("hf", "a Hugging Face checkpoint"), ("apriel2", "an Apriel2 checkpoint"),
                    ("fla", "an fla checkpoint"), ("qwen3_next", "a Qwen3-Next checkpoint"),
                    ("kimi_linear", "a Kimi-Linear checkpoint")]


def refusal(fmt: str, folder: Path) -> str:
    with pytest.raises(ConversionError) as caught:
        get_format(fmt, "read").read(folder)
    return str(caught.value)


@pytest.mark.parametrize("fmt, checkpoint", HF_STYLE_FORMATS)
def test_every_hf_style_reader_refuses_a_file_and_names_a_fast_llm_folder(tmp_path, fmt, checkpoint):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    assert refusal(fmt, file) == f"SRC {file} is not a folder; {checkpoint} is a folder with config.json."
    assert refusal(fmt, FAST_LLM_FOLDER) == (
        f"SRC {FAST_LLM_FOLDER} is not {checkpoint}: it has no config.json. It contains metadata.yaml: if it is a "
        "Fast-LLM checkpoint, use --from fast_llm.")


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory) -> Path:
    return convert_checkpoint(FAST_LLM_FOLDER, tmp_path_factory.mktemp("hf") / "sharded", from_format="fast_llm",
                              to_format="hf", max_shard_size="100KB").destination


def test_a_tensor_in_two_shards_is_refused_naming_both(sharded_hf, tmp_path):
    folder = Path(shutil.copytree(sharded_hf, tmp_path / "hf"))
    first, second = sorted(folder.glob("model-*.safetensors"))[:2]
    name = next(iter(load_file(first)))
    tensors = load_file(second)
    save_file({**tensors, name: load_file(first)[name]}, second, metadata={"format": "pt"})
    assert refusal("hf", folder) == (f"tensor {name} is stored twice, in {first.name} and {second.name}; the "
                                     "checkpoint is corrupt.")


def test_a_tensor_in_the_shards_and_the_extra_file_is_refused(sharded_hf, tmp_path):
    folder = Path(shutil.copytree(sharded_hf, tmp_path / "hf"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name, shard = sorted(index["weight_map"].items())[0]
    save_file({name: load_file(folder / shard)[name]}, folder / "extra_tensors.safetensors",
              metadata={"carried_from": "qwen3_next", "carried_fields": "{}"})
    assert refusal("hf", folder) == (f"tensor {name} is stored twice, in {shard} and extra_tensors.safetensors; the "
                                     "carried extra_tensors.safetensors is stale (a model with these tensors of its "
                                     "own was saved beside it): remove extra_tensors.safetensors.")


def test_the_writer_checks_the_read_back_before_writing_anything(tmp_path):
    source = get_format("apriel2", "read").read(APRIEL2_FOLDER)
    plan = plan_conversion(source, get_format("hf", "write").target_rows(source.config))
    seen = []

    def refuse(text: str) -> None:
        seen.append(text)
        raise ConversionError("refusing to write config.json: it would not read back")

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError, match="would not read back"):
        write_hf_style_folder(out, plan, iter(()), WriteOptions(max_shard_bytes=10**9), '{"x": 1}', reads_back=refuse)
    assert seen == ['{"x": 1}'] and list(out.iterdir()) == []

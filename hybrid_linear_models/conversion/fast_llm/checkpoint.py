"""Fast-LLM's `fast_llm` checkpoint format: `metadata.yaml` + `model_{n}.safetensors`, tensors named
`{parameter name}/{state shard}`; the model weights are the `weights` shard (other shards are optimizer state and
are not converted)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from ...configuration_hybrid_linear import HybridLinearConfig
from ..errors import ConversionError
from ..name_maps import MapRow
from ..pipeline import (
    ConversionPlan,
    SourceCheckpoint,
    TensorCensus,
    WriteOptions,
    check_tensor_sizes,
    config_difference,
)
from ..read_back import check_reads_back, layer_difference
from ..safetensors_io import SafetensorsFile, SafetensorsTensors, plan_files, write_files
from ..source_files import is_source_file
from ..untrusted import (
    Fields,
    brief,
    clip,
    describe,
    parse_yaml,
    plain_file_name,
    read_text,
)
from .config import (
    FAST_LLM_VERSION,
    fast_llm_carried_fields,
    fast_llm_carried_layer_fields,
    fast_llm_to_hybrid_config,
    hybrid_config_to_fast_llm,
)
from .parameters import build_fast_llm_rows

METADATA_FILE = "metadata.yaml"
WEIGHTS_SHARD = "weights"
_READER_OF_FORMAT = {"fast_llm": "fast_llm", "distributed": "fast_llm_distributed"}  # metadata `format` -> --from
_OTHER_CHECKPOINT_FILES = {  # marker file -> the --from value that reads such a folder
    "config.json": "hf",
    "rank_0.safetensors": "fast_llm_distributed",
}


def _hint_other_format(path: Path) -> str:
    for marker, name in _OTHER_CHECKPOINT_FILES.items():
        if (path / marker).exists():
            return f" It contains {marker}: if it is a {name} checkpoint, use --from {name}."
    return ""


def load_metadata(path: Path, expected_format: str, reader_name: str) -> dict[str, Any]:
    """Reads and checks metadata.yaml of a Fast-LLM checkpoint folder (shared with the distributed reader)."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; a Fast-LLM checkpoint is a folder with {METADATA_FILE}.")
    metadata_path = path / METADATA_FILE
    if not is_source_file(metadata_path):
        raise ConversionError(f"SRC {path} is not a Fast-LLM checkpoint: it has no {METADATA_FILE}."
                              + _hint_other_format(path))
    metadata = parse_yaml(read_text(metadata_path), str(metadata_path))
    if not isinstance(metadata, dict) or not isinstance(metadata.get("config"), dict) or not isinstance(
            metadata["config"].get("base_model"), dict):
        raise ConversionError(f"{metadata_path} has no `config.base_model` mapping; it is not the metadata of a "
                              "Fast-LLM checkpoint (or it is corrupt).")
    top = Fields(metadata, "", str(metadata_path))
    found = top.get("format")
    if found != expected_format:
        hint = _READER_OF_FORMAT.get(found) if isinstance(found, str) else None
        raise ConversionError(f"{metadata_path} says format {brief(found)}, but --from {reader_name} reads "
                              f"{expected_format!r} checkpoints" + (f"; use --from {hint}." if hint else "."))
    top.name("model", ("gpt",), "gpt")
    shards = top.sequence("shards", [WEIGHTS_SHARD], item=str)
    if WEIGHTS_SHARD not in shards:
        raise ConversionError(f"{metadata_path}: `shards` is {brief(shards)}; it must list the '{WEIGHTS_SHARD}' "
                              "shard.")
    return metadata


def _weights_hint(keys: Iterable[str], output_key: str) -> str:
    present = output_key in set(keys)
    return f" (this checkpoint {'has' if present else 'has no'} {output_key}, so probably {str(not present).lower()})"


def _state_index(path: Path, metadata: dict[str, Any]) -> dict[str, str] | None:
    """metadata.state_index: tensor name -> a file name inside the folder (never a path out of it)."""
    label = str(path / METADATA_FILE)
    state_index = Fields(metadata, "", label).mapping("metadata").get("state_index")
    if state_index is None:
        return None
    if not isinstance(state_index, dict):
        raise ConversionError(f"{label}: metadata.state_index should map tensor names to file names, got "
                              f"{describe(state_index)}.")
    for key, name in state_index.items():
        if not isinstance(key, str):
            raise ConversionError(f"{label}: metadata.state_index has the key {describe(key)}; tensor names are "
                                  "strings.")
        plain_file_name(name, f"{label}: metadata.state_index[{brief(key)}]")
    return state_index


def read_fast_llm(path: Path) -> SourceCheckpoint:
    path = Path(path)
    metadata = load_metadata(path, "fast_llm", "fast_llm")
    state_index = _state_index(path, metadata)
    if state_index is None:
        file_names = sorted(p.name for p in path.glob("model_*.safetensors"))
    else:
        file_names = sorted(set(state_index.values()))
    if not file_names:
        raise ConversionError(f"SRC {path} has {METADATA_FILE} but no model_*.safetensors files; the checkpoint is "
                              "incomplete.")
    files: dict[str, SafetensorsFile] = {}
    for name in file_names:
        file_path = path / name
        if not is_source_file(file_path):
            raise ConversionError(f"{path / METADATA_FILE} lists {clip(name, 100)}, which is missing from {path}; the "
                                  "checkpoint is incomplete.")
        opened = SafetensorsFile(file_path)
        for key in opened.keys():
            if key in files:
                raise ConversionError(f"tensor {clip(key, 100)} is stored twice, in {files[key].path.name} and {name}; "
                                      "the checkpoint is corrupt.")
            files[key] = opened
    if state_index is not None:
        for key, name in state_index.items():
            if key not in files or files[key].path.name != name:
                raise ConversionError(f"{path / METADATA_FILE} says {name} holds {clip(key, 100)}, but it does not; "
                                      "the checkpoint is incomplete or corrupt.")
    other_shards = set(metadata.get("shards", [])) - {WEIGHTS_SHARD}
    skipped = [key for key in files if key.rpartition("/")[2] in other_shards and "/" in key]
    for key in skipped:
        del files[key]
    suffix = "/" + WEIGHTS_SHARD
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()), "decoder.")
    config = fast_llm_to_hybrid_config(metadata["config"]["base_model"],
                                       _weights_hint(files, "head.output_weights" + suffix), census)
    check_tensor_sizes(config, census, str(path / METADATA_FILE))
    return SourceCheckpoint("fast_llm", path, config, SafetensorsTensors(files), fast_llm_rows(config), skipped)


def fast_llm_rows(config: HybridLinearConfig) -> list[MapRow]:
    """Rows over stored keys (`{parameter}/weights`); raises if Fast-LLM cannot express `config`."""
    hybrid_config_to_fast_llm(config)
    return [MapRow(tuple(f"{k}/{WEIGHTS_SHARD}" for k in row.format_keys), row.converter, row.canonical_keys)
            for row in build_fast_llm_rows(config)]


def _metadata(config: HybridLinearConfig, state_index: dict[str, str] | None) -> dict[str, Any]:
    return {
        "config": {"base_model": hybrid_config_to_fast_llm(config), "type": "gpt"},
        "fast_llm_version": FAST_LLM_VERSION,
        "format": "fast_llm",
        "metadata": {"state_index": state_index} if state_index is not None else {},
        "model": "gpt",
        "shards": [WEIGHTS_SHARD],
    }


def metadata_yaml(config: HybridLinearConfig, state_index: dict[str, str] | None) -> str:
    """The text of the metadata.yaml the writer writes for `config`."""
    return yaml.safe_dump(_metadata(config, state_index))


def write_fast_llm(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                   options: WriteOptions) -> None:
    config = plan.source.config
    files = plan_files(plan.targets, options.max_shard_bytes, lambda index, count: f"model_{index}.safetensors")
    state_index = {name: file.name for file in files for name, _ in file.tensors}
    metadata_text = metadata_yaml(config, state_index)
    check_metadata_reads_back(config, metadata_text)  # before any file is written
    # Fast-LLM repeats its metadata (as YAML strings, without the state index) in each safetensors header.
    header = {key: value if isinstance(value, str) else yaml.safe_dump(value)
              for key, value in _metadata(config, None).items()}
    write_files(out_dir, files, tensors, header)
    (out_dir / METADATA_FILE).write_text(metadata_text, encoding="utf-8")


def _read_metadata(text: str) -> HybridLinearConfig:
    return fast_llm_to_hybrid_config(parse_yaml(text, METADATA_FILE)["config"]["base_model"])


def _difference(expected: HybridLinearConfig, got: HybridLinearConfig) -> str | None:
    return (config_difference(expected, got, fast_llm_carried_fields(expected))
            or layer_difference(expected, got, fast_llm_carried_layer_fields))


def check_metadata_reads_back(config: HybridLinearConfig, metadata_text: str) -> None:
    """The metadata.yaml about to be written, read back through the reader's own code, must give `config` again in
    every field Fast-LLM's metadata carries; otherwise the converter would write a checkpoint it cannot read, or one
    that reads as another model."""
    check_reads_back(config, metadata_text, file=METADATA_FILE, read=_read_metadata, difference=_difference,
                     does_not_survive="Fast-LLM's metadata, so the written checkpoint would describe another model; "
                     "convert to the hf format instead, or fix the field.")


__all__ = ["read_fast_llm", "write_fast_llm", "fast_llm_rows", "load_metadata", "check_metadata_reads_back",
           "metadata_yaml", "METADATA_FILE"]

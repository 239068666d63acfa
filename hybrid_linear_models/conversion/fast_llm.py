"""Fast-LLM's `fast_llm` checkpoint format: `metadata.yaml` + `model_{n}.safetensors`, tensors named
`{parameter name}/{state shard}`; the model weights are the `weights` shard (other shards are optimizer state and
are not converted)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from ..configuration_hybrid_linear import HybridLinearConfig
from .config_maps import FAST_LLM_VERSION, fast_llm_to_hybrid_config, hybrid_config_to_fast_llm
from .errors import ConversionError
from .name_maps import MapRow, build_fast_llm_rows
from .pipeline import ConversionPlan, SourceCheckpoint, WriteOptions
from .safetensors_io import SafetensorsFile, SafetensorsTensors, plan_files, write_files

METADATA_FILE = "metadata.yaml"
WEIGHTS_SHARD = "weights"
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
    if not metadata_path.is_file():
        raise ConversionError(f"SRC {path} is not a Fast-LLM checkpoint: it has no {METADATA_FILE}."
                              + _hint_other_format(path))
    try:
        metadata = yaml.safe_load(metadata_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConversionError(f"{metadata_path} is not readable YAML ({detail}); the file is corrupt, restore it "
                              "from the original checkpoint.") from None
    except OSError as error:
        raise ConversionError(f"cannot read {metadata_path}: {error}") from error
    if not isinstance(metadata, dict) or not isinstance(metadata.get("config"), dict) or not isinstance(
            metadata["config"].get("base_model"), dict):
        raise ConversionError(f"{metadata_path} has no `config.base_model` mapping; it is not the metadata of a "
                              "Fast-LLM checkpoint (or it is corrupt).")
    found = metadata.get("format")
    if found != expected_format:
        hint = {"fast_llm": "fast_llm", "distributed": "fast_llm_distributed"}.get(found)
        raise ConversionError(f"{metadata_path} says format {found!r}, but --from {reader_name} reads "
                              f"{expected_format!r} checkpoints" + (f"; use --from {hint}." if hint else "."))
    if metadata.get("model", "gpt") != "gpt":
        raise ConversionError(f"{metadata_path}: model {metadata.get('model')!r} is not supported; only Fast-LLM "
                              "'gpt' models convert.")
    shards = metadata.get("shards", [WEIGHTS_SHARD])
    if not isinstance(shards, list) or WEIGHTS_SHARD not in shards:
        raise ConversionError(f"{metadata_path}: `shards` is {shards!r}; it must list the '{WEIGHTS_SHARD}' shard.")
    return metadata


def _weights_hint(keys: Iterable[str], output_key: str) -> str:
    present = output_key in set(keys)
    return f" (this checkpoint {'has' if present else 'has no'} {output_key}, so probably {str(not present).lower()})"


def read_fast_llm(path: Path) -> SourceCheckpoint:
    path = Path(path)
    metadata = load_metadata(path, "fast_llm", "fast_llm")
    state_index = (metadata.get("metadata") or {}).get("state_index")
    if state_index is None:
        file_names = sorted(p.name for p in path.glob("model_*.safetensors"))
    elif isinstance(state_index, dict):
        file_names = sorted(set(state_index.values()))
    else:
        raise ConversionError(f"{path / METADATA_FILE}: metadata.state_index should map tensor names to files.")
    if not file_names:
        raise ConversionError(f"SRC {path} has {METADATA_FILE} but no model_*.safetensors files; the checkpoint is "
                              "incomplete.")
    files: dict[str, SafetensorsFile] = {}
    for name in file_names:
        file_path = path / name
        if not file_path.is_file():
            raise ConversionError(f"{path / METADATA_FILE} lists {name}, which is missing from {path}; the checkpoint "
                                  "is incomplete.")
        opened = SafetensorsFile(file_path)
        for key in opened.keys():
            if key in files:
                raise ConversionError(f"tensor {key} is stored twice, in {files[key].path.name} and {name}; the "
                                      "checkpoint is corrupt.")
            files[key] = opened
    if state_index is not None:
        for key, name in state_index.items():
            if key not in files or files[key].path.name != name:
                raise ConversionError(f"{path / METADATA_FILE} says {name} holds {key}, but it does not; the "
                                      "checkpoint is incomplete or corrupt.")
    other_shards = set(metadata.get("shards", [])) - {WEIGHTS_SHARD}
    skipped = [key for key in files if key.rpartition("/")[2] in other_shards and "/" in key]
    for key in skipped:
        del files[key]
    suffix = "/" + WEIGHTS_SHARD
    config = fast_llm_to_hybrid_config(metadata["config"]["base_model"],
                                       _weights_hint(files, "head.output_weights" + suffix))
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


def write_fast_llm(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                   options: WriteOptions) -> None:
    config = plan.source.config
    files = plan_files(plan.targets, options.max_shard_bytes, lambda index, count: f"model_{index}.safetensors")
    state_index = {name: file.name for file in files for name, _ in file.tensors}
    # Fast-LLM repeats its metadata (as YAML strings, without the state index) in each safetensors header.
    header = {key: value if isinstance(value, str) else yaml.safe_dump(value)
              for key, value in _metadata(config, None).items()}
    write_files(out_dir, files, tensors, header)
    (out_dir / METADATA_FILE).write_text(yaml.safe_dump(_metadata(config, state_index)), encoding="utf-8")


__all__ = ["read_fast_llm", "write_fast_llm", "fast_llm_rows", "load_metadata", "METADATA_FILE"]

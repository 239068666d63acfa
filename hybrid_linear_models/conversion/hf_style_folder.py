"""Reading and writing a Hugging Face style folder: `config.json` beside `model.safetensors`, or shards named
`model-00001-of-0000N.safetensors` listed in `model.safetensors.index.json`, as `save_pretrained` writes them. Our own
format (`hf`) and the peers' (`apriel2`, `fla`, `qwen3_next`) differ only in what config.json says and what the
tensors are called; everything else is here, once, so that a new HF-style format is its config mapping, its name
table and one call of `read_hf_style_folder` / `write_hf_style_folder`.

Reading checks, in this order, so that a wrong or hostile folder fails fast and before anything large is read:
SRC is a folder with config.json (naming a Fast-LLM checkpoint when that is what it holds); config.json parses
(bounded: `untrusted.parse_json`); its model_type is the format's (before any weights are opened, so a folder of
another format is named as such rather than failing on its tensors); the safetensors headers open (`open_weights`:
the index names only files inside the folder, every listed tensor is where it says, none is stored twice; no pickle);
a census of the stored tensors under the format's layer prefix bounds every size the config declares before the
config is built (a config.json claiming a billion layers is refused before any per-layer list exists); the built
config's tensor shapes match the stored ones (`check_tensor_sizes`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..configuration_hybrid_linear import HybridLinearConfig
from .errors import ConversionError
from .extra_tensors import EXTRA_TENSORS_FILE
from .name_maps import MapRow
from .pipeline import (
    CarriedTensors,
    ConversionPlan,
    SourceCheckpoint,
    TensorCensus,
    WriteOptions,
    check_tensor_sizes,
)
from .safetensors_io import (
    FilePlan,
    SafetensorsFile,
    SafetensorsTensors,
    plan_files,
    write_files,
)
from .source_files import is_source_file
from .untrusted import (
    REQUIRED,
    Fields,
    brief,
    clip,
    describe,
    parse_json,
    plain_file_name,
    read_text,
)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers."  # transformers' decoder layers: the census counts layers by it
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_FAST_LLM_HINT = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm."

Parsed = TypeVar("Parsed")  # what a format's config reader returns: our config, or our config and more


def check_model_type(fields: Fields, expected: str, flag: str) -> None:
    """config.json's model_type must be `expected` (the format read by `--from flag`); a folder of ours is pointed
    at `--from hf`."""
    model_type = fields.get("model_type")
    if model_type != expected:
        hint = " (use --from hf)" if model_type == HybridLinearConfig.model_type else ""
        raise ConversionError(f"{fields.file} has model_type {brief(model_type)}; --from {flag} reads "
                              f"{expected!r} models{hint}.")


def per_layer_names(fields: Fields, key: str, layers: int, allowed: Iterable[str], family: str,
                    default: Any = REQUIRED) -> list[str] | None:
    """config.json's `key`: one name per layer (`layers` of them), each one of `allowed` (the `family`'s names, for
    the message); `default` as in `Fields.sequence` (None: an absent key gives None)."""
    names = fields.sequence(key, default, item=str, non_empty=True)
    if names is None:
        return None
    if len(names) != layers:
        raise ConversionError(f"{fields.file}: {key} lists {len(names)} layers but num_hidden_layers is {layers}; "
                              "fix one of them.")
    allowed = tuple(allowed)
    for index, name in enumerate(names):
        if name not in allowed:
            raise ConversionError(f"{fields.file}: {key}[{index}] is {brief(name)}; {family} are "
                                  f"{' or '.join(map(repr, allowed))}.")
    return list(names)


TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def token_ids(fields: Fields) -> dict[str, Any]:
    """config.json's special token ids, each None or an integer (eos_token_id also a non-empty list of them)."""
    out = {}
    for name in TOKEN_FIELDS:
        value = fields.get(name)
        if value is not None and not _is_int(value) and not (
                name == "eos_token_id" and isinstance(value, list) and value and all(_is_int(v) for v in value)):
            raise fields.wrong(name, "a token id (an integer)" + (" or a list of them" if name == "eos_token_id"
                                                                   else ""), value)
        out[name] = value
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def layer_count(fields: Fields, default: int | None, census: TensorCensus | None) -> int | None:
    """config.json's num_hidden_layers (at least 1), checked against the stored layers before anything per layer is
    built from it."""
    layers = fields.integer("num_hidden_layers", default, minimum=1)
    if census is not None and layers is not None:
        census.check_block_count(layers, f"{fields.file}: num_hidden_layers is {layers}")
    return layers


def read_config_json(path: Path, checkpoint: str) -> tuple[Any, str]:
    """SRC's config.json, parsed, and its label for messages. `checkpoint` names the format in messages ("an fla
    checkpoint")."""
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; {checkpoint} is a folder with {CONFIG_FILE}.")
    config_path = path / CONFIG_FILE
    if not is_source_file(config_path):
        hint = _FAST_LLM_HINT if (path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not {checkpoint}: it has no {CONFIG_FILE}.{hint}")
    label = str(config_path)
    return parse_json(read_text(config_path, "JSON"), label), label


def _weight_map(path: Path) -> dict[str, str]:
    """The index's weight_map: tensor name -> a file name inside the folder (never a path out of it)."""
    label = str(path / INDEX_FILE)
    weight_map = Fields(parse_json(read_text(path / INDEX_FILE, "JSON"), label), "", label,
                        missing_is_empty=False).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{label}: weight_map should map tensor names to file names, got "
                              f"{describe(weight_map)}; the file is corrupt.")
    for key, name in weight_map.items():
        plain_file_name(name, f"{label}: weight_map[{brief(key)}]")
    return weight_map


def _add_files(files: dict[str, SafetensorsFile], opened: SafetensorsFile, keys: Iterable[str]) -> None:
    """Adds `keys` of `opened` to `files`, refusing a tensor stored twice."""
    for key in keys:
        if key in files:
            names = {files[key].path.name, opened.path.name}
            fix = (f"the carried {EXTRA_TENSORS_FILE} is stale (a model with these tensors of its own was saved "
                   f"beside it): remove {EXTRA_TENSORS_FILE}" if EXTRA_TENSORS_FILE in names else
                   "the checkpoint is corrupt")
            raise ConversionError(f"tensor {clip(key, 100)} is stored twice, in {files[key].path.name} and "
                                  f"{opened.path.name}; {fix}.")
        files[key] = opened


def open_weights(path: Path) -> tuple[dict[str, SafetensorsFile], dict[str, str] | None]:
    """The folder's safetensors files, headers only: {tensor name: its file}, and the index's weight map (None for a
    single file)."""
    if is_source_file(path / INDEX_FILE):
        weight_map = _weight_map(path)
    elif is_source_file(path / SINGLE_FILE):
        weight_map = None
    else:
        pickled = [name for name in _PICKLE_FILES if (path / name).exists()]
        raise ConversionError(f"SRC {path} has no {SINGLE_FILE} or {INDEX_FILE}" + (
            f"; it has {pickled[0]}, and only safetensors weights are read (no pickle): re-save it with "
            "save_pretrained(..., safe_serialization=True)." if pickled else "; the checkpoint is incomplete."))
    file_names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    files: dict[str, SafetensorsFile] = {}
    for name in file_names:
        if not is_source_file(path / name):
            raise ConversionError(f"{path / INDEX_FILE} lists {clip(name, 100)}, which is missing; the checkpoint is "
                                  "incomplete.")
        opened = SafetensorsFile(path / name)
        _add_files(files, opened, opened.keys())
    for key, name in (weight_map or {}).items():
        if key not in files or files[key].path.name != name:
            raise ConversionError(f"{path / INDEX_FILE} says {name} holds {clip(key, 100)}, but it does not; the "
                                  "checkpoint is incomplete or corrupt.")
    return files, weight_map


@dataclass(frozen=True)
class FolderContents:
    """The format-specific rest of a read, from its parsed config and the stored tensors: the name map, and the
    stored tensors that are not the model's."""

    rows: list[MapRow]
    skipped: list[str] = field(default_factory=list)  # stored, deliberately not converted (counted, never read)
    carried: CarriedTensors | None = None  # stored, kept untouched beside the model's
    beside: SafetensorsFile | None = None  # a file of carried tensors outside the index (hf's extra tensors)


def _itself(parsed: Any) -> HybridLinearConfig:
    return parsed


def read_hf_style_folder(
    path: Path, *, fmt: str, checkpoint: str,
    check_model_type: Callable[[Any, str], object],
    build_config: Callable[[Any, str, TensorCensus], Parsed],
    contents: Callable[[Parsed, Mapping[str, SafetensorsFile]], FolderContents],
    config_of: Callable[[Parsed], HybridLinearConfig] = _itself,
    layer_prefix: str = LAYER_PREFIX,
    outside_census: str | None = None,
) -> SourceCheckpoint:
    """Reads an HF-style folder as format `fmt` (see the module docstring for the checks and their order).

    The format's parts: `check_model_type(data, label)` raises unless config.json (parsed) is the format's;
    `build_config(data, label, census)` builds our config (or something holding it: `config_of` takes it out);
    `contents(parsed, files)` gives the name map and the stored tensors that are not the model's. Stored tensors
    whose names start with `outside_census` (tensors the config does not describe, like Qwen3-Next's `mtp.*`) are left
    out of the census."""
    path = Path(path)
    data, label = read_config_json(path, checkpoint)
    check_model_type(data, label)  # the right format at all? before the weights
    files, _ = open_weights(path)  # headers only: the census bounds the config's sizes before it is built
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()
                              if outside_census is None or not key.startswith(outside_census)), layer_prefix)
    parsed = build_config(data, label, census)
    config = config_of(parsed)
    check_tensor_sizes(config, census, label)
    found = contents(parsed, files)
    for key in found.skipped:
        del files[key]
    if found.beside is not None:
        _add_files(files, found.beside, found.beside.keys())
    return SourceCheckpoint(fmt, path, config, SafetensorsTensors(files), found.rows, list(found.skipped),
                            carried=found.carried)


def shard_name(index: int, count: int) -> str:
    """save_pretrained's weight file names: one file, or numbered shards."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_hf_style_folder(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                          options: WriteOptions, config_text: str, reads_back: Callable[[str], None],
                          beside: Callable[[], tuple[FilePlan, dict[str, str]] | None] | None = None) -> None:
    """Writes the plan's tensors as save_pretrained does (one file up to `options.max_shard_bytes`, else shards and
    the index) and `config_text` as config.json, once `reads_back(config_text)` (the format's read-back check:
    `read_back.check_reads_back`) has passed: before any file is written. `beside`: gives the file for the carried
    tensors (the plan's last ones), outside the index, with its own metadata, or None."""
    reads_back(config_text)
    beside = beside() if beside is not None else None
    model_targets = plan.targets[:len(plan.targets) - len(beside[0].tensors)] if beside else plan.targets
    files = plan_files(model_targets, options.max_shard_bytes, shard_name)
    write_files(out_dir, files + ([beside[0]] if beside else []), tensors, {"format": "pt"},
                {beside[0].name: beside[1]} if beside else None)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(info.nbytes for _, info in model_targets)},
                 "weight_map": {name: file.name for file in files for name, _ in file.tensors}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out_dir / CONFIG_FILE).write_text(config_text, encoding="utf-8")


__all__ = ["CONFIG_FILE", "SINGLE_FILE", "INDEX_FILE", "LAYER_PREFIX", "FolderContents", "open_weights",
           "read_config_json", "read_hf_style_folder", "shard_name", "write_hf_style_folder"]

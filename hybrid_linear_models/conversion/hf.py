"""This project's Hugging Face format: `config.json` (with `auto_map`), `model.safetensors` or shards with
`model.safetensors.index.json`, `generation_config.json`, a model card `README.md`, and the modeling sources for
`trust_remote_code`. Tensor names are the canonical layout (`hf_layout`)."""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from hybrid_linear_cli.conversion_catalogue import FORMAT_CATALOGUE

from ..component_registry import declared_fields
from ..configuration_hybrid_linear import HybridLinearConfig
from .errors import ConversionError
from .extra_tensors import EXTRA_TENSORS_FILE, extra_tensors_file, read_extra_tensors
from .hf_layout import hf_tensor_shapes
from .model_card import render_model_card
from .name_maps import build_hf_rows
from .pipeline import (
    ConversionPlan,
    SourceCheckpoint,
    TensorCensus,
    WriteOptions,
    check_tensor_sizes,
    config_difference,
)
from .remote_code import remote_code_files
from .safetensors_io import SafetensorsFile, SafetensorsTensors, plan_files, write_files
from .untrusted import (
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
AUTO_MAP = {
    "AutoConfig": "configuration_hybrid_linear.HybridLinearConfig",
    "AutoModel": "modeling_hybrid_linear.HybridLinearModel",
    "AutoModelForCausalLM": "modeling_hybrid_linear.HybridLinearForCausalLM",
}
ARCHITECTURES = ["HybridLinearForCausalLM"]
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _read_json(path: Path) -> Any:
    return parse_json(read_text(path, "JSON"), str(path))




def _size_fields() -> tuple[str, ...]:
    """The config.json fields that size the model: read (type-checked, bounded by the stored tensors) before
    HybridLinearConfig sees them, since it builds per-layer lists from them. The components' own sizes come from
    their registrations (every declared field of kind "size")."""
    sizes = (name for name, declared in declared_fields().items() if declared.kind == "size")
    return ("vocab_size", "hidden_size", *sizes)


def _check_before_building(fields: Fields, census: TensorCensus | None) -> None:
    """The fields HybridLinearConfig or transformers' PreTrainedConfig build from before validating (per-layer lists,
    mappings, the dtype): type-checked here, and the sizes bounded by the stored tensors."""
    layers = fields.integer("num_hidden_layers", None, minimum=1)
    if census is not None and layers is not None:
        census.check_block_count(layers, f"{fields.file}: num_hidden_layers is {layers}")
    for name in ("layer_types", "mlp_types"):  # the per-layer lists
        entries = fields.sequence(name, None, non_empty=True)
        if entries is None:
            continue
        if census is not None:
            census.check_block_count(len(entries), f"{fields.file}: {name} lists {len(entries)} layers")
        fields.sequence(name, item=str)  # each entry, once the length is known to be sane
    for name in ("rope_parameters", "id2label", "label2id"):
        if fields.get(name) is not None:
            fields.mapping(name)
    for name, declared in declared_fields().items():  # activations by name (hidden_act): strings
        if declared.kind == "activation":
            fields.string(name, None)
    dtype = fields.string("dtype", None)
    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise fields.wrong("dtype", "the name of a torch dtype (float32, bfloat16, ...)", dtype)
    for name in _size_fields():
        if fields.has(name):
            fields.integer(name, minimum=1, maximum=census.elements if census else None,
                           too_large=census.elements_phrase if census else "")


def _config_fields(text: str, label: str) -> Fields:
    fields = Fields(parse_json(text, label), "", label, missing_is_empty=False)
    model_type = fields.get("model_type")
    if model_type != HybridLinearConfig.model_type:
        readable = [entry.name for entry in FORMAT_CATALOGUE if entry.can_read and model_type in entry.model_types]
        hint = f" It is a {readable[0]} folder: use --from {readable[0]}." if readable else ""
        raise ConversionError(f"{label} has model_type {brief(model_type)}; --from hf reads "
                              f"{HybridLinearConfig.model_type!r} models (this project's format).{hint}")
    return fields


def parse_hf_config(text: str, label: str, census: TensorCensus | None = None) -> HybridLinearConfig:
    """config.json's text -> our config (the reader's path, also used to check what the writer writes)."""
    return _build_config(_config_fields(text, label), census)


def _build_config(fields: Fields, census: TensorCensus | None) -> HybridLinearConfig:
    _check_before_building(fields, census)
    try:
        return HybridLinearConfig.from_dict(dict(fields.data))
    except ValueError as error:  # the config's own validation, naming the field
        raise ConversionError(f"{fields.file} is not a valid HybridLinearConfig: {clip(str(error))}") from None
    except Exception as error:  # noqa: BLE001
        # transformers' PreTrainedConfig handles many base fields itself (dtype, id2label, ...) and fails in its own
        # ways when one holds a value of the wrong type; we cannot vouch for every such path, so any failure of
        # building the config from this file is reported as the file's problem, with the original error.
        raise ConversionError(f"{fields.file} is not a valid HybridLinearConfig: a field has a value of the wrong "
                              f"type ({type(error).__name__}: {clip(str(error), 200)}).") from None


def _config_text(path: Path) -> str:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        hint = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm." if (
            path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not a Hugging Face checkpoint: it has no {CONFIG_FILE}.{hint}")
    return read_text(config_path, "JSON")


def read_hf_config(path: Path, census: TensorCensus | None = None) -> HybridLinearConfig:
    return parse_hf_config(_config_text(path), str(path / CONFIG_FILE), census)


def _weight_map(path: Path) -> dict[str, str]:
    """The index's weight_map: tensor name -> a file name inside the folder (never a path out of it)."""
    label = str(path / INDEX_FILE)
    weight_map = Fields(_read_json(path / INDEX_FILE), "", label, missing_is_empty=False).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{label}: weight_map should map tensor names to file names, got "
                              f"{describe(weight_map)}; the file is corrupt.")
    for key, name in weight_map.items():
        plain_file_name(name, f"{label}: weight_map[{brief(key)}]")
    return weight_map


def open_weights(path: Path) -> tuple[dict[str, SafetensorsFile], dict[str, str] | None]:
    if (path / INDEX_FILE).is_file():
        weight_map = _weight_map(path)
    elif (path / SINGLE_FILE).is_file():
        weight_map = None
    else:
        pickled = [name for name in _PICKLE_FILES if (path / name).exists()]
        raise ConversionError(f"SRC {path} has no {SINGLE_FILE} or {INDEX_FILE}" + (
            f"; it has {pickled[0]}, and only safetensors weights are read (no pickle): re-save it with "
            "save_pretrained(..., safe_serialization=True)." if pickled else "; the checkpoint is incomplete."))
    file_names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    files = {}
    for name in file_names:
        if not (path / name).is_file():
            raise ConversionError(f"{path / INDEX_FILE} lists {clip(name, 100)}, which is missing; the checkpoint is "
                                  "incomplete.")
        opened = SafetensorsFile(path / name)
        for key in opened.keys():
            if key in files:
                raise ConversionError(f"tensor {clip(key, 100)} is stored twice, in {files[key].path.name} and {name}; "
                                      "the checkpoint is corrupt.")
            files[key] = opened
    for key, name in (weight_map or {}).items():
        if key not in files or files[key].path.name != name:
            raise ConversionError(f"{path / INDEX_FILE} says {name} holds {clip(key, 100)}, but it does not; the "
                                  "checkpoint is incomplete or corrupt.")
    return files, weight_map


def read_hf(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; a Hugging Face checkpoint is a folder with {CONFIG_FILE}.")
    fields = _config_fields(_config_text(path), str(path / CONFIG_FILE))  # our format at all? before the weights
    files, _ = open_weights(path)  # headers only: the census bounds the config's sizes before it is built
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()), "model.layers.")
    config = _build_config(fields, census)
    check_tensor_sizes(config, census, str(path / CONFIG_FILE))
    extra = read_extra_tensors(path)  # tensors kept beside the model's (Qwen3-Next's mtp.*), carried on untouched
    if extra is not None:
        for key in extra[1].keys:
            if key in files:
                raise ConversionError(f"tensor {clip(key, 100)} is stored twice, in {files[key].path.name} and "
                                      f"{EXTRA_TENSORS_FILE}; the checkpoint is corrupt.")
            files[key] = extra[0]
    return SourceCheckpoint("hf", path, config, SafetensorsTensors(files), build_hf_rows(config),
                            carried=extra[1] if extra is not None else None)


def _shard_name(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def export_config(config: HybridLinearConfig, dtype: torch.dtype) -> HybridLinearConfig:
    exported = copy.deepcopy(config)
    exported.architectures = list(ARCHITECTURES)
    exported.auto_map = dict(AUTO_MAP)
    exported.dtype = str(dtype).removeprefix("torch.")
    return exported


def parameter_count(config: HybridLinearConfig) -> int:
    return sum(math.prod(shape) for shape in hf_tensor_shapes(config).values())


def check_config_reads_back(config: HybridLinearConfig, config_text: str) -> None:
    """The config.json about to be written, read back through the reader's own code, must give `config` again,
    field by field; otherwise the converter would write a folder it cannot read, or one that reads as another
    model."""
    try:
        again = parse_hf_config(config_text, CONFIG_FILE)
    except ConversionError as error:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: it would not read back "
                              f"({str(error).rstrip('.')}). This is a bug in the converter; please report it with the "
                              "source config.") from None
    difference = config_difference(config, again)
    if difference is not None:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: the config field {difference} does not survive "
                              "config.json, so the written folder would describe another model; fix the field.")


def write_hf(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
             options: WriteOptions) -> None:
    source = plan.source
    config = export_config(source.config, plan.dtype or plan.targets[0][1].dtype)
    config_text = config.to_json_string(use_diff=False)
    check_config_reads_back(config, config_text)  # before any file is written
    extra = extra_tensors_file(plan)  # carried tensors (last in the plan): a file the model does not load
    model_targets = plan.targets[:len(plan.targets) - len(plan.carried)]
    files = plan_files(model_targets, options.max_shard_bytes, _shard_name)
    write_files(out_dir, files + ([extra[0]] if extra else []), tensors, {"format": "pt"},
                {extra[0].name: extra[1]} if extra else None)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(info.nbytes for _, info in model_targets)},
                 "weight_map": {name: file.name for file in files for name, _ in file.tensors}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    dtypes = sorted({str(info.dtype).removeprefix("torch.") for _, info in plan.targets})
    (out_dir / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    for file in remote_code_files():
        shutil.copy2(file, out_dir / file.name)
    card = render_model_card(
        source.config, name=options.output_name,
        parameter_count=parameter_count(source.config), dtype=", ".join(dtypes),
        source_format=source.format_name, source_format_description=options.source_description,
        source_path=str(source.path), dtype_note=f", cast to {config.dtype}" if plan.dtype is not None else "",
    )
    (out_dir / "README.md").write_text(card, encoding="utf-8")


__all__ = ["read_hf", "write_hf", "open_weights", "INDEX_FILE", "SINGLE_FILE",
           "read_hf_config", "parse_hf_config", "check_config_reads_back", "export_config",
           "AUTO_MAP", "ARCHITECTURES"]

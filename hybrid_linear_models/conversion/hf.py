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

import torch
from transformers import GenerationConfig

from ..configuration_hybrid_linear import HybridLinearConfig
from .errors import ConversionError
from .hf_layout import hf_tensor_shapes
from .model_card import render_model_card
from .name_maps import build_hf_rows
from .pipeline import ConversionPlan, SourceCheckpoint, WriteOptions
from .remote_code import remote_code_files
from .safetensors_io import SafetensorsFile, SafetensorsTensors, plan_files, write_files

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


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path} is not valid JSON ({error}); the file is corrupt.") from None
    except OSError as error:
        raise ConversionError(f"cannot read {path}: {error}") from error
    if not isinstance(data, dict):
        raise ConversionError(f"{path} should hold a JSON object.")
    return data


def read_hf_config(path: Path) -> HybridLinearConfig:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        hint = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm." if (
            path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not a Hugging Face checkpoint: it has no {CONFIG_FILE}.{hint}")
    data = _read_json(config_path)
    if data.get("model_type") != HybridLinearConfig.model_type:
        raise ConversionError(f"{config_path} has model_type {data.get('model_type')!r}; --from hf reads "
                              f"{HybridLinearConfig.model_type!r} models (this project's format).")
    try:
        return HybridLinearConfig.from_dict(data)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"{config_path} is not a valid HybridLinearConfig: {error}") from None


def read_hf(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; a Hugging Face checkpoint is a folder with {CONFIG_FILE}.")
    config = read_hf_config(path)
    if (path / INDEX_FILE).is_file():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{path / INDEX_FILE} has no weight_map; the file is corrupt.")
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
            raise ConversionError(f"{path / INDEX_FILE} lists {name}, which is missing; the checkpoint is incomplete.")
        opened = SafetensorsFile(path / name)
        for key in opened.keys():
            if key in files:
                raise ConversionError(f"tensor {key} is stored twice, in {files[key].path.name} and {name}; the "
                                      "checkpoint is corrupt.")
            files[key] = opened
    for key, name in (weight_map or {}).items():
        if key not in files or files[key].path.name != name:
            raise ConversionError(f"{path / INDEX_FILE} says {name} holds {key}, but it does not; the checkpoint is "
                                  "incomplete or corrupt.")
    return SourceCheckpoint("hf", path, config, SafetensorsTensors(files), build_hf_rows(config))


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


def write_hf(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
             options: WriteOptions) -> None:
    source = plan.source
    files = plan_files(plan.targets, options.max_shard_bytes, _shard_name)
    write_files(out_dir, files, tensors, {"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {name: file.name for file in files for name, _ in file.tensors}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    dtypes = sorted({str(info.dtype).removeprefix("torch.") for _, info in plan.targets})
    main_dtype = plan.dtype or plan.targets[0][1].dtype
    config = export_config(source.config, main_dtype)
    (out_dir / CONFIG_FILE).write_text(config.to_json_string(use_diff=False), encoding="utf-8")
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


__all__ = ["read_hf", "write_hf", "read_hf_config", "export_config", "AUTO_MAP", "ARCHITECTURES"]

"""This project's Hugging Face format: `config.json` (with `auto_map`), `model.safetensors` or shards with
`model.safetensors.index.json`, `generation_config.json`, a model card `README.md`, and the modeling sources for
`trust_remote_code`. Tensor names are the canonical layout (`hf_layout`)."""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from hybrid_linear_cli.conversion_catalogue import FORMAT_CATALOGUE

from ..component_registry import declarations_of, declared_fields
from ..configuration_hybrid_linear import HybridLinearConfig
from .errors import ConversionError
from .extra_tensors import extra_tensors_file, read_extra_tensors
from .fp8_blocks import checked_fp8_source
from .hf_layout import hf_tensor_shapes
from .hf_style_folder import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    FolderContents,
    layer_count,
    open_weights,
    read_config_json,
    read_hf_style_folder,
    write_hf_style_folder,
)
from .model_card import render_model_card
from .name_maps import build_hf_rows
from .pipeline import ConversionPlan, SourceCheckpoint, TensorCensus, WriteOptions, config_difference
from .read_back import check_reads_back
from .remote_code import remote_code_files
from .untrusted import Fields, brief, clip, parse_json

_CHECKPOINT = "a Hugging Face checkpoint"
AUTO_MAP = {
    "AutoConfig": "configuration_hybrid_linear.HybridLinearConfig",
    "AutoModel": "modeling_hybrid_linear.HybridLinearModel",
    "AutoModelForCausalLM": "modeling_hybrid_linear.HybridLinearForCausalLM",
}
ARCHITECTURES = ["HybridLinearForCausalLM"]


def _size_fields() -> tuple[str, ...]:
    """The config.json fields that size the model: read (type-checked, bounded by the stored tensors) before
    HybridLinearConfig sees them, since it builds per-layer lists from them. The components' own sizes come from
    their registrations (every declared field of kind "size")."""
    sizes = (name for name, declared in declared_fields().items() if declared.kind == "size")
    return ("vocab_size", "hidden_size", *sizes)


def _check_before_building(fields: Fields, census: TensorCensus | None) -> None:
    """The fields HybridLinearConfig or transformers' PreTrainedConfig build from before validating (per-layer lists,
    mappings, the dtype): type-checked here, and the sizes bounded by the stored tensors."""
    layer_count(fields, None, census)
    for name in ("layer_types", "mixer_types", "mlp_types", "mlp_layer_types"):  # the per-layer lists
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
    present = _named_components(fields)
    for name in _size_fields():
        if fields.has(name):
            # bounded by the stored weights only where a stored tensor has this size: a field of a mixer or MLP
            # that no layer runs sizes nothing
            sizes_a_tensor = present is None or name in ("vocab_size", "hidden_size") or any(
                component in present for _, component in declarations_of(name))
            bound = census if sizes_a_tensor else None
            fields.integer(name, minimum=1, maximum=bound.elements if bound else None,
                           too_large=bound.elements_phrase if bound else "")


def _named_components(fields: Fields) -> set[str] | None:
    """The mixers and MLPs config.json's per-layer lists name; None when it leaves either kind to the config's
    defaults."""
    lists = ("layer_types", "mixer_types", "mlp_types", "mlp_layer_types")
    given = {name: fields.get(name) for name in lists if isinstance(fields.get(name), list)}
    if not any(name in given for name in lists[:2]) or not any(name in given for name in lists[2:]):
        return None
    return {entry for entries in given.values() for entry in entries if isinstance(entry, str)}


def _check_model_type(data: Any, label: str) -> None:
    model_type = Fields(data, "", label, missing_is_empty=False).get("model_type")
    if model_type != HybridLinearConfig.model_type:
        readable = [entry.name for entry in FORMAT_CATALOGUE if entry.can_read and model_type in entry.model_types]
        hint = f" It is a {readable[0]} folder: use --from {readable[0]}." if readable else ""
        raise ConversionError(f"{label} has model_type {brief(model_type)}; --from hf reads "
                              f"{HybridLinearConfig.model_type!r} models (this project's format).{hint}")


def parse_hf_config(text: str, label: str, census: TensorCensus | None = None) -> HybridLinearConfig:
    """config.json's text -> our config (the reader's path, also used to check what the writer writes)."""
    data = parse_json(text, label)
    _check_model_type(data, label)
    return _build_config(data, label, census)


def _build_config(data: Any, label: str, census: TensorCensus | None) -> HybridLinearConfig:
    fields = Fields(data, "", label, missing_is_empty=False)
    _check_before_building(fields, census)
    try:
        return HybridLinearConfig.from_dict(dict(fields.data))
    except ValueError as error:  # the config's own validation, naming the field (its values already shown briefly)
        raise ConversionError(f"{fields.file} is not a valid HybridLinearConfig: {clip(str(error), 1000)}") from None
    except Exception as error:  # noqa: BLE001
        # transformers' PreTrainedConfig handles many base fields itself (dtype, id2label, ...) and fails in its own
        # ways when one holds a value of the wrong type; we cannot vouch for every such path, so any failure of
        # building the config from this file is reported as the file's problem, with the original error.
        raise ConversionError(f"{fields.file} is not a valid HybridLinearConfig: a field has a value of the wrong "
                              f"type ({type(error).__name__}: {clip(str(error), 200)}).") from None


def read_hf_config(path: Path, census: TensorCensus | None = None) -> HybridLinearConfig:
    data, label = read_config_json(Path(path), _CHECKPOINT)
    _check_model_type(data, label)
    return _build_config(data, label, census)


def _contents(path: Path, config: HybridLinearConfig) -> FolderContents:
    extra = read_extra_tensors(path)  # tensors kept beside the model's (Qwen3-Next's mtp.*), carried on untouched
    return FolderContents(build_hf_rows(config), carried=extra[1] if extra else None,
                          beside=extra[0] if extra else None)


def read_hf(path: Path) -> SourceCheckpoint:
    """The folder at `path`; an FP8 one (config.json's quantization_config) reads as stored, its scales and FP8
    weights checked (`fp8_blocks.checked_fp8_source`)."""
    path = Path(path)
    return checked_fp8_source(read_hf_style_folder(
        path, fmt="hf", checkpoint=_CHECKPOINT, check_model_type=_check_model_type, build_config=_build_config,
        contents=lambda config, _: _contents(path, config)))


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
    check_reads_back(config, config_text, file=CONFIG_FILE, read=lambda text: parse_hf_config(text, CONFIG_FILE),
                     difference=config_difference, does_not_survive="config.json, so the written folder would "
                     "describe another model; fix the field.")


def write_hf(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
             options: WriteOptions) -> None:
    source = plan.source
    config = export_config(source.config, plan.dtype or plan.targets[0][1].dtype)
    config_text = config.to_json_string(use_diff=False)
    # carried tensors (last in the plan): a file the model does not load
    write_hf_style_folder(out_dir, plan, tensors, options, config_text,
                          reads_back=lambda text: check_config_reads_back(config, text),
                          beside=lambda: extra_tensors_file(plan))
    dtypes = sorted({str(info.dtype).removeprefix("torch.") for _, info in plan.targets})
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

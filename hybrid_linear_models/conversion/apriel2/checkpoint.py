"""The `apriel2` format: a Hugging Face folder as Fast-LLM's Apriel2 exporter writes it (`config.json` with
model_type "apriel2_text", `model.safetensors` or shards with `model.safetensors.index.json`), read and written.

Reading needs no modeling code: the converted folder runs on our model everywhere. A written folder holds config.json
(with Fast-LLM's `auto_map`) and the weights, not Apriel2's modeling sources (Fast-LLM's code, which needs CUDA
kernels): copy `configuration_apriel2.py` and `modeling_apriel2.py` from Fast-LLM's `fast_llm_external_models/apriel2`
beside them to load it with `trust_remote_code`, or convert it back with `--from apriel2`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from ...configuration_hybrid_linear import HybridLinearConfig
from ..errors import ConversionError
from ..fast_llm.checkpoint import _layer_difference
from ..hf import open_weights
from ..name_maps import MapRow
from ..pipeline import (
    ConversionPlan,
    SourceCheckpoint,
    TensorCensus,
    WriteOptions,
    check_tensor_sizes,
    config_difference,
)
from ..safetensors_io import SafetensorsTensors, plan_files, write_files
from ..untrusted import parse_json, read_text
from .config import BLOCK_PREFIX, CONFIG_FILE, apriel2_to_hybrid_config, check_model_type
from .config_writer import CARRIED_FIELDS, hybrid_config_to_apriel2
from .parameters import build_apriel2_rows, unused_mixer_prefixes

FORMAT_NAME = "apriel2"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_apriel2(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; an Apriel2 checkpoint is a folder with {CONFIG_FILE}.")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        hint = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm." if (
            path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not an Apriel2 checkpoint: it has no {CONFIG_FILE}.{hint}")
    data = parse_json(read_text(config_path, "JSON"), str(config_path))
    check_model_type(data, str(config_path))  # the right format at all? before the weights
    files, _ = open_weights(path)  # headers only: the census bounds the config's sizes before it is built
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()), BLOCK_PREFIX)
    model = apriel2_to_hybrid_config(data, census)
    check_tensor_sizes(model.config, census, str(config_path))
    unused = unused_mixer_prefixes(model.stochastic)
    skipped = sorted(key for key in files if key.startswith(unused)) if unused else []
    for key in skipped:  # supernet mixers not used at inference: deliberately not converted
        del files[key]
    return SourceCheckpoint(FORMAT_NAME, path, model.config, SafetensorsTensors(files),
                            build_apriel2_rows(model.config, model.stochastic), skipped)


def apriel2_rows(config: HybridLinearConfig) -> list[MapRow]:
    """The name map of a written folder; raises if Apriel2 cannot express `config`."""
    hybrid_config_to_apriel2(config)
    return build_apriel2_rows(config)


def config_json(config: HybridLinearConfig) -> str:
    """The text of the config.json the writer writes for `config`."""
    return json.dumps(hybrid_config_to_apriel2(config), indent=2, sort_keys=True) + "\n"


def check_config_reads_back(config: HybridLinearConfig, text: str) -> None:
    """The config.json about to be written, read back through the reader's own code, must give `config` again in
    every field Apriel2 carries, model-wide and layer by layer; otherwise the folder would read as another model."""
    try:
        again = apriel2_to_hybrid_config(parse_json(text, CONFIG_FILE)).config
    except ConversionError as error:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: it would not read back ({str(error).rstrip('.')}). "
                              "This is a bug in the converter; please report it with the source config.") from None
    difference = config_difference(config, again, CARRIED_FIELDS) or _layer_difference(config, again)
    if difference is not None:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: the config field {difference} does not survive "
                              "Apriel2's config.json, so the written folder would describe another model; convert to "
                              "the hf format instead, or fix the field.")


def _file_name(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_apriel2(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                  options: WriteOptions) -> None:
    config = plan.source.config
    text = config_json(config)
    check_config_reads_back(config, text)  # before any file is written
    files = plan_files(plan.targets, options.max_shard_bytes, _file_name)
    write_files(out_dir, files, tensors, {"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {name: file.name for file in files for name, _ in file.tensors}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out_dir / CONFIG_FILE).write_text(text, encoding="utf-8")


__all__ = ["read_apriel2", "write_apriel2", "apriel2_rows", "config_json", "check_config_reads_back", "FORMAT_NAME"]

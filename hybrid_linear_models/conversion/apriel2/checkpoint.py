"""The `apriel2` format: a Hugging Face folder as Fast-LLM's Apriel2 exporter writes it (`config.json` with
model_type "apriel2_text", `model.safetensors` or shards with `model.safetensors.index.json`), read and written.

Reading needs no modeling code: the converted folder runs on our model everywhere. A written folder holds config.json
(with Fast-LLM's `auto_map`) and the weights, not Apriel2's modeling sources (Fast-LLM's code, which needs CUDA
kernels): copy `configuration_apriel2.py` and `modeling_apriel2.py` from Fast-LLM's `fast_llm_external_models/apriel2`
beside them to load it with `trust_remote_code`, or convert it back with `--from apriel2`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from operator import attrgetter
from pathlib import Path

import torch

from ...configuration_hybrid_linear import HybridLinearConfig
from ..fast_llm.config import fast_llm_carried_layer_fields
from ..hf_style_folder import FolderContents, read_hf_style_folder, write_hf_style_folder
from ..name_maps import MapRow
from ..pipeline import ConversionPlan, SourceCheckpoint, WriteOptions, config_difference
from ..read_back import check_reads_back, layer_difference
from ..safetensors_io import SafetensorsFile
from ..untrusted import parse_json
from .config import BLOCK_PREFIX, CONFIG_FILE, Apriel2Model, apriel2_to_hybrid_config, check_model_type
from .config_writer import CARRIED_FIELDS, hybrid_config_to_apriel2
from .parameters import build_apriel2_rows, unused_mixer_prefixes

FORMAT_NAME = "apriel2"


def _contents(model: Apriel2Model, files: Mapping[str, SafetensorsFile]) -> FolderContents:
    unused = unused_mixer_prefixes(model.stochastic)
    skipped = sorted(key for key in files if key.startswith(unused)) if unused else []
    # supernet mixers not used at inference: deliberately not converted
    return FolderContents(build_apriel2_rows(model.config, model.stochastic), skipped)


def read_apriel2(path: Path) -> SourceCheckpoint:
    return read_hf_style_folder(path, fmt=FORMAT_NAME, checkpoint="an Apriel2 checkpoint",
                                check_model_type=check_model_type, layer_prefix=BLOCK_PREFIX,
                                build_config=lambda data, _, census: apriel2_to_hybrid_config(data, census),
                                config_of=attrgetter("config"), contents=_contents)


def apriel2_rows(config: HybridLinearConfig) -> list[MapRow]:
    """The name map of a written folder; raises if Apriel2 cannot express `config`."""
    hybrid_config_to_apriel2(config)
    return build_apriel2_rows(config)


def config_json(config: HybridLinearConfig) -> str:
    """The text of the config.json the writer writes for `config`."""
    return json.dumps(hybrid_config_to_apriel2(config), indent=2, sort_keys=True) + "\n"


def _difference(expected: HybridLinearConfig, got: HybridLinearConfig) -> str | None:
    # Apriel2's blocks carry what Fast-LLM's do, layer by layer
    return (config_difference(expected, got, CARRIED_FIELDS)
            or layer_difference(expected, got, fast_llm_carried_layer_fields))


def check_config_reads_back(config: HybridLinearConfig, text: str) -> None:
    """The config.json about to be written, read back through the reader's own code, must give `config` again in
    every field Apriel2 carries, model-wide and layer by layer; otherwise the folder would read as another model."""
    check_reads_back(config, text, file=CONFIG_FILE,
                     read=lambda text: apriel2_to_hybrid_config(parse_json(text, CONFIG_FILE)).config,
                     difference=_difference, does_not_survive="Apriel2's config.json, so the written folder would "
                     "describe another model; convert to the hf format instead, or fix the field.")


def write_apriel2(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                  options: WriteOptions) -> None:
    config = plan.source.config
    write_hf_style_folder(out_dir, plan, tensors, options, config_json(config),
                          reads_back=lambda text: check_config_reads_back(config, text))


__all__ = ["read_apriel2", "write_apriel2", "apriel2_rows", "config_json", "check_config_reads_back", "FORMAT_NAME"]

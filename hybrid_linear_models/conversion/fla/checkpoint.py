"""fla's Hugging Face checkpoints (`save_pretrained` of GatedDeltaNetForCausalLM / KDAForCausalLM): config.json with
model_type "gated_deltanet" or "kda", and `model.safetensors` or shards with `model.safetensors.index.json`. Read,
and written for the models fla can express (the writer refuses the first layer or setting that does not fit, and
checks that the config.json it writes reads back as the same model before writing anything)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers

from ...configuration_hybrid_linear import BLOCK_FIELDS, MIXER_FIELDS, HybridLinearConfig
from ..hf_style_folder import CONFIG_FILE, FolderContents, read_hf_style_folder, write_hf_style_folder
from ..name_maps import MapRow
from ..pipeline import ConversionPlan, SourceCheckpoint, WriteOptions, config_difference
from ..read_back import check_reads_back, layer_difference
from ..untrusted import Fields, parse_json
from .config import fla_to_hybrid_config, hybrid_config_to_fla, model_type_of
from .parameters import build_fla_rows


def _check_model_type(data: Any, label: str) -> None:
    model_type_of(Fields(data, "", label, missing_is_empty=False))


def read_fla(path: Path) -> SourceCheckpoint:
    return read_hf_style_folder(path, fmt="fla", checkpoint="an fla checkpoint", check_model_type=_check_model_type,
                                build_config=fla_to_hybrid_config,
                                contents=lambda config, _: FolderContents(build_fla_rows(config)))


def fla_rows(config: HybridLinearConfig) -> list[MapRow]:
    """The name map for writing `config` as an fla checkpoint; raises if fla cannot express it."""
    hybrid_config_to_fla(config)
    return build_fla_rows(config)


_ARCHITECTURES = {"gated_deltanet": "GatedDeltaNetForCausalLM", "kda": "KDAForCausalLM"}
_CARRIED = ("vocab_size", "hidden_size", "mixer_types", "num_hidden_layers", "tie_word_embeddings",
            "zero_centered_norms", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")


def _layer_fields(config: HybridLinearConfig, index: int) -> tuple[str, ...]:
    """The per-layer fields fla's config.json carries: the layer's mixer's and its block's."""
    return MIXER_FIELDS[config.mixer_types[index]] + BLOCK_FIELDS


def _difference(expected: HybridLinearConfig, got: HybridLinearConfig) -> str | None:
    return config_difference(expected, got, _CARRIED) or layer_difference(expected, got, _layer_fields)


def check_fla_config_reads_back(config: HybridLinearConfig, text: str) -> None:
    """The config.json about to be written, read back by the reader, must describe the same model."""
    check_reads_back(config, text, file=CONFIG_FILE,
                     read=lambda text: fla_to_hybrid_config(parse_json(text, CONFIG_FILE), CONFIG_FILE),
                     difference=_difference, does_not_survive="fla's config.json, so the written checkpoint would "
                     "describe another model.")


def write_fla(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
              options: WriteOptions) -> None:
    config = plan.source.config
    fla_config = hybrid_config_to_fla(config)
    dtype = plan.dtype or plan.targets[0][1].dtype
    fla_config.update(architectures=[_ARCHITECTURES[fla_config["model_type"]]], dtype=str(dtype).removeprefix("torch."),
                      transformers_version=transformers.__version__)
    write_hf_style_folder(out_dir, plan, tensors, options, json.dumps(fla_config, indent=2, sort_keys=True) + "\n",
                          reads_back=lambda text: check_fla_config_reads_back(config, text))


__all__ = ["read_fla", "write_fla", "fla_rows", "check_fla_config_reads_back", "CONFIG_FILE"]

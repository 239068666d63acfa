"""fla's Hugging Face checkpoints (`save_pretrained` of GatedDeltaNetForCausalLM / KDAForCausalLM): config.json with
model_type "gated_deltanet" or "kda", and `model.safetensors` or shards with `model.safetensors.index.json`. Read,
and written for the models fla can express (the writer refuses the first layer or setting that does not fit, and
checks that the config.json it writes reads back as the same model before writing anything)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers

from ...configuration_hybrid_linear import BLOCK_FIELDS, MIXER_FIELDS, HybridLinearConfig
from ..errors import ConversionError
from ..hf import open_weights
from ..hf_layout import distinct_layers, layer_config
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
from ..untrusted import Fields, brief, parse_json, read_text
from .config import fla_to_hybrid_config, hybrid_config_to_fla, model_type_of
from .parameters import build_fla_rows

CONFIG_FILE = "config.json"


def read_fla(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; an fla checkpoint is a folder with {CONFIG_FILE}.")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        hint = " It contains metadata.yaml: if it is a Fast-LLM checkpoint, use --from fast_llm." if (
            path / "metadata.yaml").exists() else ""
        raise ConversionError(f"SRC {path} is not an fla checkpoint: it has no {CONFIG_FILE}.{hint}")
    label = str(config_path)
    data = parse_json(read_text(config_path, "JSON"), label)
    model_type_of(Fields(data, "", label, missing_is_empty=False))  # an fla model at all? before the weights
    files, _ = open_weights(path)  # headers only: the census bounds the config's sizes before it is built
    census = TensorCensus.of(((key, file.info(key)) for key, file in files.items()), "model.layers.")
    config = fla_to_hybrid_config(data, label, census)
    check_tensor_sizes(config, census, label)
    return SourceCheckpoint("fla", path, config, SafetensorsTensors(files), build_fla_rows(config))


def fla_rows(config: HybridLinearConfig) -> list[MapRow]:
    """The name map for writing `config` as an fla checkpoint; raises if fla cannot express it."""
    hybrid_config_to_fla(config)
    return build_fla_rows(config)


_ARCHITECTURES = {"gated_deltanet": "GatedDeltaNetForCausalLM", "kda": "KDAForCausalLM"}
_CARRIED = ("vocab_size", "hidden_size", "layer_types", "num_hidden_layers", "tie_word_embeddings",
            "zero_centered_norms", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")


def _layer_difference(expected: HybridLinearConfig, got: HybridLinearConfig) -> str | None:
    """The first per-layer field (its mixer's and its block's) whose resolved value differs: checking the first layer
    of each distinct setting of either config covers every layer."""
    firsts = sorted(set(distinct_layers(expected).values()) | set(distinct_layers(got).values()))
    for index in firsts:
        want, have = layer_config(expected, index), layer_config(got, index)
        for field in MIXER_FIELDS[expected.layer_types[index]] + BLOCK_FIELDS:
            if getattr(want, field) != getattr(have, field):
                return f"{field} of layer {index} ({brief(getattr(want, field))} reads back as " \
                       f"{brief(getattr(have, field))})"
    return None


def check_fla_config_reads_back(config: HybridLinearConfig, text: str) -> None:
    """The config.json about to be written, read back by the reader, must describe the same model."""
    try:
        again = fla_to_hybrid_config(parse_json(text, CONFIG_FILE), CONFIG_FILE)
    except ConversionError as error:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: it would not read back ({str(error).rstrip('.')}). "
                              "This is a bug in the converter; please report it with the source config.") from None
    difference = config_difference(config, again, _CARRIED) or _layer_difference(config, again)
    if difference is not None:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: the config field {difference} does not survive fla's "
                              "config.json, so the written checkpoint would describe another model.")


def _shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_fla(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
              options: WriteOptions) -> None:
    config = plan.source.config
    fla_config = hybrid_config_to_fla(config)
    dtype = plan.dtype or plan.targets[0][1].dtype
    fla_config.update(architectures=[_ARCHITECTURES[fla_config["model_type"]]], dtype=str(dtype).removeprefix("torch."),
                      transformers_version=transformers.__version__)
    text = json.dumps(fla_config, indent=2, sort_keys=True) + "\n"
    check_fla_config_reads_back(config, text)  # before any file is written
    files = plan_files(plan.targets, options.max_shard_bytes, _shard_name)
    write_files(out_dir, files, tensors, {"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {name: file.name for file in files for name, _ in file.tensors}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                              encoding="utf-8")
    (out_dir / CONFIG_FILE).write_text(text, encoding="utf-8")


__all__ = ["read_fla", "write_fla", "fla_rows", "check_fla_config_reads_back", "CONFIG_FILE"]

"""The `kimi_linear` format: a folder of a Kimi-Linear model (config.json with model_type "kimi_linear",
`model.safetensors` or shards with `model.safetensors.index.json`), as the released checkpoints are laid out and as
transformers' `KimiLinearForCausalLM.save_pretrained` writes it (the hub layout; a `save_original_format=False`
folder, with transformers' fused names, is read too: `parameters.py`).

The writer writes the hub layout and config.json with the hub's field names (`linear_attn_config` with 1-indexed
layer lists, `first_k_dense_replace`, `num_experts_per_token`, ...): the layout the original remote code and serving
engines read, and which transformers' KimiLinearForCausalLM loads through its conversion mapping. It writes no
`auto_map` (no modeling code is shipped): transformers' own class loads the folder; to use the original remote code,
copy its `configuration_kimi.py` / `modeling_kimi.py` beside it and add their auto_map.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GenerationConfig

from ...configuration_hybrid_linear import BLOCK_FIELDS, MIXER_FIELDS, MLP_FIELDS, HybridLinearConfig
from ..errors import ConversionError
from ..hf_layout import LM_HEAD
from ..hf_style_folder import CONFIG_FILE, FolderContents, read_hf_style_folder, write_hf_style_folder
from ..name_maps import MapRow
from ..pipeline import ConversionPlan, SourceCheckpoint, WriteOptions, config_difference
from ..read_back import check_reads_back, layer_difference
from ..safetensors_io import SafetensorsFile
from ..untrusted import parse_json
from .config import MODEL_TYPE, hybrid_config_to_kimi, kimi_to_hybrid_config
from .parameters import build_kimi_rows

# our model-wide fields that Kimi's config.json carries
_CARRIED = ("vocab_size", "hidden_size", "mixer_types", "mlp_types", "tie_word_embeddings", "zero_centered_norms",
            "max_position_embeddings", "hidden_act", "initializer_range", "use_cache", "pad_token_id",
            "bos_token_id", "eos_token_id")


def _check_model_type(data: Any, label: str) -> None:
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        kimi_to_hybrid_config(data, label)  # names the problem


def _contents(config: HybridLinearConfig, files: Mapping[str, SafetensorsFile]) -> FolderContents:
    if config.tie_word_embeddings and LM_HEAD in files:
        raise ConversionError(f"config.json says tie_word_embeddings true but the folder stores {LM_HEAD}: "
                              "transformers' KimiLinear never ties and runs that separate head, the original code "
                              "ties it to the embeddings, so the two run different models; set tie_word_embeddings "
                              "to false to convert the one transformers runs (or remove lm_head.weight).")
    return FolderContents(build_kimi_rows(config, set(files)))


def read_kimi_linear(path: Path) -> SourceCheckpoint:
    return read_hf_style_folder(path, fmt=MODEL_TYPE, checkpoint="a Kimi-Linear checkpoint",
                                check_model_type=_check_model_type, build_config=kimi_to_hybrid_config,
                                contents=_contents)


def kimi_linear_rows(config: HybridLinearConfig) -> list[MapRow]:
    """The name map for writing `config` as a Kimi-Linear folder (hub layout); raises if Kimi cannot express it."""
    hybrid_config_to_kimi(config)
    return build_kimi_rows(config)


# fields of our layers that change nothing in a model Kimi can hold: rotary settings of MLA without RoPE (NoPE)
_MEANINGLESS = ("rope_parameters",)


def _layer_fields(config: HybridLinearConfig, index: int) -> tuple[str, ...]:
    """The per-layer fields Kimi's config.json carries: the layer's mixer's, MLP's and block's."""
    fields = MIXER_FIELDS[config.mixer_types[index]] + MLP_FIELDS[config.mlp_types[index]] + BLOCK_FIELDS
    return tuple(field for field in fields if field not in _MEANINGLESS)


def _difference(expected: HybridLinearConfig, got: HybridLinearConfig) -> str | None:
    return config_difference(expected, got, _CARRIED) or layer_difference(expected, got, _layer_fields)


def check_kimi_config_reads_back(config: HybridLinearConfig, text: str) -> None:
    """The config.json about to be written, read back by the reader, must describe the same model."""
    check_reads_back(config, text, file=CONFIG_FILE,
                     read=lambda text: kimi_to_hybrid_config(parse_json(text, CONFIG_FILE), CONFIG_FILE),
                     difference=_difference, does_not_survive="Kimi-Linear's config.json, so the written checkpoint "
                     "would describe another model; convert to the hf format instead.")


def kimi_config_text(config: HybridLinearConfig, dtype: torch.dtype) -> str:
    fields = hybrid_config_to_kimi(config)
    fields.update(dtype=str(dtype).removeprefix("torch."), transformers_version=transformers.__version__)
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"


def write_kimi_linear(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                      options: WriteOptions) -> None:
    config = plan.source.config
    dtype = plan.dtype or plan.targets[0][1].dtype
    text = kimi_config_text(config, dtype)
    write_hf_style_folder(out_dir, plan, tensors, options, text,
                          reads_back=lambda text: check_kimi_config_reads_back(config, text))
    GenerationConfig.from_model_config(json.loads(text)).save_pretrained(out_dir)


__all__ = ["read_kimi_linear", "write_kimi_linear", "kimi_linear_rows", "check_kimi_config_reads_back",
           "kimi_config_text"]

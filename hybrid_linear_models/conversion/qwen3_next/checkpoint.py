"""The `qwen3_next` format: a folder that transformers' `Qwen3NextForCausalLM` loads (config.json with model_type
"qwen3_next", `model.safetensors` or shards with `model.safetensors.index.json`), as `save_pretrained` writes it and
as the released checkpoints are laid out.

Tensor names are ours already (our model mirrors Qwen3-Next's module names, GDN's grouped `in_proj_qkvz` /
`in_proj_ba` and the zero-centred norm weights included), so every tensor maps by identity except the experts of
sparse MoE layers: the hub layout (and `save_pretrained` in transformers 5, which reverts its in-memory fusion on save)
stores them one expert at a time, `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, which `StackedExperts` gathers
into our (E, 2I, H) `gate_up_proj` (gate rows first, as transformers' conversion mapping concatenates them) and
(E, H, I) `down_proj`, and splits back; a folder saved with `save_original_format=False` (already fused) is read by
identity. The writer writes the per-expert layout, the one serving engines and older transformers read.

`mtp.*` tensors (the multi-token prediction head, mtp_head.py) are the model's own when config.json declares MTP
layers: identity names (the MoE experts of a sparse MTP layer stacked as a decoder layer's are), checked to be exactly
the head the config describes, else refused naming the missing or unexpected tensors; a folder whose config declares
MTP layers but stores no `mtp.*` tensor converts without them. A config without MTP layers leaves stored `mtp.*`
tensors carried untouched, with the config's mtp fields, to formats that keep them (`extra_tensors`), and written back
here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import StackedExperts
from ..errors import ConversionError
from ...fp8_settings import QUANTIZATION_KEY
from ..fp8_blocks import SCALE_SUFFIX, checked_fp8_source, read_block_fp8_config
from ..hf_layout import layer_prefix
from ..hf_style_folder import CONFIG_FILE, FolderContents, read_hf_style_folder, write_hf_style_folder
from ..name_maps import MapRow, build_hf_rows
from ..pipeline import (CarriedTensors, ConversionPlan, SourceCheckpoint, TensorCensus, WriteOptions,
                        config_difference)
from ..read_back import check_reads_back
from ..safetensors_io import SafetensorsFile
from ..untrusted import clip, parse_json
from .config import MODEL_TYPE, hybrid_config_to_qwen3_next, is_carried_field, qwen3_next_to_hybrid_config

logger = logging.getLogger(__name__)

MTP_PREFIX = "mtp."
_EXPERT_TENSORS = (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
# our config fields that Qwen3-Next's config.json carries (the rest, kda_* and training switches, it does not)
_CARRIED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "mixer_types", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
    "initializer_range", "attention_bias", "attention_dropout", "mlp_bias", "attention_output_gate",
    "attention_qk_norm", "zero_centered_norms", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim",
    "gdn_value_head_dim", "gdn_conv_kernel_size", "gdn_gate_activation", "gdn_norm_eps", "use_cache", "pad_token_id",
    "bos_token_id", "eos_token_id", "num_mtp_layers", "mtp_mlp_type",
)
_MOE_FIELDS = ("mlp_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")


def _sparse_layers(config: HybridLinearConfig) -> list[int]:
    return [i for i, t in enumerate(config.mlp_types) if t == "sparse_moe"]


def _sparse_prefixes(config: HybridLinearConfig) -> list[str]:
    """The prefixes of every sparse MoE block's layer: the decoder layers', then the MTP layers'."""
    mtp = [f"{MTP_PREFIX}layers.{j}." for j in range(config.num_mtp_layers) if config.mtp_mlp_type == "sparse_moe"]
    return [layer_prefix(index) for index in _sparse_layers(config)] + mtp


def qwen3_next_rows(config: HybridLinearConfig, fused_experts: bool = False) -> list[MapRow]:
    """Identity rows, except each sparse layer's experts: per expert (the hub layout) unless `fused_experts`.
    Raises if Qwen3-Next cannot express `config`."""
    hybrid_config_to_qwen3_next(config)
    rows = build_hf_rows(config)
    if fused_experts:
        return rows
    stacked = {}
    for layer in _sparse_prefixes(config):
        prefix = f"{layer}mlp.experts."
        for (fused, parts), suffix in itertools.product(_EXPERT_TENSORS, ("", SCALE_SUFFIX)):  # FP8: scales too
            keys = tuple(f"{prefix}{e}.{part}.weight{suffix}" for e in range(config.num_experts) for part in parts)
            canonical = prefix + fused + suffix
            stacked[canonical] = MapRow(keys, StackedExperts(config.num_experts, len(parts)), (canonical,))
    return [stacked.get(row.canonical_keys[0], row) for row in rows]


def _has_fused_experts(keys: Iterable[str], config: HybridLinearConfig) -> bool:
    """Whether the sparse layers' experts are stored fused (`experts.gate_up_proj`) rather than one tensor per expert
    (`experts.{e}.gate_proj.weight`); one ConversionError line where the checkpoint holds both layouts (a folder
    put together from two exports): every layer of a checkpoint uses one."""
    fused = per_expert = None
    for key in keys:
        _, found, tail = key.partition(".mlp.experts.")
        if not found:
            continue
        if tail.split(".", 1)[0].isdigit():
            per_expert = per_expert or key
        elif tail.startswith(("gate_up_proj", "down_proj")):
            fused = fused or key
    if fused and per_expert:
        raise ConversionError(f"the checkpoint stores experts in two layouts, fused ({clip(fused)}) and one tensor per "
                              f"expert ({clip(per_expert)}); a Qwen3-Next checkpoint stores every layer's experts "
                              "one way: export it again.")
    return bool(_sparse_prefixes(config)) and fused is not None


def _check_model_type(data: Any, label: str) -> None:
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        qwen3_next_to_hybrid_config(data, label)  # names the problem


def _contents(parsed: tuple[HybridLinearConfig, dict[str, Any]], files: Mapping[str, SafetensorsFile]
              ) -> FolderContents:
    config, carried_fields = parsed
    mtp = tuple(key for key in files if key.startswith(MTP_PREFIX))
    carried = CarriedTensors(MODEL_TYPE, mtp, carried_fields) if mtp and not config.num_mtp_layers else None
    return FolderContents(qwen3_next_rows(config, fused_experts=_has_fused_experts(files, config)), carried=carried)


def _without_mtp_layers(config: HybridLinearConfig) -> HybridLinearConfig:
    return HybridLinearConfig.from_dict({**config.to_dict(), "num_mtp_layers": 0, "mtp_mlp_type": None})


def _with_checked_mtp_head(source: SourceCheckpoint) -> SourceCheckpoint:
    """The source with its MTP head checked: the stored mtp.* tensors (FP8 scales aside: checked against their
    weights by `checked_fp8_source`) are exactly the head the config declares, or none (then the model has no MTP
    layers)."""
    config = source.config
    if not config.num_mtp_layers:
        return source
    stored = {key for key in source.tensors.keys() if key.startswith(MTP_PREFIX)}
    if not stored:  # (as transformers' save_pretrained of Qwen3NextForCausalLM writes a folder: said, not refused)
        logger.warning(f"{source.path}: config.json declares {config.num_mtp_layers} MTP layer(s) but no mtp.* "
                       "tensor is stored: the model converts without a multi-token-prediction head (use_mtp needs "
                       "one; convert a checkpoint that stores it).")
        config = _without_mtp_layers(config)
        return dataclasses.replace(source, config=config, rows=qwen3_next_rows(
            config, fused_experts=_has_fused_experts(source.tensors.keys(), config)))
    expected = [key for row in source.rows for key in row.format_keys
                if key.startswith(MTP_PREFIX) and not key.endswith(SCALE_SUFFIX)]
    stored = {key for key in stored if not key.endswith(SCALE_SUFFIX)}
    missing, unexpected = [key for key in expected if key not in stored], sorted(stored - set(expected))
    if missing or unexpected:
        found = "; ".join(f"{what} {clip(', '.join(keys[:3]), 200)}{', ...' if len(keys) > 3 else ''}"
                          for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise ConversionError(f"{source.path}: config.json declares {config.num_mtp_layers} MTP layer(s) "
                              f"(Qwen3-Next's head: mtp.fc, mtp.pre_fc_norm_*, mtp.layers.*, mtp.norm), but the "
                              f"stored mtp.* tensors are not that head ({found}); the checkpoint is incomplete or of "
                              "another layout.")
    return source


def read_qwen3_next(path: Path) -> SourceCheckpoint:
    """The folder at `path`; an FP8 one (`quantization_config`, carried into our config) reads as stored, its
    scales and FP8 weights checked (`fp8_blocks.checked_fp8_source`), marked `quantization="fp8"`."""

    def build_config(data: Any, label: str, census: TensorCensus) -> tuple[HybridLinearConfig, dict[str, Any]]:
        if isinstance(data, dict):
            read_block_fp8_config(data, label)  # one line naming an unsupported setting, with the file's name
        return qwen3_next_to_hybrid_config(data, label, census)

    # the mtp.* tensors stay out of the census: checked as the declared head, or carried where none is declared (FP8
    # ones with their scales)
    source = checked_fp8_source(read_hf_style_folder(
        path, fmt=MODEL_TYPE, checkpoint="a Qwen3-Next checkpoint", check_model_type=_check_model_type,
        build_config=build_config, config_of=lambda parsed: parsed[0], contents=_contents, outside_census=MTP_PREFIX))
    return _with_checked_mtp_head(source)


def _carried_fields(plan: ConversionPlan) -> dict[str, Any]:
    carried = plan.source.carried
    if carried is None:
        return {}
    if carried.origin != MODEL_TYPE or any(not key.startswith(MTP_PREFIX) for key in carried.keys):
        raise ConversionError(f"{plan.source.path} carries tensors from {carried.origin} "
                              f"({clip(carried.keys[0], 100)}, ...), which a Qwen3-Next folder cannot hold; convert "
                              "to the hf format instead.")
    return {name: value for name, value in carried.fields.items() if is_carried_field(name)}


def qwen3_next_config_text(config: HybridLinearConfig, dtype: torch.dtype, carried: dict[str, Any]) -> str:
    """config.json as transformers' own Qwen3NextConfig writes it for `config`."""
    from transformers import Qwen3NextConfig

    fields = hybrid_config_to_qwen3_next(config, carried)
    fields["dtype"] = str(dtype).removeprefix("torch.")
    return Qwen3NextConfig(**fields).to_json_string(use_diff=False)


def check_config_reads_back(config: HybridLinearConfig, text: str) -> None:
    """The config.json about to be written, read back by the reader, must give `config` in every field Qwen3-Next
    carries; otherwise the folder would hold another model."""
    fields = (*_CARRIED_FIELDS, *(_MOE_FIELDS if _sparse_layers(config) else ()),
              *((QUANTIZATION_KEY,) if config.block_fp8 is not None else ()))
    check_reads_back(config, text, file=CONFIG_FILE,
                     read=lambda text: qwen3_next_to_hybrid_config(parse_json(text, CONFIG_FILE), CONFIG_FILE)[0],
                     difference=lambda expected, got: config_difference(expected, got, fields),
                     does_not_survive="Qwen3-Next's config.json; convert to the hf format instead.")


def write_qwen3_next(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                     options: WriteOptions) -> None:
    config = plan.source.config
    dtype = plan.dtype or plan.targets[0][1].dtype
    config_text = qwen3_next_config_text(config, dtype, _carried_fields(plan))
    write_hf_style_folder(out_dir, plan, tensors, options, config_text,  # mtp.* in the shards, as on the hub
                          reads_back=lambda text: check_config_reads_back(config, text))
    GenerationConfig.from_model_config(json.loads(config_text)).save_pretrained(out_dir)


__all__ = ["read_qwen3_next", "write_qwen3_next", "qwen3_next_rows", "qwen3_next_config_text", "CONFIG_FILE"]

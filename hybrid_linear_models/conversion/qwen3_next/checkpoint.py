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

`mtp.*` tensors (the multi-token prediction head) are carried untouched, with the config's mtp fields, to formats
that keep them (`extra_tensors`), and written back here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from ...configuration_hybrid_linear import HybridLinearConfig
from ..converters import StackedExperts
from ..errors import ConversionError
from ..hf import INDEX_FILE, SINGLE_FILE, open_weights
from ..hf_layout import layer_prefix
from ..name_maps import MapRow, build_hf_rows
from ..pipeline import (
    CarriedTensors,
    ConversionPlan,
    SourceCheckpoint,
    TensorCensus,
    WriteOptions,
    check_tensor_sizes,
    config_difference,
)
from ..safetensors_io import SafetensorsTensors, plan_files, write_files
from ..untrusted import clip, parse_json, read_text
from .config import MODEL_TYPE, is_carried_field, qwen3_next_to_hybrid_config, hybrid_config_to_qwen3_next

CONFIG_FILE = "config.json"
MTP_PREFIX = "mtp."
_EXPERT_TENSORS = (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
# our config fields that Qwen3-Next's config.json carries (the rest, kda_* and training switches, it does not)
_CARRIED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "layer_types", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
    "initializer_range", "attention_bias", "attention_dropout", "mlp_bias", "attention_output_gate",
    "attention_qk_norm", "zero_centered_norms", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim",
    "gdn_value_head_dim", "gdn_conv_kernel_size", "gdn_gate_activation", "gdn_norm_eps", "use_cache", "pad_token_id",
    "bos_token_id", "eos_token_id",
)
_MOE_FIELDS = ("mlp_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")


def _sparse_layers(config: HybridLinearConfig) -> list[int]:
    return [i for i, t in enumerate(config.mlp_types) if t == "sparse_moe"]


def qwen3_next_rows(config: HybridLinearConfig, fused_experts: bool = False) -> list[MapRow]:
    """Identity rows, except each sparse layer's experts: per expert (the hub layout) unless `fused_experts`.
    Raises if Qwen3-Next cannot express `config`."""
    hybrid_config_to_qwen3_next(config)
    rows = build_hf_rows(config)
    if fused_experts:
        return rows
    stacked = {}
    for index in _sparse_layers(config):
        prefix = f"{layer_prefix(index)}mlp.experts."
        for fused, parts in _EXPERT_TENSORS:
            keys = tuple(f"{prefix}{e}.{part}.weight" for e in range(config.num_experts) for part in parts)
            stacked[prefix + fused] = MapRow(keys, StackedExperts(config.num_experts, len(parts)), (prefix + fused,))
    return [stacked.get(row.canonical_keys[0], row) for row in rows]


def _has_fused_experts(keys: Iterable[str], config: HybridLinearConfig) -> bool:
    sparse = _sparse_layers(config)
    return bool(sparse) and f"{layer_prefix(sparse[0])}mlp.experts.gate_up_proj" in set(keys)


def read_qwen3_next(path: Path) -> SourceCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"SRC {path} is not a folder; a Qwen3-Next checkpoint is a folder with {CONFIG_FILE}.")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ConversionError(f"SRC {path} is not a Hugging Face checkpoint: it has no {CONFIG_FILE}.")
    data = parse_json(read_text(config_path, "JSON"), str(config_path))
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:  # before opening any weights
        qwen3_next_to_hybrid_config(data, str(config_path))  # names the problem
    files, _ = open_weights(path)
    model_files = {key: file for key, file in files.items() if not key.startswith(MTP_PREFIX)}
    census = TensorCensus.of(((key, file.info(key)) for key, file in model_files.items()), "model.layers.")
    config, carried_fields = qwen3_next_to_hybrid_config(data, str(config_path), census)
    check_tensor_sizes(config, census, str(config_path))
    mtp = tuple(key for key in files if key.startswith(MTP_PREFIX))
    carried = CarriedTensors(MODEL_TYPE, mtp, carried_fields) if mtp else None
    rows = qwen3_next_rows(config, fused_experts=_has_fused_experts(files, config))
    return SourceCheckpoint(MODEL_TYPE, path, config, SafetensorsTensors(files), rows, carried=carried)


def _shard_name(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


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
    try:
        again, _ = qwen3_next_to_hybrid_config(json.loads(text), CONFIG_FILE)
    except ConversionError as error:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: it would not read back ({str(error).rstrip('.')}). "
                              "This is a bug in the converter; please report it with the source config.") from None
    fields = _CARRIED_FIELDS + (_MOE_FIELDS if _sparse_layers(config) else ())
    difference = config_difference(config, again, fields)
    if difference is not None:
        raise ConversionError(f"refusing to write {CONFIG_FILE}: the config field {difference} does not survive "
                              "Qwen3-Next's config.json; convert to the hf format instead.")


def write_qwen3_next(out_dir: Path, plan: ConversionPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                     options: WriteOptions) -> None:
    config = plan.source.config
    dtype = plan.dtype or plan.targets[0][1].dtype
    config_text = qwen3_next_config_text(config, dtype, _carried_fields(plan))
    check_config_reads_back(config, config_text)  # before any file is written
    files = plan_files(plan.targets, options.max_shard_bytes, _shard_name)  # mtp.* included, as on the hub
    write_files(out_dir, files, tensors, {"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {name: file.name for file in files for name, _ in file.tensors}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out_dir / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    GenerationConfig.from_model_config(json.loads(config_text)).save_pretrained(out_dir)


__all__ = ["read_qwen3_next", "write_qwen3_next", "qwen3_next_rows", "qwen3_next_config_text", "CONFIG_FILE"]

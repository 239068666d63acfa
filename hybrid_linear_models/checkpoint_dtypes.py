"""`from_pretrained` refuses a checkpoint tensor whose kind of dtype differs from the parameter it loads into.

transformers casts every checkpoint tensor to its parameter's dtype while loading (core_model_loading), so an int8 or
bool tensor in a float checkpoint (a corrupt or mislabelled file, or quantized weights saved without their
quantization_config) would silently become float weights holding its integer values. Floating-point tensors of any
width load as before (the cast between floating types is the dtype choice `from_pretrained` makes); a quantized load
(a quantizer, which reads its integer tensors itself) is left to the quantizer.

The check reads only the safetensors headers (the dtypes), before transformers reads any weight, and maps each
checkpoint name to the model's parameter as transformers' loader does (`rename_source_key`: the model's weight
renamings and converters, the base-model prefix added or dropped).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)


def check_checkpoint_dtypes(model: nn.Module, state_dict: dict[str, Any] | None, checkpoint_files: list[str] | None,
                            load_config: Any) -> None:
    """Raises a one-line ValueError naming the first checkpoint tensor that is not floating-point where its parameter
    is (or floating-point where its parameter is not)."""
    if getattr(load_config, "hf_quantizer", None) is not None:
        return
    targets = model.state_dict()  # (meta tensors while loading: names and dtypes only)
    mapping = getattr(load_config, "weight_mapping", None) or []
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    for source, name, floating, dtype in _checkpoint_dtypes(state_dict, checkpoint_files):
        target, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, targets)
        parameter = targets.get(target)
        if parameter is None or parameter.dtype.is_floating_point == floating:
            continue
        into = "a non-floating parameter" if floating else "floating-point weights"
        raise ValueError(
            f"checkpoint tensor {name!r} ({source}) is {dtype} but the parameter it loads into, {target!r}, is "
            f"{parameter.dtype}: loading would cast its values into {into} silently; save the checkpoint in the "
            "parameters' kind of dtype (or load quantized weights with their quantization_config)."
        )


def _checkpoint_dtypes(state_dict: dict[str, Any] | None,
                       checkpoint_files: list[str] | None) -> Iterator[tuple[str, str, bool, str]]:
    """(where, tensor name, whether floating-point, its dtype's name) of every checkpoint tensor: the given state
    dict's, else the safetensors files' headers."""
    if state_dict is not None:
        for name, tensor in state_dict.items():
            if isinstance(tensor, torch.Tensor):
                yield "state_dict", name, tensor.dtype.is_floating_point, str(tensor.dtype)
        return
    for path in checkpoint_files or []:
        if not str(path).endswith(".safetensors"):
            continue
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()  # (a safetensors handle: its keys() lists the tensors)
            for name in names:
                dtype = handle.get_slice(name).get_dtype()
                yield os.path.basename(path), name, _is_floating_name(dtype), _SHOWN.get(dtype, dtype)


def _is_floating_name(dtype: str) -> bool:
    """Whether a safetensors dtype name is a floating-point type: F64 ... F4, F8_E4M3, BF16 (not I*, U*, BOOL, C*)."""
    return dtype.startswith("F") or dtype == "BF16"


# safetensors' names of the non-floating dtypes, as torch names them in messages
_SHOWN = {"BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8", "U16": "torch.uint16", "I16": "torch.int16",
          "U32": "torch.uint32", "I32": "torch.int32", "U64": "torch.uint64", "I64": "torch.int64",
          "C64": "torch.complex64"}

__all__ = ["check_checkpoint_dtypes"]

"""`from_pretrained` refuses a checkpoint tensor whose kind of dtype differs from the parameter it loads into, and an
FP8 model's checkpoint without a scale, or with a scale of another shape.

transformers casts every checkpoint tensor to its parameter's dtype while loading (core_model_loading), so an int8 or
bool tensor in a float checkpoint (a corrupt or mislabelled file, or quantized weights saved without their
quantization_config) would silently become float weights holding its integer values. Floating-point tensors of any
width load as before (the cast between floating types is the dtype choice `from_pretrained` makes); a quantized load
(a quantizer, which reads its integer tensors itself) is left to the quantizer.

Three kinds: FP8 (one byte per value: the block-scaled weights of `fp8_layers`, meaningful only with their scales),
other floating point, and the rest. An FP8 tensor into a bf16 weight (a folder whose config.json lost its
quantization_config) would load its raw values without the scales; a bf16 tensor into an FP8 weight would round it
onto FP8 values; both are refused. An FP8 model's scales (`*_scale_inv`) must all be in the checkpoint with the
shapes the model declares (transformers would otherwise initialise a missing scale as a fresh parameter).

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

from .fp8_settings import SCALE_SUFFIX


def check_checkpoint_dtypes(model: nn.Module, state_dict: dict[str, Any] | None, checkpoint_files: list[str] | None,
                            load_config: Any) -> None:
    """Raises a one-line ValueError naming the first checkpoint tensor whose kind of dtype (FP8, other floating
    point, not floating) differs from its parameter's, or the first scale of an FP8 model that is missing or of
    another shape."""
    if getattr(load_config, "hf_quantizer", None) is not None:
        return
    targets = model.state_dict()  # (meta tensors while loading: names and dtypes only)
    mapping = getattr(load_config, "weight_mapping", None) or []
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    scales = {name: tuple(tensor.shape) for name, tensor in targets.items() if name.endswith(SCALE_SUFFIX)}
    for source, name, kind, dtype, shape in _checkpoint_tensors(state_dict, checkpoint_files):
        target, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, targets)
        parameter = targets.get(target)
        if parameter is None:
            continue
        if target in scales:
            expected = scales.pop(target)
            if shape != expected:
                raise ValueError(f"checkpoint tensor {name!r} ({source}) has shape {list(shape)}, but the FP8 weight "
                                 f"{target.removesuffix(SCALE_SUFFIX)!r} has scales of shape {list(expected)} (one per "
                                 "weight_block_size block); the checkpoint is corrupt or its quantization_config's "
                                 "weight_block_size is wrong.")
        expected_kind = _kind(parameter.dtype)
        if kind == expected_kind:
            continue
        raise ValueError(
            f"checkpoint tensor {name!r} ({source}) is {dtype} but the parameter it loads into, {target!r}, is "
            f"{parameter.dtype}: loading would cast its values into {_INTO[expected_kind]} silently; "
            f"{_FIX.get((kind, expected_kind), _FIX_KIND)}"
        )
    if scales:
        name = min(scales)
        raise ValueError(f"the checkpoint has no tensor {name!r}, the scales of the FP8 weight "
                         f"{name.removesuffix(SCALE_SUFFIX)!r} (float32, shape {list(scales[name])}); the checkpoint "
                         "is incomplete: every FP8 weight is stored with its weight_scale_inv.")


_INTO = {"FP8": "FP8 weights", "floating": "floating-point weights", "other": "a non-floating parameter"}
_FIX_KIND = ("save the checkpoint in the parameters' kind of dtype (or load quantized weights with their "
             "quantization_config).")
_FIX = {
    ("FP8", "floating"): "an FP8 weight loads only with its scales, into the FP8 layer its config.json's "
                         "quantization_config builds (restore the quantization_config, or fix modules_to_not_convert).",
    ("floating", "FP8"): "the quantization_config quantizes this module but the checkpoint stores it unquantized; "
                         "add the module to modules_to_not_convert, or store it in FP8 with its weight_scale_inv.",
}


def _kind(dtype: torch.dtype) -> str:
    if not dtype.is_floating_point:
        return "other"
    return "FP8" if dtype.itemsize == 1 else "floating"


def _checkpoint_tensors(state_dict: dict[str, Any] | None, checkpoint_files: list[str] | None
                        ) -> Iterator[tuple[str, str, str, str, tuple[int, ...]]]:
    """(where, tensor name, its kind of dtype, its dtype's name, its shape) of every checkpoint tensor: the given
    state dict's, else the safetensors files' headers."""
    if state_dict is not None:
        for name, tensor in state_dict.items():
            if isinstance(tensor, torch.Tensor):
                yield "state_dict", name, _kind(tensor.dtype), str(tensor.dtype), tuple(tensor.shape)
        return
    for path in checkpoint_files or []:
        if not str(path).endswith(".safetensors"):
            continue
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()  # (a safetensors handle: its keys() lists the tensors)
            for name in names:
                header = handle.get_slice(name)
                dtype = header.get_dtype()
                yield (os.path.basename(path), name, _kind_of_name(dtype), _SHOWN.get(dtype, dtype),
                       tuple(header.get_shape()))


def _kind_of_name(dtype: str) -> str:
    """The kind of a safetensors dtype name: F8_E4M3 / F8_E5M2 (FP8), F64 ... F16, BF16 (floating), I*, U*, BOOL,
    C* (other)."""
    if dtype.startswith("F8"):
        return "FP8"
    return "floating" if dtype.startswith("F") or dtype == "BF16" else "other"


# safetensors' names of the non-floating dtypes, as torch names them in messages
_SHOWN = {"BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8", "U16": "torch.uint16", "I16": "torch.int16",
          "U32": "torch.uint32", "I32": "torch.int32", "U64": "torch.uint64", "I64": "torch.int64",
          "C64": "torch.complex64", "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2"}

__all__ = ["check_checkpoint_dtypes"]

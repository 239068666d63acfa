"""`from_pretrained` refuses a checkpoint tensor whose kind of dtype differs from the parameter it loads into, an FP8
model's checkpoint whose FP8 weights or scales are missing or do not fit, and a file that is not valid safetensors.

transformers casts every checkpoint tensor to its parameter's dtype while loading (core_model_loading), so an int8 or
bool tensor in a float checkpoint (a corrupt or mislabelled file, or quantized weights saved without their
quantization_config) would silently become float weights holding its integer values. Floating-point tensors of any
width load as before (the cast between floating types is the dtype choice `from_pretrained` makes); a quantized load
(a quantizer, which reads its integer tensors itself) is left to the quantizer.

Three kinds: FP8 (one byte per value: the block-scaled weights of `fp8_layers`, meaningful only with their scales),
other floating point, and the rest. An FP8 tensor into a bf16 weight (a folder whose config.json lost its
quantization_config) would load its raw values without the scales; a bf16 tensor into an FP8 weight would round it
onto FP8 values; an e5m2 tensor into an e4m3 weight would round its values onto another format: all are refused. An
FP8 model's weights and scales (`*_scale_inv`) must all be in the checkpoint (transformers would otherwise
initialise a missing one as a fresh parameter, random values beside real scales), the scales with the shapes the
model declares, in a dtype that loads exactly (float32, bf16, fp16) and finite and positive; a scale stored for a
weight the model keeps unquantized means the checkpoint and the quantization_config disagree.

The check reads the safetensors headers (dtypes and shapes, validated against the file: a truncated or corrupt file
is refused by name) and the FP8 scales' values (a few MB for an 80B model), before transformers reads any weight,
and maps each checkpoint name to the model's parameter as transformers' loader does (`rename_source_key`: the
model's weight renamings and converters, the base-model prefix added or dropped).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from .fp8_settings import SCALE_SUFFIX
from .kernels_fp8 import SCALE_DTYPES, first_bad_scale
from .safetensors_dtypes import DTYPES


def check_checkpoint_dtypes(model: nn.Module, state_dict: dict[str, Any] | None, checkpoint_files: list[str] | None,
                            load_config: Any) -> None:
    """Raises a one-line ValueError naming the first checkpoint tensor whose kind of dtype (FP8, other floating
    point, not floating) differs from its parameter's, or whose FP8 format differs; and, for an FP8 model, the first
    FP8 weight or scale that is missing, a scale of another shape or dtype or with a value that is not finite and
    positive, or a scale stored for a weight the model keeps unquantized. A file that is not valid safetensors is
    refused by name."""
    if getattr(load_config, "hf_quantizer", None) is not None:
        return
    targets = model.state_dict()  # (meta tensors while loading: names and dtypes only)
    mapping = getattr(load_config, "weight_mapping", None) or []
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    scales = {name: tuple(tensor.shape) for name, tensor in targets.items() if name.endswith(SCALE_SUFFIX)}
    fp8_weights = {name for name, tensor in targets.items() if _kind(tensor.dtype) == "FP8"}
    for source, name, dtype, shape, values in _checkpoint_tensors(state_dict, checkpoint_files):
        target, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, targets)
        parameter = targets.get(target)
        if parameter is None:
            _check_not_a_stray_scale(source, name, target, targets)
            continue
        if dtype is None:
            raise ValueError(f"checkpoint tensor {name!r} ({source}) has a dtype this package does not load into "
                             f"{target!r} (it loads {', '.join(DTYPES)}); store it in one of them.")
        if target in scales:
            _check_scale(source, name, target, dtype, shape, scales.pop(target), values)
            continue
        fp8_weights.discard(target)
        kind, expected_kind = _kind(dtype), _kind(parameter.dtype)
        if kind == expected_kind == "FP8" and dtype != parameter.dtype:
            raise ValueError(f"checkpoint tensor {name!r} ({source}) is {dtype} but the FP8 weight it loads into, "
                             f"{target!r}, is {parameter.dtype} (quantization_config's fmt): loading would convert "
                             "its values to another FP8 format silently; store it in the config's format.")
        if kind == expected_kind:
            continue
        raise ValueError(
            f"checkpoint tensor {name!r} ({source}) is {dtype} but the parameter it loads into, {target!r}, is "
            f"{parameter.dtype}: loading would cast its values into {_INTO[expected_kind]} silently; "
            f"{_FIX.get((kind, expected_kind), _FIX_KIND)}"
        )
    if fp8_weights:
        name = min(fp8_weights)
        raise ValueError(f"the checkpoint has no tensor {name!r}, an FP8 weight of the model (quantization_config); "
                         "the checkpoint is incomplete: loading would fill it with random values. Restore the "
                         "weight, or load a checkpoint that stores it.")
    if scales:
        name = min(scales)
        raise ValueError(f"the checkpoint has no tensor {name!r}, the scales of the FP8 weight "
                         f"{name.removesuffix(SCALE_SUFFIX)!r} (float32, shape {list(scales[name])}); the checkpoint "
                         "is incomplete: every FP8 weight is stored with its weight_scale_inv.")


def _check_scale(source: str, name: str, target: str, dtype: torch.dtype, shape: tuple[int, ...],
                 expected: tuple[int, ...], values: Callable[[], torch.Tensor]) -> None:
    """A checkpoint scale of the model's FP8 weight: its shape, a dtype that loads exactly (`SCALE_DTYPES`), and
    finite, positive values (`first_bad_scale`)."""
    weight = target.removesuffix(SCALE_SUFFIX)
    if shape != expected:
        raise ValueError(f"checkpoint tensor {name!r} ({source}) has shape {list(shape)}, but the FP8 weight "
                         f"{weight!r} has scales of shape {list(expected)} (one per weight_block_size block); the "
                         "checkpoint is corrupt or its quantization_config's weight_block_size is wrong.")
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} ({source}) is {dtype}, but the scales of the FP8 weight "
                         f"{weight!r} are float32 (bfloat16 and float16 load exactly); store them in float32.")
    bad = first_bad_scale(values())
    if bad is not None:
        index, value = bad
        raise ValueError(f"checkpoint tensor {name!r} ({source}) holds {value:g} at block {index}; the scales of an "
                         "FP8 weight are finite and positive, so the checkpoint is corrupt.")


def _check_not_a_stray_scale(source: str, name: str, target: str, targets: dict[str, torch.Tensor]) -> None:
    """A checkpoint scale whose weight the model holds unquantized: the checkpoint quantizes a module the config
    does not (its quantization_config or modules_to_not_convert differs from the checkpoint's)."""
    weight = target.removesuffix(SCALE_SUFFIX) if target.endswith(SCALE_SUFFIX) else None
    if weight is not None and weight in targets and _kind(targets[weight].dtype) != "FP8":
        raise ValueError(f"checkpoint tensor {name!r} ({source}) is the scale of an FP8 weight, but the model keeps "
                         f"{weight!r} unquantized ({targets[weight].dtype}): the checkpoint and config.json's "
                         "quantization_config (its modules_to_not_convert) disagree; remove the stray scale, or fix "
                         "the quantization_config.")


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
                        ) -> Iterator[tuple[str, str, torch.dtype | None, tuple[int, ...],
                                            Callable[[], torch.Tensor]]]:
    """(where, tensor name, its dtype (None: one this package has no name for), its shape, a call that reads its
    values) of every checkpoint tensor: the given state dict's, else the safetensors files' (headers read and
    validated; values only when asked)."""
    if state_dict is not None:
        for name, tensor in state_dict.items():
            if isinstance(tensor, torch.Tensor):
                yield "state_dict", name, tensor.dtype, tuple(tensor.shape), lambda tensor=tensor: tensor.detach()
        return
    for path in checkpoint_files or []:
        if not str(path).endswith(".safetensors"):
            continue
        try:
            with safe_open(path, framework="pt") as handle:
                names = handle.keys()  # (a safetensors handle: its keys() lists the tensors)
                for name in names:
                    header = handle.get_slice(name)
                    # (a dtype this package has no name for: None, refused only where it loads into a parameter)
                    yield (os.path.basename(path), name, DTYPES.get(header.get_dtype()), tuple(header.get_shape()),
                           lambda handle=handle, name=name: handle.get_tensor(name))
        except SafetensorError as error:  # (safetensors' own words: the header or the file's size)
            raise ValueError(f"{path} is not a valid safetensors file ({error}); the file is truncated or corrupt: "
                             "copy or export the checkpoint again.") from None


__all__ = ["check_checkpoint_dtypes"]

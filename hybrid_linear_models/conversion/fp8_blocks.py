"""Fine-grained (block-scaled) FP8 checkpoints, as Qwen3-Next's released FP8 build stores them.

config.json's `quantization_config` is `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk],
"activation_scheme": "dynamic", "modules_to_not_convert": [...]}`. A quantized linear weight W (..., out, in) is
stored as `<name>.weight` in float8_e4m3fn beside `<name>.weight_scale_inv` of shape [..., ceil(out/bn), ceil(in/bk)]
(float32 as released; bfloat16 and float16 read too): one scale per bn x bk block, the last row and column of blocks
possibly partial. The real weight is

    W[r, c] = W_fp8[r, c] * scale_inv[r // bn, c // bk]

(transformers' finegrained FP8 integration reads the same layout and formula). An e4m3 value has 4 significant bits
and a float32 scale 24, so their product has at most 28 and is exact in float64: `dequantize_block_fp8` multiplies in
float64 and rounds once, to the target dtype (a float32 product would round twice on the way to bfloat16).

Weights the config leaves out (embeddings, norms, routers, GDN's small tensors) are stored in bf16 without a scale. A
scale is checked against the FP8 weight it belongs to: an FP8 weight without its scale, a scale without an FP8
weight, a scale of the wrong shape, or one whose values are not all finite and positive is refused before anything
is written. The stored FP8 weights must be exactly those of the modules the quantization_config quantizes
(`fp8_settings`: every Linear and the experts, less modules_to_not_convert), the layers the model builds in FP8.

A reader of an FP8 folder returns it as stored (`checked_fp8_source`): its config carries the setting, so the
canonical layout holds each quantized weight in FP8 beside its `*_scale_inv`, and the name maps move both. Then the
conversion either keeps FP8 (`kept_fp8_source`: the weights and scales travel byte for byte, never cast by --dtype,
to a format that holds them) or dequantizes (`dequantized_source`: each FP8 weight read as its bfloat16 weight, the
scales consumed, the setting dropped). Joining experts is blockwise only: gate and up (I rows each) stack into
gate_up_proj's scales only when I is a multiple of the block rows, else a block would span both; refused by name.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..configuration_hybrid_linear import HybridLinearConfig
from ..fp8_settings import (
    QUANTIZATION_KEY,
    SCALE_SUFFIX,
    BlockFp8Settings,
    read_block_fp8_settings,
)
from ..kernels_fp8 import (
    SCALE_DTYPES,
    dequantize_block_fp8,
    first_bad_scale,
    scale_shape,
)
from .converters import StackedExperts
from .errors import ConversionError
from .hf_layout import hf_tensor_shapes
from .name_maps import MapRow
from .pipeline import SourceCheckpoint
from .safetensors_io import TensorInfo
from .untrusted import brief

# float32 as released; bfloat16 and float16 scales (some exports) are exact in float64 as well
FP8_FORMATS = ("hf", "qwen3_next")  # the formats whose writers keep FP8 weights with their scales


@dataclass(frozen=True)
class BlockFp8Config:
    """A checked FP8 quantization_config: the stored FP8 dtype and the (rows, columns) of one scale's block."""

    dtype: torch.dtype
    block: tuple[int, int]


def read_block_fp8_config(data: Mapping[str, Any], label: str) -> BlockFp8Config | None:
    """config.json's (parsed) quantization_config, checked (`fp8_settings`); None when the checkpoint is not
    quantized."""
    try:
        settings = read_block_fp8_settings(data.get(QUANTIZATION_KEY))
    except ValueError as error:
        raise ConversionError(f"{label}: {error}") from None
    return None if settings is None else block_fp8_config(settings)


def block_fp8_config(settings: BlockFp8Settings) -> BlockFp8Config:
    return BlockFp8Config(getattr(torch, settings.dtype_name), settings.block)


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def check_block_scales(infos: Mapping[str, TensorInfo], config: BlockFp8Config, where: str) -> list[str]:
    """Checks the stored tensors' FP8 weights against their scales (shapes and dtypes only: headers) and returns the
    names of the FP8 weights. Raises one line for the first problem, naming the tensor."""
    quantized = []
    for name, info in infos.items():
        if name.endswith(SCALE_SUFFIX):
            weight = infos.get(name.removesuffix(SCALE_SUFFIX))
            if weight is None or not _is_fp8(weight.dtype):
                what = "not stored" if weight is None else f"stored in {_name(weight.dtype)}, not FP8"
                raise ConversionError(f"{where}: tensor {brief(name)} is a scale, but its weight "
                                      f"{brief(name.removesuffix(SCALE_SUFFIX))} is {what}; remove the stray scale "
                                      "or restore the FP8 weight.")
            continue
        if not _is_fp8(info.dtype):
            continue
        if info.dtype != config.dtype:
            raise ConversionError(f"{where}: tensor {brief(name)} is {_name(info.dtype)}, but quantization_config "
                                  f"says {_name(config.dtype)}; the checkpoint is corrupt.")
        if len(info.shape) < 2:
            raise ConversionError(f"{where}: FP8 tensor {brief(name)} has shape {list(info.shape)}; block-scaled "
                                  "FP8 weights are matrices (out, in), or stacks of them.")
        expected = scale_shape(info.shape, config.block)
        scale = infos.get(scale_name(name))
        if scale is None:
            raise ConversionError(f"{where}: FP8 tensor {brief(name)} has no scale {brief(scale_name(name))} "
                                  f"(float32, shape {list(expected)}); the checkpoint is incomplete.")
        if tuple(scale.shape) != expected or scale.dtype not in SCALE_DTYPES:
            raise ConversionError(
                f"{where}: scale {brief(scale_name(name))} is {_name(scale.dtype)} of shape {list(scale.shape)}, but "
                f"FP8 weight {list(info.shape)} in {list(config.block)} blocks needs float32 of shape "
                f"{list(expected)}; the checkpoint is corrupt or its weight_block_size is wrong.")
        quantized.append(name)
    return quantized


def check_scale_values(name: str, scale_inv: torch.Tensor) -> None:
    """Every scale finite and positive (`kernels_fp8.first_bad_scale`)."""
    bad = first_bad_scale(scale_inv)
    if bad is not None:
        index, value = bad
        raise ConversionError(f"scale {brief(name)} holds {value:g} at block {index}; scales are finite and "
                              "positive, so the checkpoint is corrupt.")


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _fp8_weights(source: SourceCheckpoint) -> list[str]:
    """The names of the source's stored FP8 tensors (its quantized weights, carried ones included)."""
    return [key for key in source.tensors.keys() if _is_fp8(source.tensors.info(key).dtype)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DequantizedTensors:
    """A `TensorSource` over `tensors` in which each FP8 weight reads as its dequantized `dtype` weight and the scales
    are consumed (not listed)."""

    def __init__(self, tensors: Any, quantized: list[str], block: tuple[int, int], dtype: torch.dtype):
        self._tensors, self._quantized, self._block, self._dtype = tensors, set(quantized), block, dtype

    def keys(self) -> list[str]:
        scales = {scale_name(name) for name in self._quantized}
        return [key for key in self._tensors.keys() if key not in scales]

    def info(self, key: str) -> TensorInfo:
        info = self._tensors.info(key)
        return TensorInfo(info.shape, self._dtype) if key in self._quantized else info

    def load(self, key: str) -> torch.Tensor:
        if key not in self._quantized:
            return self._tensors.load(key)
        scale = self._tensors.load(scale_name(key))
        check_scale_values(scale_name(key), scale)
        return dequantize_block_fp8(self._tensors.load(key), scale, self._block, self._dtype)


def _scale_rows(rows: list[MapRow]) -> list[MapRow]:
    return [row for row in rows if row.canonical_keys[0].endswith(SCALE_SUFFIX)]


def _check_matches_config(source: SourceCheckpoint, quantized: list[str]) -> None:
    """The stored FP8 weights (`quantized`, the carried ones aside) are exactly those the config's setting quantizes,
    the FP8 layers the model builds: one line naming the first that is not."""
    carried = set(source.carried.keys) if source.carried is not None else set()
    expected = {key.removesuffix(SCALE_SUFFIX) for row in _scale_rows(source.rows) for key in row.format_keys}
    stored = set(quantized) - carried
    for name in sorted(stored - expected):
        raise ConversionError(f"{source.path}: tensor {brief(name)} is FP8, but the quantization_config keeps its "
                              "module in floating point (an entry of modules_to_not_convert matches it, or it is not "
                              "a Linear or experts); fix modules_to_not_convert or the checkpoint.")
    for name in sorted(expected - stored):
        dtype = str(source.tensors.info(name).dtype).removeprefix("torch.") if name in source.tensors.keys() else ""
        raise ConversionError(f"{source.path}: tensor {brief(name)} is {dtype or 'not stored'}, but the "
                              "quantization_config quantizes its module (no entry of modules_to_not_convert matches "
                              "it), so it must be FP8 with its scale; add the module to modules_to_not_convert.")


def checked_fp8_source(source: SourceCheckpoint) -> SourceCheckpoint:
    """`source` as a reader returns it: unchanged when its config has no FP8 setting, else with every scale checked
    against its FP8 weight (headers, then values: the scales are small) and marked `quantization="fp8"`. Raises one
    line for the first problem, before anything is written."""
    settings = source.config.block_fp8_settings
    if settings is None:
        return source
    infos = {key: source.tensors.info(key) for key in source.tensors.keys()}
    quantized = check_block_scales(infos, block_fp8_config(settings), str(source.path))
    for name in quantized:
        check_scale_values(scale_name(name), source.tensors.load(scale_name(name)))
    return dataclasses.replace(source, quantization="fp8")


def _check_blockwise_joins(rows: list[MapRow], shapes: Mapping[str, tuple[int, ...]], block: tuple[int, int],
                           where: str, joined: str) -> None:
    """Experts whose gate and up (I rows each) are stored apart on one side and as gate_up_proj on the other: their
    scales join (or split) blockwise only when I is a multiple of the block rows."""
    for row in _scale_rows(rows):
        converter = row.converter
        if not (isinstance(converter, StackedExperts) and converter.parts > 1):
            continue
        weight = row.canonical_keys[0].removesuffix(SCALE_SUFFIX)
        part_rows = shapes[weight][-2] // converter.parts
        if part_rows % block[0]:
            raise ConversionError(
                f"{where}: the FP8 experts {brief(weight)} have gate and up projections of {part_rows} rows each in "
                f"{block[0]}-row scale blocks; {part_rows} is not a multiple of {block[0]}, so a block would span "
                f"the gate and the up rows and their scales cannot be {joined} blockwise; convert with "
                "--dequantize-fp8.")


def kept_fp8_source(source: SourceCheckpoint, to_format: str,
                    target_rows: Callable[[HybridLinearConfig], list[MapRow]]) -> SourceCheckpoint:
    """An FP8 `source` converting with its FP8 weights and scales kept: refused, with one line, where `to_format`
    cannot hold them, the stored FP8 weights are not those the setting quantizes (the layers the model builds in
    FP8), or the experts cannot be joined or split blockwise (`target_rows`: the writer's name map)."""
    if to_format not in FP8_FORMATS:
        raise ConversionError(f"{source.path} holds FP8 weights, which the {to_format} format cannot hold (FP8 is "
                              f"kept by {' and '.join(FP8_FORMATS)}); pass --dequantize-fp8 to convert them to "
                              "bfloat16.")
    quantized = _fp8_weights(source)
    _check_matches_config(source, quantized)
    shapes = hf_tensor_shapes(source.config)
    block = source.config.block_fp8_settings.block
    _check_blockwise_joins(source.rows, shapes, block, str(source.path), "joined into gate_up_proj")
    _check_blockwise_joins(target_rows(source.config), shapes, block, f"--to {to_format}", "split out of gate_up_proj")
    return source


def dequantized_source(source: SourceCheckpoint, dtype: torch.dtype | None = None) -> SourceCheckpoint:
    """An FP8 `source` read as the floating-point model: each FP8 weight (carried ones too) dequantized to `dtype`
    (bfloat16 by default; the exact product rounded once, not through bfloat16 on the way to float32), the scales
    consumed, and the config without its FP8 setting."""
    settings = source.config.block_fp8_settings
    quantized = _fp8_weights(source)
    scales = {scale_name(name) for name in quantized}
    config = copy.deepcopy(source.config)
    config.block_fp8 = None
    carried = source.carried
    if carried is not None:
        carried = dataclasses.replace(carried, keys=tuple(key for key in carried.keys if key not in scales))
    rows = [row for row in source.rows if not row.canonical_keys[0].endswith(SCALE_SUFFIX)]
    tensors = DequantizedTensors(source.tensors, quantized, settings.block, dtype or torch.bfloat16)
    return dataclasses.replace(source, config=config, rows=rows, carried=carried, tensors=tensors, quantization=None)


__all__ = ["FP8_FORMATS", "QUANTIZATION_KEY", "SCALE_SUFFIX", "BlockFp8Config", "DequantizedTensors",
           "check_block_scales", "check_scale_values", "checked_fp8_source", "dequantize_block_fp8",
           "dequantized_source", "kept_fp8_source", "read_block_fp8_config", "scale_name", "scale_shape"]

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
is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels_fp8 import dequantize_block_fp8
from .errors import ConversionError
from .safetensors_io import TensorInfo
from .untrusted import Fields, brief

QUANTIZATION_KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight_scale_inv` beside `<name>.weight`
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn}
# float32 as released; bfloat16 and float16 scales (some exports) are exact in float64 as well
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_RUNS = 'quant_method "fp8", fmt "e4m3", a weight_block_size of two positive integers, activation_scheme "dynamic"'


@dataclass(frozen=True)
class BlockFp8Config:
    """A checked FP8 quantization_config: the stored FP8 dtype and the (rows, columns) of one scale's block."""

    dtype: torch.dtype
    block: tuple[int, int]


def _unsupported(label: str, setting: str, value: Any) -> ConversionError:
    return ConversionError(f"{label}: {QUANTIZATION_KEY}.{setting} is {brief(value)}; this package runs FP8 "
                           f"checkpoints with {_RUNS}.")


def read_block_fp8_config(data: Mapping[str, Any], label: str) -> BlockFp8Config | None:
    """config.json's (parsed) quantization_config, checked; None when the checkpoint is not quantized."""
    if data.get(QUANTIZATION_KEY) is None:
        return None
    fields = Fields(data[QUANTIZATION_KEY], QUANTIZATION_KEY, label, missing_is_empty=False)
    method = fields.get("quant_method")
    if method != "fp8":
        raise _unsupported(label, "quant_method", method)
    fmt = fields.get("fmt", "e4m3")
    if fmt not in FP8_DTYPES:
        raise _unsupported(label, "fmt", fmt)
    block = fields.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise _unsupported(label, "weight_block_size", block)
    scheme = fields.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _unsupported(label, "activation_scheme", scheme)
    scale_fmt = fields.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise _unsupported(label, "scale_fmt", scale_fmt)
    return BlockFp8Config(FP8_DTYPES[fmt], (block[0], block[1]))


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight (..., out, in) (fused experts lead with their count): one entry per
    block of the last two dimensions, partial blocks included."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


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
    """Every scale finite and positive: a zero, negative, inf or NaN scale makes no real weight."""
    bad = ~(torch.isfinite(scale_inv) & (scale_inv > 0))
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise ConversionError(f"scale {brief(name)} holds {scale_inv[tuple(index)].item():g} at block {index}; "
                              "scales are finite and positive, so the checkpoint is corrupt.")


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


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


__all__ = ["QUANTIZATION_KEY", "BlockFp8Config", "DequantizedTensors", "check_block_scales", "check_scale_values",
           "dequantize_block_fp8", "read_block_fp8_config", "scale_name", "scale_shape"]

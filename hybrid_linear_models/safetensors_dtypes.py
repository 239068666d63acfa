"""safetensors' dtype names and the torch dtypes they hold: the one table the converter's reader and writer
(`conversion.safetensors_io`) and `from_pretrained`'s shard reads (`streamed_loading`) share."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

__all__ = ["DTYPES"]

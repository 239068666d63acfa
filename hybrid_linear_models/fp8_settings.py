"""The block-scaled FP8 setting of a model: config.json's `quantization_config`, checked, and which modules it
quantizes.

The setting is the one Qwen3-Next's released FP8 build carries, and transformers' "fp8" quant_method reads:

    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk], "activation_scheme": "dynamic",
     "modules_to_not_convert": [...]}

A quantized weight W (out, in) is stored as float8_e4m3fn beside a float32 `weight_scale_inv` with one entry per
bn x bk block (`kernels_fp8`). Which modules are quantized follows transformers' rule (its FineGrainedFP8 quantizer):
every plain `nn.Linear` and every experts module (a module named `...experts`), except those a
`modules_to_not_convert` entry matches. An entry matches a module name (this family's checkpoint names,
`model.layers.3.mlp.gate`, `lm_head`)

- from the start, ending at a name boundary ("model.layers.1" matches "model.layers.1.mlp", not "model.layers.11"),
- as a regular expression with the same boundary ("model.layers.*.mlp.gate" matches "model.layers.7.mlp.gate", and
  "mlp.gate" does not match "mlp.gate_proj"), or
- as a suffix ("shared_expert_gate" matches "model.layers.0.mlp.shared_expert_gate").

Everything else (embeddings, norms, routers, GDN's A_log / dt_bias / conv1d) is never a Linear and stays in the
checkpoint's float dtype. The converter checks the stored tensors against this rule, so a folder the model loads
holds FP8 exactly where the model builds FP8 layers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .shown_values import brief

QUANTIZATION_KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"  # a quantized weight `<name>` has its scales in `<name>_scale_inv`
FP8_DTYPES = {"e4m3": "float8_e4m3fn"}  # torch dtype names (this module imports no torch: the config reads it)
SUPPORTED = 'quant_method "fp8", fmt "e4m3", a weight_block_size of two positive integers, activation_scheme "dynamic"'
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True)
class BlockFp8Settings:
    """A checked quantization_config: the stored FP8 dtype's torch name, the (rows, columns) of one scale's block,
    the module names (or patterns) kept unquantized, and the mapping as given (written back unchanged)."""

    dtype_name: str
    block: tuple[int, int]
    modules_to_not_convert: tuple[str, ...]
    fields: dict[str, Any]

    def quantizes(self, module_name: str) -> bool:
        """Whether a quantizable module (a Linear, or experts) of this name is stored in FP8 (transformers' rule)."""
        return not any(_matches(pattern, module_name) for pattern in self.modules_to_not_convert)


def _matches(pattern: str, name: str) -> bool:
    if name.endswith(pattern):
        return True
    try:
        return re.match(rf"(?:{pattern}){_BOUNDARY}", name) is not None
    except re.error:  # not a regular expression: a plain name, matched from the start
        return name == pattern or name.startswith(pattern + ".")


def _unsupported(setting: str, value: Any) -> ValueError:
    return ValueError(f"{QUANTIZATION_KEY}.{setting} is {brief(value, 80)}; this package runs FP8 checkpoints with "
                      f"{SUPPORTED}.")


def read_block_fp8_settings(fields: Any) -> BlockFp8Settings | None:
    """config.json's quantization_config (parsed) checked, or None when absent. Raises one ValueError line naming
    the first unsupported setting."""
    if fields is None:
        return None
    if not isinstance(fields, Mapping):  # ValueError, as for every bad setting: the config's one error type
        raise ValueError(f"{QUANTIZATION_KEY} is {type(fields).__name__}, not a mapping; this package "  # noqa: TRY004
                         f"runs FP8 checkpoints with {SUPPORTED}.")
    method = fields.get("quant_method")
    if method != "fp8":
        raise _unsupported("quant_method", method)
    fmt = fields.get("fmt", "e4m3")
    if fmt not in FP8_DTYPES:
        raise _unsupported("fmt", fmt)
    block = fields.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise _unsupported("weight_block_size", block)
    scheme = fields.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _unsupported("activation_scheme", scheme)
    scale_fmt = fields.get("scale_fmt", "float")
    if scale_fmt not in ("float", None):
        raise _unsupported("scale_fmt", scale_fmt)
    skipped = fields.get("modules_to_not_convert") or []
    if not (isinstance(skipped, list | tuple) and all(isinstance(name, str) and name for name in skipped)):
        raise _unsupported("modules_to_not_convert", skipped)
    if fields.get("modules_to_convert"):
        raise _unsupported("modules_to_convert", fields.get("modules_to_convert"))
    return BlockFp8Settings(FP8_DTYPES[fmt], (block[0], block[1]), tuple(skipped), dict(fields))


def check_requested_quantization(requested: Any) -> None:
    """`from_pretrained(..., quantization_config=...)` with an FP8 config (transformers' FineGrainedFP8Config, or a
    dict of quant_method "fp8"): one ValueError line. This family runs a checkpoint's FP8 layout with its own kernels
    from config.json's quantization_config; a requested one would hand the model to transformers' FP8 quantizer (a
    kernel fetched from the Hub, a GPU) or, with dequantize=True, be ignored. Other methods are transformers'."""
    method = requested.get("quant_method") if isinstance(requested, Mapping) else getattr(requested, "quant_method",
                                                                                        None)
    if str(getattr(method, "value", method)).lower() != "fp8":
        return
    raise ValueError("from_pretrained(quantization_config=<fp8>): this family runs FP8 checkpoints with its own "
                     "kernels, from the quantization_config in config.json; leave the argument out (an FP8 "
                     "checkpoint's weights load as they are; a bfloat16 one is not quantized on the fly), or for "
                     "bfloat16 weights of an FP8 checkpoint convert it with hybrid-linear-convert --dequantize-fp8.")


__all__ = ["QUANTIZATION_KEY", "SCALE_SUFFIX", "BlockFp8Settings", "check_requested_quantization",
           "read_block_fp8_settings"]

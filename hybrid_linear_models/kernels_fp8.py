"""Linear layers on block-scaled FP8 weights (the layout of Qwen3-Next's released FP8 build): the plain reference.

A weight W (out, in) is stored as W_fp8 in float8_e4m3fn with one float32 `scale_inv` per bn x bk block (shape
[ceil(out/bn), ceil(in/bk)], the last row and column of blocks possibly partial):

    W[r, c] = W_fp8[r, c] * scale_inv[r // bn, c // bk]

An e4m3 value has 4 significant bits and a float32 scale 24, so their product is exact in float64:
`dequantize_block_fp8` multiplies in float64 and rounds once, to the target dtype.

`block_fp8_linear` (x @ W.T) and `block_fp8_grouped_linear` (the experts: rows of expert e times W_e.T) are the
entry points the model's FP8 layers call. Here they dequantize and run the dense op: what the CPU runs, and the
reference a fast kernel is checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The real weight of an FP8 `weight` (..., out, in) with its per-block `scale_inv` (block: rows, columns), exact
    and rounded once to `dtype`."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float64)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float64) * scale).to(dtype)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W.T (+ bias) in x's dtype, W the real weight of the FP8 `weight` (out, in) and `scale_inv`."""
    return F.linear(x, dequantize_block_fp8(weight, scale_inv, block, x.dtype), bias)


def block_fp8_grouped_linear(rows: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                             offsets: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """rows [S, in] @ W_e.T for the rows of each expert e, W (E, out, in) FP8 with `scale_inv` (E, ...); `offsets`
    [E] the cumulative end row of each expert's rows (torch's grouped_mm convention: expert e owns rows
    offsets[e-1]:offsets[e])."""
    out = rows.new_empty(rows.shape[0], weight.shape[-2])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = block_fp8_linear(rows[start:end], weight[expert], scale_inv[expert], block)
        start = end
    return out


__all__ = ["block_fp8_grouped_linear", "block_fp8_linear", "dequantize_block_fp8"]

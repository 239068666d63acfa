"""Triton RMSNorms for decoding steps: the block norm (with the pre-norm block's residual add), one program a row,

    s = x + residual (float32),  y = s / sqrt(mean(s^2) + eps) * w,  returned as (y, s) in x's and residual's dtypes

the math and roundings of fla's `layer_norm_fwd_kernel_row` (which the eager path runs): the sum kept in float32 for
the norm, rounded once for the residual stream. The difference is when the weight is read: fla's kernel loads w after
the row's reduction (its PTX: the weight's loads follow the reduction's barrier), so a decoding step's norm, a few
microseconds of latency and nothing else at batch 1, waits for two memory round trips (x and residual, then w from
HBM, where the previous step left it); here w is loaded with x and residual, one round trip. No mean or rstd is
stored (no backward in a decoding step). With programmatic dependent launch (`kernels_launch_triton`) the weight is
read before the wait for the kernel ahead, whose output x is.

The GDN/KDA output norm, per head, y = x / sqrt(mean(x^2) + eps) * w * act(g) with act silu or sigmoid, fla's
`layer_norm_gated_fwd_kernel` math (`_gated_rms_norm_kernel`): on its own, loading w with the row is at parity with
fla's kernel; its gain is the dependent launch, which fla's kernel does not take part in: it lets the output projection's GEMV after it start early and load its
weight while the norm runs.

Imported only for CUDA tensors (`decode_norm`), since importing triton needs a GPU driver.
"""

from __future__ import annotations

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton RMSNorm needs triton (a CUDA machine); decoding norms run through fla") from error

from .kernels_launch_triton import await_previous_kernel, dependent_launch


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, D, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK_D)
    inside = d < D
    # the weight before the row (see the module docstring); with PDL, while the kernel ahead finishes
    w = tl.load(w_ptr + d, mask=inside, other=0.0)
    await_previous_kernel(PDL)
    s = tl.load(x_ptr + row + d, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + row + d, mask=inside, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row + d, s.to(res_out_ptr.dtype.element_ty), mask=inside)
    rstd = 1 / tl.sqrt(tl.sum(s * s, axis=0) / D + eps)
    tl.store(y_ptr + row + d, (s * rstd * w.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=inside)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [rows, D] and residual (same shape) contiguous, weight [D]: y, or (y, x + residual) with a residual (see the
    module docstring)."""
    rows, width = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(residual) if residual is not None else y
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, y, res_out, width, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK_D=block,
                              num_warps=min(max(block // 512, 1), 8), **dependent_launch(x.device))
    return y if residual is None else (y, res_out)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, T, D, heads, stride_xo, stride_xh, stride_go, stride_gh, eps,
                           SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """BLOCK_T rows of the GDN/KDA output norm, row r = (r // heads, r % heads) at those two strides: fla's
    `layer_norm_gated_fwd_kernel` math (float32 x * rstd * w, times g * sigmoid(g) or sigmoid(g), rounded once)."""
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    inside = (r < T)[:, None] & (d < D)[None, :]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)  # (before the wait: no kernel of the step writes it)
    await_previous_kernel(PDL)
    outer, head = (r // heads).to(tl.int64), (r % heads).to(tl.int64)
    x = tl.load(x_ptr + (outer * stride_xo + head * stride_xh)[:, None] + d[None, :], mask=inside,
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (outer * stride_go + head * stride_gh)[:, None] + d[None, :], mask=inside,
                other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    y = y * g * tl.sigmoid(g) if SILU else y * tl.sigmoid(g)
    tl.store(y_ptr + r[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)


def triton_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          silu: bool) -> torch.Tensor:
    """x and gate [outer, heads, D], each with a unit stride along D (any outer and head strides), weight [D]: the
    gated norm [outer, heads, D] in x's dtype, contiguous (see `_gated_rms_norm_kernel`)."""
    outer, heads, width = x.shape
    y = torch.empty(outer, heads, width, device=x.device, dtype=x.dtype)
    rows, block = outer * heads, triton.next_power_of_2(width)
    block_rows = max(1, min(triton.next_power_of_2(rows), 4096 // block))  # up to 4,096 elements a program
    _gated_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x, gate, weight, y, rows, width, heads, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), eps,
        SILU=silu, BLOCK_T=block_rows, BLOCK_D=block, num_warps=4, **dependent_launch(x.device))
    return y

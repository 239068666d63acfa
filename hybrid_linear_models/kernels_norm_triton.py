"""A Triton RMSNorm (with the pre-norm block's residual add) for decoding steps: one program a row,

    s = x + residual (float32),  y = s / sqrt(mean(s^2) + eps) * w,  returned as (y, s) in x's and residual's dtypes

the math and roundings of fla's `layer_norm_fwd_kernel_row` (which the eager path runs): the sum kept in float32 for
the norm, rounded once for the residual stream. The difference is when the weight is read: fla's kernel loads w after
the row's reduction (its PTX: the weight's loads follow the reduction's barrier), so a decoding step's norm, a few
microseconds of latency and nothing else at batch 1, waits for two memory round trips (x and residual, then w from
HBM, where the previous step left it); here w is loaded with x and residual, one round trip. No mean or rstd is
stored (no backward in a decoding step). With programmatic dependent launch (`kernels_launch_triton`) the weight is
read before the wait for the kernel ahead, whose output x is. (The same change to the GDN/KDA output norm, fla's
`layer_norm_gated_fwd_kernel`, measured at parity on an H200: 30.5 against 29.4 us a step for the GDN model's 12;
not kept.)

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


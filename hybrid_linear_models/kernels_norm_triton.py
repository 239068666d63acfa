"""Triton norms of inference (no gradient wanted), for any number of rows: the block RMSNorm (with the pre-norm block's
residual add), the GDN/KDA gated output norm, and the delta rules' q/k L2 norm.

Each kernel is compiled for a width, dtypes and flags only. The row count is a runtime argument (not specialised:
`do_not_specialize`) and the grid is computed from it, and a program takes a fixed block of rows, `rows_per_program`:
as many as fill `ROW_BLOCK_ELEMENTS` elements (a 128-wide head norm over 1M tokens x 32 heads is 2M programs of 16
rows, not 32M one-row programs), one row for rows of that width or wider. fla's forward kernels for rows of up to 512
elements (`layer_norm_fwd_kernel`, `layer_norm_gated_fwd_kernel`, `l2norm_fwd_kernel`) take NB = cdiv(rows, 2048)
(or cdiv(rows, 65536)) as a constexpr that is also an autotuning key, so every new bucket of row counts compiles and
benchmarks every configuration again (seconds each, and a prompt of a million tokens has hundreds of buckets); these
do not tune, and nothing of theirs depends on the number of rows.

The block norm, s = x + residual (float32),  y = s / sqrt(mean(s^2) + eps) * w,  returned as (y, s) in x's and
residual's dtypes: the math and roundings of fla's `layer_norm_fwd_kernel_row` (the sum kept in float32 for the norm,
rounded once for the residual stream). The difference is when the weight is read: fla's kernel loads w after the
row's reduction (its PTX: the weight's loads follow the reduction's barrier), so a decoding step's norm, a few
microseconds of latency and nothing else at batch 1, waits for two memory round trips (x and residual, then w from
HBM, where the previous step left it); here w is loaded with x and residual, one round trip. No mean or rstd is
stored (no backward). With programmatic dependent launch (`kernels_launch_triton`) the weight is read before the wait
for the kernel ahead, whose output x is.

The GDN/KDA output norm, per head, y = x / sqrt(mean(x^2) + eps) * w * act(g) with act silu or sigmoid, fla's
`layer_norm_gated_fwd_kernel` math (`_gated_rms_norm_kernel`): on its own, loading w with the row is at parity with
fla's kernel; in a decoding step its gain is the dependent launch, which fla's kernel does not take part in: it lets
the output projection's GEMV after it start early and load its weight while the norm runs. At batch 1 one program
takes the 32 heads of 128 of the GDN benchmark model.

The L2 norm, y = x * 1 / sqrt(sum(x^2) + eps) in float32, rounded to x's dtype once: fla's `l2norm_fwd_kernel` math,
which its `chunk_*` kernels run on q and k with `use_qk_l2norm_in_kernel` (eps 1e-6, its default). Launched plainly:
it reads no weight worth starting early for.

Imported only for CUDA tensors (`inference_norm`), since importing triton needs a GPU driver.
"""

from __future__ import annotations

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton norms need triton (a CUDA machine); the norms run through fla") from error

from .kernels_launch_triton import await_previous_kernel, dependent_launch

# Elements a program takes: rows narrower than this share a program (see the module docstring). At 4,096 the GDN
# benchmark model's 32 output-norm heads of 128 are one program at batch 1, and a block norm of 2,048 or more is one
# row a program, as fla's row kernel and the decoding step's measured norm have it.
ROW_BLOCK_ELEMENTS = {"rms": 2048, "gated": 4096, "l2": 4096}


def rows_per_program(kind: str, block_d: int) -> int:
    """Rows a program of the `kind` kernel takes for rows of `block_d` (a power of two) elements: a function of the
    width alone."""
    return max(1, ROW_BLOCK_ELEMENTS[kind] // block_d)


def _num_warps(block_t: int, block_d: int) -> int:
    """The block norm's warps: 4 for a block of 2,048 elements, 1 to 8 in proportion (the gated and L2 norms take 4
    for their 4,096)."""
    return min(max(block_t * block_d // 512, 1), 8)


def _stride(t: torch.Tensor, dim: int) -> int:
    """t's stride along `dim`, 0 where that dimension has one element: its stride is then arbitrary (torch gives a
    view's size-1 dimensions strides of its own making), and 0, a multiple of 16 as the models' row strides are,
    keeps one row on the specialisation of many."""
    return t.stride(dim) if t.shape[dim] > 1 else 0


@triton.jit(do_not_specialize=["T"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, T, D, stride_x, stride_res, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    """BLOCK_T rows of the block norm (the module docstring), x and the residual at their row strides, the outputs
    contiguous."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    inside = (r < T)[:, None] & (d < D)[None, :]
    # the weight before the rows (see the module docstring); with PDL, while the kernel ahead finishes
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    await_previous_kernel(PDL)
    s = tl.load(x_ptr + r[:, None] * stride_x + d[None, :], mask=inside, other=0.0).to(tl.float32)
    out = r[:, None] * D + d[None, :]
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + r[:, None] * stride_res + d[None, :], mask=inside, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + out, s.to(res_out_ptr.dtype.element_ty), mask=inside)
    rstd = 1 / tl.sqrt(tl.sum(s * s, axis=1) / D + eps)
    tl.store(y_ptr + out, (s * rstd[:, None] * w.to(tl.float32)[None, :]).to(y_ptr.dtype.element_ty), mask=inside)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [rows, D] and residual (same shape), each with a unit stride along D (any row stride), weight [D]: y, or
    (y, x + residual) with a residual, contiguous (see the module docstring)."""
    rows, width = x.shape
    y = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    res_out = torch.empty(rows, width, device=x.device, dtype=residual.dtype) if residual is not None else y
    if rows == 0:
        return y if residual is None else (y, res_out)
    block = triton.next_power_of_2(width)
    block_rows = rows_per_program("rms", block)
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x, res, weight, y, res_out, rows, width, _stride(x, 0), _stride(res, 0), eps, HAS_RESIDUAL=residual is not None,
        BLOCK_T=block_rows, BLOCK_D=block, num_warps=_num_warps(block_rows, block), **dependent_launch(x.device))
    return y if residual is None else (y, res_out)


@triton.jit(do_not_specialize=["T"])
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, T, D, heads, stride_xo, stride_xh, stride_go, stride_gh, eps,
                           SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """BLOCK_T rows of the GDN/KDA output norm, row r = (r // heads, r % heads) at those two strides: fla's
    `layer_norm_gated_fwd_kernel` math (float32 x * rstd * w, times g * sigmoid(g) or sigmoid(g), rounded once)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    inside = (r < T)[:, None] & (d < D)[None, :]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)  # (before the wait: no kernel of the step writes it)
    await_previous_kernel(PDL)
    outer, head = r // heads, r % heads
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
    if rows == 0:
        return y
    block_rows = rows_per_program("gated", block)
    _gated_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x, gate, weight, y, rows, width, heads, _stride(x, 0), _stride(x, 1), _stride(gate, 0), _stride(gate, 1), eps, SILU=silu,
        BLOCK_T=block_rows, BLOCK_D=block, num_warps=4, **dependent_launch(x.device))
    return y


@triton.jit(do_not_specialize=["T"])
def _l2_normalize_kernel(x_ptr, y_ptr, T, D, heads, stride_xo, stride_xh, eps, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """BLOCK_T rows of the L2 norm, row r = (r // heads, r % heads) at those two strides: fla's `l2norm_fwd_kernel`
    math (float32 x * 1 / sqrt(sum(x^2) + eps), rounded once)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    inside = (r < T)[:, None] & (d < D)[None, :]
    outer, head = r // heads, r % heads
    x = tl.load(x_ptr + (outer * stride_xo + head * stride_xh)[:, None] + d[None, :], mask=inside,
                other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(y_ptr + r[:, None] * D + d[None, :], (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=inside)


def triton_l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [outer, heads, D] with a unit stride along D (any outer and head strides): x / sqrt(sum(x^2) + eps) over D,
    [outer, heads, D] in x's dtype, contiguous (see `_l2_normalize_kernel`)."""
    outer, heads, width = x.shape
    y = torch.empty(outer, heads, width, device=x.device, dtype=x.dtype)
    rows, block = outer * heads, triton.next_power_of_2(width)
    if rows == 0:
        return y
    block_rows = rows_per_program("l2", block)
    _l2_normalize_kernel[(triton.cdiv(rows, block_rows),)](
        x, y, rows, width, heads, _stride(x, 0), _stride(x, 1), eps, BLOCK_T=block_rows, BLOCK_D=block, num_warps=4)
    return y

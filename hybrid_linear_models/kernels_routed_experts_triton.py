"""A Triton GEMV for a decoding step's routed experts in bf16, fp16 or fp32: each (token, expert) route's row times its
expert's weight, with no sort, no gather and no host synchronisation (`experts_routed` dispatches to it).

    y[r] = x[r // R] @ W[routes[r]]^T          W [E, N, K]; R routes a row of x; float32 sums, rounded once

A program owns BLOCK_N output columns of one route (grid: column tiles x routes) and streams the K inputs of its
expert's rows in BLOCK_K slices into a [BLOCK_N, BLOCK_K] float32 tile of elementwise products, summed over K at the
end: the one-row GEMV form of `kernels_gemv_triton`, reading only the routed experts' weights. A route to an expert
outside 0..E-1 (expert parallelism's sentinel for another rank's expert) reads nothing and writes a row of zeros.
With `gated_by` (each route's routing weight, in any float dtype: rounded to x's first, as its cast would), x holds a
row per route, [gate | up] (2K wide), and each K slice of the input is computed as it is loaded, silu(gate) * up *
weight, each op rounded to x's dtype as the experts' torch ops round (`kernels_moe_triton.swiglu_input`, which the
FP8 kernel's routed down projection shares): the down projection then needs no elementwise kernel before it, nor the
routing weights a cast.

The routes come from the routing kernel just before, so with programmatic dependent launch a program waits for it
first (`await_previous_kernel`) and only its launch overlaps. Configurations are autotuned per (N, K, gated) inside
`kernel_tuning.autotuning()` (`warm_up` enters it); elsewhere a call runs the first one. Imported only for CUDA
tensors, since importing triton needs a GPU driver.
"""

from __future__ import annotations

import inspect
import os

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the routed experts' Triton GEMV needs triton (a CUDA machine); the experts then run their "
                      "grouped torch path") from error

from .kernel_tuning import launch
from .kernels_launch_triton import await_previous_kernel, dependent_launch
from .kernels_moe_triton import swiglu_input

# (BLOCK_N, BLOCK_K, warps, stages): the one-row GEMV's configurations (kernels_gemv_triton); the first runs untuned
_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in ((2, 1024, 4, 1), (2, 2048, 4, 1), (4, 512, 4, 1), (4, 512, 4, 3), (8, 512, 4, 1),
                               (8, 256, 2, 1), (16, 256, 4, 1))]
_INTERPRETED_BLOCKS = (4, 16)  # triton's interpreter (tests on CPUs): one small configuration, no timing
_MAX_GRID_ROWS = 65535  # programs along the grid's second axis (routes)


# R (routes per row of x) only maps routes to rows: not specialised, so a new batch compiles nothing new
@triton.jit(do_not_specialize=["R"])
def _routed_experts_kernel(x_ptr, w_ptr, routes_ptr, rw_ptr, y_ptr, E, R, N, stride_xm, stride_we, stride_wn,
                           stride_ym, K: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    route = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_cols = cols < N
    await_previous_kernel(PDL)  # (the routes, and x, are the kernels ahead's outputs)
    expert = tl.load(routes_ptr + route).to(tl.int32)
    served = (expert >= 0) & (expert < E)  # (another rank's expert: a row of zeros)
    expert = tl.where(served, expert, 0)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + (route // R).to(tl.int64) * stride_xm
    if GATED:  # the route's weight rounded to the dtype (a float32 router's weights: as their cast rounds them)
        weight = tl.load(rw_ptr + route).to(y_ptr.dtype.element_ty).to(tl.float32)
    tile = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        live_k = (ks < K) & served
        w = tl.load(w_rows + ks[None, :], mask=live_cols[:, None] & live_k[None, :], other=0.0)
        x = tl.load(x_row + ks, mask=live_k, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(x_row + K + ks, mask=live_k, other=0.0).to(tl.float32)
            x = swiglu_input(x, up, weight, y_ptr.dtype.element_ty)
        tile += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + route.to(tl.int64) * stride_ym + cols, tl.sum(tile, axis=1).to(y_ptr.dtype.element_ty),
             mask=live_cols)


def _timed(kernel_call, quantiles):
    """triton's do_bench timing 25 ms of runs after 5 ms of warm-up (the kernels take microseconds)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _autotuned() -> triton.runtime.Autotuner:
    offered = inspect.signature(triton.autotune).parameters
    options = {name: value for name, value in (("do_bench", _timed), ("cache_results", True)) if name in offered}
    return triton.autotune(configs=_CONFIGS, key=["N", "K", "GATED"], **options)(_routed_experts_kernel)


_TUNED = _autotuned()
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_routed_experts(x: torch.Tensor, weight: torch.Tensor, routes: torch.Tensor,
                          gated_by: torch.Tensor | None = None,
                          blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """x [T, K] (or [S, 2K] with `gated_by` [S]: a [gate | up] row per route), weight [E, N, K], routes [S] (int32 /
    int64, S a multiple of T): [S, N] in x's dtype, row r = x[r // (S / T)] @ weight[routes[r]]^T (see the module
    docstring). x and weight in one dtype, each with unit stride along its last dim; gated_by contiguous, any float
    dtype. `blocks` (BLOCK_N, BLOCK_K) runs that configuration instead of the tuned one (tests)."""
    routes_count, (experts, out, inputs) = routes.shape[0], weight.shape
    if routes_count > _MAX_GRID_ROWS:
        raise ValueError(f"routed experts: {routes_count} routes, at most {_MAX_GRID_ROWS} (a kernel program row "
                         "each); sort more routes by expert")
    y = torch.empty(routes_count, out, device=x.device, dtype=x.dtype)
    if routes_count == 0 or out == 0:
        return y
    per_row = routes_count // max(x.shape[0], 1)
    args = (x, weight, routes, gated_by if gated_by is not None else x, y, experts, per_row, out, x.stride(0),
            weight.stride(0), weight.stride(1), y.stride(0))
    flags = {"K": inputs, "GATED": gated_by is not None, **dependent_launch(x.device)}
    if blocks is None and _INTERPRETED:
        blocks = _INTERPRETED_BLOCKS
    if blocks is not None:
        _routed_experts_kernel[(triton.cdiv(out, blocks[0]), routes_count)](*args, **flags, BLOCK_N=blocks[0],
                                                                            BLOCK_K=blocks[1])
        return y
    key = ("routed_experts", out, inputs, gated_by is not None)
    launch(_TUNED, _routed_experts_kernel, lambda meta: (triton.cdiv(out, meta["BLOCK_N"]), routes_count), key,
           _CONFIGS[0], args, flags)
    return y


__all__ = ["triton_routed_experts"]

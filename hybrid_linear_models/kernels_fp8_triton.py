"""Triton kernels for linear layers on block-scaled FP8 weights: y = x W^T (+ b), and the experts' grouped product.

W (out, in) is W_fp8 (float8_e4m3fn) with one float32 scale per BN x BK block (`kernels_fp8`'s layout):
W[r, c] = W_fp8[r, c] * scale_inv[r // BN, c // BK]. x is bf16, fp16 or fp32; sums are float32; the output is in x's
dtype. One kernel, four forms, each a program per (row tile, BLOCK_N output columns) streaming K in BLOCK_K slices,
so the FP8 weight is read once per row tile and nothing else is written:
- "one_row" (one row of x: batch-1 decoding, a GEMV): elementwise products in a [BLOCK_N, BLOCK_K] float32 tile,
  summed over K once at the end. No tensor cores, so BLOCK_N may be as small as 2: a 2,048-wide weight spreads over
  hundreds of programs, whose loads together keep enough bytes in flight to approach the memory bandwidth (the bytes
  read are out x in FP8 plus the scales). Each slice's scales multiply x's slice (one scale where the slice lies in
  one block, a [BLOCK_K] vector shared by the tile's rows where BLOCK_N divides BN), so a weight element costs one
  conversion and one fused multiply-add. The K slices run in chunks of UNROLLED_SLICES unrolled at compile time (K
  is a constant): in a loop whose iterations carry the next slice's bytes, the compiled kernel spent some 8
  instructions per weight byte (Hopper SASS: it repacked each loaded byte pair for the e4m3 conversion), unrolled
  about 4.5 (a pair conversion, two f16-to-f32 conversions and two FMAs per 2 weights, plus x's slice); at 8 a
  byte the kernel's issue rate, not the memory, bounded it (the bf16 GEMV issues as many instructions per second
  at 3.4 a byte and reads at 4.3 TB/s). Chunks, not all of K, keep a wide K's compile time to seconds.
- "scaled_dot" (up to 16 rows: decoding, and the experts of a decoding step): rows padded to BLOCK_M, each K slice
  inside one block column (BK a multiple of BLOCK_K), the FP8 slice converted to x's dtype (exact: e4m3's 4
  significant bits and exponents fit bf16 and fp16) and multiplied on the tensor cores, the [BLOCK_M, BLOCK_N] float32
  product then scaled by its output columns' scales (the weight rows') and added to the sum: the exact real weight.
- "dequantized_dot" (prefill: more rows): each weight slice dequantized on load to x's dtype as the reference
  `kernels_fp8.dequantize_block_fp8` does (float32's product w * s, rounded to x's dtype: the reference's weight, bit
  for bit), then one tl.dot accumulating in float32: the reference's product up to the order of the float32 sums.
- "fp8_dot" (prefill, only where `kernels_fp8.PREFILL_FORM` asks for it, not by default): x quantized to
  e4m3 per row and block column as DeepSeek and vLLM do (`quantize_activations`: scale = max |x| / 448 per 1 x BK
  group, q = x / scale rounded to e4m3, one small kernel), then FP8 x FP8 tensor cores per K slice inside one block
  column, each slice's float32 product scaled by its row's and its column's scales. Not the reference's product:
  each x_k becomes q_k s with |q_k s - x_k| <= 2^-4 |x_k| + 2^-10 s (e4m3's 3 fraction bits; half its subnormal
  spacing 2^-9), so |y~ - y| <= sum_k |W_k| (2^-4 |x_k| + 2^-10 s), plus the tensor cores' FP8 sums of each slice
  (Hopper keeps about 14 significant bits of them) and float32's; tests/test_kernels_fp8.py checks both parts.
In "one_row" and "scaled_dot" the weight is not rounded to x's dtype, so those results differ from the reference's by
its weight rounding (the real weight's product in float32 is the closer one). A dense prefill may also run
"dequantize_then_linear" (`kernels_fp8.PREFILL_FORM`): the weight dequantized by `dequantize` (one pass, the
reference's rounding) and F.linear on it, the reference's product itself (cuBLAS on a bf16 weight read once more).

The experts (`fp8_grouped_linear`): rows sorted by expert, `offsets` [E] the cumulative end row of each expert (torch's
grouped_mm convention), W [E, out, in]. One launch for all experts, with no host synchronization (the offsets stay on
the device, so a CUDA graph can capture the call): the grid has cdiv(S, BLOCK_M) + min(E, S) row tiles, a bound on
sum_e cdiv(rows_e, BLOCK_M); each program loads the E offsets, counts every expert's tiles and their running sum
(tl.cumsum), finds the expert and tile it serves from its program id, and returns at once when past the last tile.
An empty expert has no tile. Rows past offsets[E - 1] are not written (as the reference leaves them), and no row past
S is read or written whatever the offsets say.

The experts of a decoding step (`fp8_routed_linear`): a few (token, expert) routes, unsorted. The one_row form with a
program row per route: route r reads its expert's id from `routes` and multiplies row r // R of x (R routes per token)
into row r of y, so the routes need no sort, no offsets and no gather of x (a dozen small kernels a layer at batch 1);
two routes to one expert read its weight twice, which a decoding step's few routes seldom do. A route to an expert
outside 0..E-1 (expert parallelism's other ranks) gets a row of zeros. With `gated_by` (the routing weights), x's
rows are the gate/up products [gate | up] and each K slice of the input is computed as it is loaded, silu(gate) * up
* weight, each op rounded to x's dtype as torch's ops round: the experts' down projection then needs no elementwise
kernels before it.

A dense product may take its outputs from weight rows in any order (`index`: output j from weight row index[j]; no
gather after the kernel). Where the index is block-aligned (each aligned run of BN outputs from one block row) a
one_row tile keeps its one row of scales; otherwise it scales per element.

With programmatic dependent launch (`kernels_launch_triton`, Hopper on) the dense one_row form (a decoding step's
projections) loads its first weight slice, and its row index, which no kernel of a step writes, before it waits for
the kernel ahead (x is that kernel's output); the other forms wait first (the routes and the experts' offsets are the
step's own). Either way the kernel after it may start its own weight loads as soon as every program has waited.

K (the weight's inputs) is a compile-time constant, so the K loop's trip count is known (one compilation per width: a
few per model). Configurations are autotuned per weight shape and block inside `kernel_tuning.autotuning()` (`warm_up`
enters it; never inside a CUDA graph's capture), each timed over 25 ms with the L2 cache cleared before each run
(triton's do_bench), and kept in triton's cache folder; elsewhere a call runs its form's default (`_UNTUNED`).
Imported only for CUDA tensors (`kernels_fp8`), since importing triton needs a GPU driver.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the FP8 Triton kernels need triton (a CUDA machine); FP8 linear layers then dequantize the "
                      "weight and run F.linear") from error

from .fp8_kernel_contract import PREFILL_FORMS, TILE_ROW_BOUNDS, check_routes
from .kernel_tuning import launch
from .kernels_launch_triton import await_previous_kernel, dependent_launch
from .kernels_moe_triton import swiglu_input

FORMS = ("one_row", "scaled_dot", "dequantized_dot", "fp8_dot")
DECODING_ROWS = 16  # rows of x (rows per expert, on average, for the experts) up to which "scaled_dot" is taken
_FORM_IDS = {form: index for index, form in enumerate(FORMS)}


UNROLLED_SLICES = tl.constexpr(8)  # one_row's K slices unrolled together (a chunk; see the module docstring)


@triton.jit
def _one_row_weights(w_rows, live_cols, start, ks, K: tl.constexpr):
    """The one_row form's weight slice at columns start + ks ([BLOCK_N, BLOCK_K] FP8; past K or out of N: 0)."""
    return tl.load(w_rows + (start + ks)[None, :], mask=live_cols[:, None] & (start + ks < K)[None, :], other=0.0)


@triton.jit
def _one_row_slice(products, w, x_row, x_live, rw_ptr, s_ptr, s_rows, stride_sn, stride_sk, first_id, live_cols,
                   start, ks, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GATED_INPUT: tl.constexpr, HAS_INDEX: tl.constexpr,
                   ALIGNED_INDEX: tl.constexpr):
    """products [BLOCK_N, BLOCK_K] plus the one_row form's products of the weight slice w (columns start + ks) with
    x's slice (x_row; with GATED_INPUT, silu(gate) * up * rw_ptr[0], each op rounded to x's dtype), scaled."""
    live_k = start + ks < K
    x = tl.load(x_row + start + ks, mask=live_k & x_live, other=0.0).to(tl.float32)
    if GATED_INPUT:
        up = tl.load(x_row + K + start + ks, mask=live_k & x_live, other=0.0).to(tl.float32)
        x = swiglu_input(x, up, tl.load(rw_ptr).to(tl.float32), x_row.dtype.element_ty)
    # (where BN % BLOCK_N == 0 and the index, if any, is aligned, the tile's weight rows lie in one block row:
    # first_id's)
    if BN % BLOCK_N == 0 and (ALIGNED_INDEX or not HAS_INDEX) and BK % BLOCK_K == 0:  # one scale
        s = tl.load(s_ptr + (first_id // BN) * stride_sn + (start // BK) * stride_sk)
        return products + w.to(tl.float32) * (x * s)[None, :]
    if BN % BLOCK_N == 0 and (ALIGNED_INDEX or not HAS_INDEX):  # one row of scales: x's slice scaled once
        s = tl.load(s_ptr + (first_id // BN) * stride_sn + ((start + ks) // BK) * stride_sk, mask=live_k, other=0.0)
        return products + w.to(tl.float32) * (x * s)[None, :]
    s = tl.load(s_rows + ((start + ks) // BK)[None, :] * stride_sk, mask=live_cols[:, None] & live_k[None, :],
                other=0.0)
    return products + w.to(tl.float32) * s * x[None, :]


# M (rows of x) and R (routes per row) only bound the rows, so they are not specialised: triton would otherwise
# compile the kernel again for each new class of them (1, multiples of 16, others), seconds on a new prompt length
@triton.jit(do_not_specialize=["M", "R"])
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, offsets_ptr, xs_ptr, rw_ptr, M, N, E, R,
                       stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ym,
                       K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GROUPED: tl.constexpr, ROUTED: tl.constexpr, E_POW2: tl.constexpr, FORM: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GATED_INPUT: tl.constexpr = False, HAS_INDEX: tl.constexpr = False,
                       ALIGNED_INDEX: tl.constexpr = False, PDL: tl.constexpr = False):
    """y tile (row tile program_id(1), BLOCK_N output columns program_id(0)) of FORM (an index into FORMS); x_ptr
    holds e4m3 values and xs_ptr their scales for fp8_dot (see the module docstring). offsets_ptr holds the experts'
    end rows (GROUPED) or each route's expert (ROUTED, R routes per row of x). With GATED_INPUT (one_row only), x's
    row is [gate | up] (2K wide) and the input is silu(gate) * up * rw[row], each op rounded to x's dtype. With
    HAS_INDEX (dense only), offsets_ptr holds the weight row of each output column; ALIGNED_INDEX: the outputs of an
    aligned run of BN columns all come from one block row of the weight. With PDL (see the module docstring) the dense
    one_row form loads its first weight slice before it waits for the kernel ahead; the others wait first."""
    if not (FORM == 0 and not ROUTED and not GROUPED):  # (routes and offsets are the step's; every program waits)
        await_previous_kernel(PDL)
    tile = tl.program_id(1)  # (output columns on axis 0, whose grid may exceed axis 1's 65,535 programs)
    y_start = tile * BLOCK_M  # (the first row of y the tile writes; grouped tiles write their rows of x)
    if ROUTED:  # route `tile`: row tile // R of x times its expert's weight, into row `tile` of y (BLOCK_M is 1)
        expert = tl.load(offsets_ptr + tile).to(tl.int32)
        served = (expert >= 0) & (expert < E)  # (an expert of another rank: a row of zeros)
        expert = tl.where(served, expert, 0)
        w_ptr += expert.to(tl.int64) * stride_we
        s_ptr += expert.to(tl.int64) * stride_se
        row_start = tile // R
        row_end = tl.where(served, row_start + 1, row_start)
    elif GROUPED:  # which expert's rows this tile is (see the module docstring)
        experts = tl.arange(0, E_POW2)
        ends = tl.load(offsets_ptr + experts, mask=experts < E, other=0).to(tl.int32)
        starts = tl.load(offsets_ptr + experts - 1, mask=(experts > 0) & (experts < E), other=0).to(tl.int32)
        tiles = tl.where(experts < E, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
        tile_ends = tl.cumsum(tiles, axis=0)
        expert = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
        if expert >= E:  # past the last tile
            return
        mine = experts == expert
        first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), axis=0)
        row_start = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
        row_end = tl.minimum(tl.sum(tl.where(mine, ends, 0), axis=0), M)  # (offsets past S: no row beyond x's)
        w_ptr += expert.to(tl.int64) * stride_we
        s_ptr += expert.to(tl.int64) * stride_se
        y_start = row_start
    else:
        row_start = tile * BLOCK_M
        row_end = M
    rows = row_start + tl.arange(0, BLOCK_M)
    live_rows = (rows < row_end) & (rows >= 0)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_cols = cols < N
    if HAS_INDEX:  # output column j is weight row index[j]
        w_ids = tl.load(offsets_ptr + cols, mask=live_cols, other=0).to(tl.int32)
        first_id = tl.load(offsets_ptr + tl.program_id(0) * BLOCK_N).to(tl.int32)
    else:
        w_ids = cols
        first_id = tl.program_id(0) * BLOCK_N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + w_ids.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (w_ids // BN)[:, None] * stride_sn  # [BLOCK_N, 1]: each output column's row of scales
    if FORM == 0:  # one_row: elementwise products, summed over K at the end
        ks = tl.arange(0, BLOCK_K)
        x_row = x_ptr + row_start.to(tl.int64) * stride_xm
        x_live = row_start < row_end
        rw_ptr += row_start
        # the slices of the first chunk unrolled (see the module docstring), the first loaded before the wait; then
        # whole chunks, then the slices left (every slice starts before K: its scale column exists)
        SLICES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        CHUNK: tl.constexpr = min(UNROLLED_SLICES, SLICES)
        WHOLE: tl.constexpr = SLICES // CHUNK * CHUNK
        w = _one_row_weights(w_rows, live_cols, 0, ks, K)
        if not ROUTED and not GROUPED:  # (the first weight slice on its way while the kernel ahead finishes)
            await_previous_kernel(PDL)
        products = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in tl.static_range(0, CHUNK * BLOCK_K, BLOCK_K):
            if start > 0:
                w = _one_row_weights(w_rows, live_cols, start, ks, K)
            products = _one_row_slice(products, w, x_row, x_live, rw_ptr, s_ptr, s_rows, stride_sn, stride_sk,
                                      first_id, live_cols, start, ks, K, BN, BK, BLOCK_N, BLOCK_K, GATED_INPUT,
                                      HAS_INDEX, ALIGNED_INDEX)
        for chunk in range(CHUNK * BLOCK_K, WHOLE * BLOCK_K, CHUNK * BLOCK_K):  # (K past CHUNK slices)
            for step in tl.static_range(0, CHUNK * BLOCK_K, BLOCK_K):
                at = chunk + step
                products = _one_row_slice(products, _one_row_weights(w_rows, live_cols, at, ks, K), x_row, x_live,
                                          rw_ptr, s_ptr, s_rows, stride_sn, stride_sk, first_id, live_cols, at, ks, K,
                                          BN, BK, BLOCK_N, BLOCK_K, GATED_INPUT, HAS_INDEX, ALIGNED_INDEX)
        for start in tl.static_range(WHOLE * BLOCK_K, SLICES * BLOCK_K, BLOCK_K):  # (fewer than CHUNK)
            products = _one_row_slice(products, _one_row_weights(w_rows, live_cols, start, ks, K), x_row, x_live,
                                      rw_ptr, s_ptr, s_rows, stride_sn, stride_sk, first_id, live_cols, start, ks, K,
                                      BN, BK, BLOCK_N, BLOCK_K, GATED_INPUT, HAS_INDEX, ALIGNED_INDEX)
        acc = tl.sum(products, axis=1)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            live_k = ks < K
            x = tl.load(x_rows + ks[None, :], mask=live_rows[:, None] & live_k[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=live_cols[:, None] & live_k[None, :], other=0.0)
            if FORM == 1:  # scaled_dot: the slice lies in one block column; its product scaled per output column
                s = tl.load(s_ptr + (w_ids // BN) * stride_sn + (start // BK) * stride_sk, mask=live_cols, other=0.0)
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION) * s[None, :]
            elif FORM == 3:  # fp8_dot: x quantized per row and block column, both scales applied to the product
                s = tl.load(s_ptr + (w_ids // BN) * stride_sn + (start // BK) * stride_sk, mask=live_cols, other=0.0)
                xs = tl.load(xs_ptr + rows.to(tl.int64) * stride_xsm + start // BK, mask=live_rows, other=0.0)
                acc += tl.dot(x, tl.trans(w)) * xs[:, None] * s[None, :]
            else:  # dequantized_dot: the weight rounded to x's dtype, as the reference's
                if BK % BLOCK_K == 0:
                    s = tl.load(s_ptr + (w_ids // BN) * stride_sn + (start // BK) * stride_sk, mask=live_cols,
                                other=0.0)[:, None]
                else:
                    s = tl.load(s_rows + (ks // BK)[None, :] * stride_sk, mask=live_cols[:, None] & live_k[None, :],
                                other=0.0)
                w = (w.to(tl.float32) * s).to(x_ptr.dtype.element_ty)
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_ids, mask=live_cols, other=0.0).to(tl.float32)[None, :]
    y_rows = y_start + tl.arange(0, BLOCK_M)
    written = (y_rows < M * R) if ROUTED else live_rows  # (a route's row is written even where no expert serves it)
    tl.store(y_ptr + y_rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=written[:, None] & live_cols[None, :])


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, stride_sm, BK: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One row's BK columns of x (program (row, block column)): scale = max |x| / 448 (1 for a zero group), q =
    x / scale rounded to e4m3."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    ks = tl.program_id(1) * BK + offsets
    live = (offsets < BK) & (ks < K)
    x = tl.load(x_ptr + row * stride_xm + ks, mask=live, other=0.0).to(tl.float32)
    largest = tl.max(tl.abs(x), axis=0)
    scale = tl.where(largest > 0, tl.div_rn(largest, 448.0), 1.0)  # (div_rn: IEEE division, not `/`'s approximate)
    tl.store(q_ptr + row * stride_qm + ks, tl.div_rn(x, scale).to(q_ptr.dtype.element_ty), mask=live)
    tl.store(scale_ptr + row * stride_sm + tl.program_id(1), scale)


def quantize_activations(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) in e4m3 per row and `bk` columns: (q [M, K] float8_e4m3fn, scales [M,
    ceil(K / bk)] float32), x ~ q * scale (DeepSeek's 1 x 128 activation scaling for `fp8_dot`)."""
    rows, inp = x.shape
    q = torch.empty(rows, inp, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, triton.cdiv(inp, bk), device=x.device, dtype=torch.float32)
    if q.numel():
        _quantize_kernel[(rows, scales.shape[1])](x, q, scales, inp, x.stride(0), q.stride(0), scales.stride(0),
                                                  BK=bk, BLOCK=triton.next_power_of_2(bk))
    return q, scales


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sk, stride_on, BN: tl.constexpr,
                       BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of the weight: float32's product w * s, rounded to the output's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = (cols < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=live, other=0.0)
    if BK % BLOCK_K == 0:  # the tile lies in one block column: a scale per row
        s = tl.load(s_ptr + (cols // BN) * stride_sn + (tl.program_id(1) * BLOCK_K // BK) * stride_sk, mask=cols < N,
                    other=0.0)[:, None]
    else:
        s = tl.load(s_ptr + (cols // BN)[:, None] * stride_sn + (ks // BK)[None, :] * stride_sk, mask=live, other=0.0)
    tl.store(out_ptr + cols.to(tl.int64)[:, None] * stride_on + ks[None, :],
             (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=live)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """The real weight of FP8 `weight` [out, in] (unit stride along in) in `dtype`, rounded as the reference
    `kernels_fp8.dequantize_block_fp8` rounds it (bit for bit): one pass over the weight."""
    out, inp = weight.shape
    result = torch.empty(out, inp, device=weight.device, dtype=dtype)
    if result.numel():
        tile = (16, 16) if _INTERPRETED else (32, 128)
        _dequantize_kernel[(triton.cdiv(out, tile[0]), triton.cdiv(inp, tile[1]))](
            weight, scale_inv, result, out, inp, weight.stride(0), scale_inv.stride(0), scale_inv.stride(1),
            result.stride(0), BN=block[0], BK=block[1], BLOCK_N=tile[0], BLOCK_K=tile[1])
    return result


# (BLOCK_N, BLOCK_K, warps, stages) per form; each compiles on first use, in the warm-up (about a second each)
_CONFIGS = {
    # (one_row: (16, 512) and (32, 256) on 8 warps issue the fewest instructions a weight, 3.6 to 4.4 in Hopper SASS
    # against 5 to 9 for narrower tiles; for wide outputs, whose fewer programs of them still fill the GPU)
    "one_row": [(2, 1024, 4, 1), (2, 512, 4, 2), (4, 512, 4, 2), (4, 256, 4, 3), (8, 256, 4, 3), (8, 512, 8, 2),
                (16, 256, 8, 3), (4, 128, 2, 4), (8, 128, 4, 4), (16, 128, 4, 4), (32, 128, 4, 3), (16, 512, 8, 1),
                (32, 256, 8, 1)],
    "scaled_dot": [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (16, 64, 4, 6), (32, 64, 4, 5),
                   (128, 128, 8, 3)],
    "fp8_dot": [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 4), (64, 128, 4, 4), (64, 256, 8, 3),
                (64, 64, 4, 5)],
    "dequantized_dot": [(128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4), (256, 64, 8, 3), (128, 32, 4, 5),
                        (64, 128, 4, 3)],
}
# what a call outside `kernel_tuning.autotuning()` runs, per (form, grouped): of the configurations above, the one
# with the least geometric-mean slowdown against each key's tuned best over the benchmark and flagship shapes an H200
# tuned (benchmarks/tuning: one_row 1.27x, scaled_dot 1.28x, dense dequantized_dot 1.08-1.19x, the experts' 1.0-1.02x)
_UNTUNED = {("one_row", False): (8, 256, 4, 3), ("one_row", True): (8, 256, 4, 3),
            ("scaled_dot", False): (32, 64, 4, 5), ("scaled_dot", True): (16, 128, 4, 4),
            ("dequantized_dot", False): (64, 64, 4, 4), ("dequantized_dot", True): (128, 64, 4, 4),
            ("fp8_dot", False): (64, 128, 4, 4), ("fp8_dot", True): (64, 128, 4, 4)}
# the configuration triton's interpreter runs (tests on CPUs: no timing); tiny, so the interpreter takes seconds
_INTERPRETED_CONFIG = {"one_row": (4, 16), "scaled_dot": (16, 16), "dequantized_dot": (16, 16), "fp8_dot": (16, 32)}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _fits(form: str, block_n: int, block_k: int, bk: int) -> bool:
    """Whether a configuration serves a form for block columns of `bk`: a scaled_dot or fp8_dot slice lies in one
    block column."""
    return form not in ("scaled_dot", "fp8_dot") or bk % block_k == 0


def _pruned(configs: list, named_args: dict, **kwargs) -> list:
    """The configurations that fit the call's block (`_fits`). Where none does (block columns narrower than every
    listed slice, as a 16-column block for scaled_dot), the narrowest one with its slice cut to the widest power of
    two dividing the block's columns: a slice never spans two block columns, whose scales differ."""
    arguments = {**named_args, **kwargs}
    form, bk = FORMS[arguments["FORM"]], arguments["BK"]
    fitting = [c for c in configs if _fits(form, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], bk)]
    if fitting:
        return fitting
    narrowest = min(configs, key=lambda c: c.kwargs["BLOCK_K"])
    slice_k = min(bk & -bk, narrowest.kwargs["BLOCK_K"])  # (bk & -bk: the largest power of two dividing bk)
    return [triton.Config({**narrowest.kwargs, "BLOCK_K": slice_k}, num_warps=narrowest.num_warps,
                          num_stages=narrowest.num_stages)]


def _timed(kernel_call, quantiles):
    """triton's do_bench timing 25 ms of runs after 5 ms of warm-up (the kernels take microseconds)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _autotuned(form: str) -> triton.runtime.Autotuner:
    """The kernel autotuned over the form's configurations per _KEY, with the timing and the on-disk cache of the
    results where this triton's autotune offers them."""
    offered = inspect.signature(triton.autotune).parameters
    options = {name: value for name, value in (("do_bench", _timed), ("cache_results", True)) if name in offered}
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in _CONFIGS[form]]
    return triton.autotune(configs=configs, key=_KEY, prune_configs_by={"early_config_prune": _pruned},
                           **options)(_fp8_linear_kernel)


_MAX_GRID_ROWS = 65535  # programs along the grid's second axis (row tiles, or routes)
_KEY = ["N", "K", "E", "BN", "BK", "HAS_BIAS", "GROUPED", "ROUTED", "FORM", "BLOCK_M"]
_TUNED = {form: _autotuned(form) for form in FORMS}


def _launch(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
            offsets: torch.Tensor | None, block: tuple[int, int], form: str, block_m: int,
            config: tuple[int, int] | None, routes: torch.Tensor | None = None,
            gated_by: torch.Tensor | None = None, index: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
    """y [S, out] in x's dtype for x [S, in] (unit stride along in), weight [(E,) out, in], scale_inv [(E,) ...];
    with `routes` [S * R] (each route's expert), y [S * R, out], route r the product of row r // R. With `gated_by`
    [S] (one_row only), x is [S, 2 in], [gate | up], and the input silu(gate) * up * gated_by[row]. With `index`
    (weight rows [N], whether block-aligned; dense only), y [S, N], column j the product with weight row index[j]."""
    rows, out, inp = x.shape[0], weight.shape[-2] if index is None else index[0].shape[0], weight.shape[-1]
    per_row = routes.shape[0] // max(rows, 1) if routes is not None else 1
    y = torch.empty(rows * per_row, out, device=x.device, dtype=x.dtype)
    if rows == 0 or out == 0 or per_row == 0:
        return y
    x_scales = scale_inv  # (unread but by fp8_dot)
    if form == "fp8_dot":
        x, x_scales = quantize_activations(x, block[1])
    grouped, routed = offsets is not None, routes is not None
    experts = weight.shape[0] if grouped or routed else 1
    tiles = rows * per_row if routed else triton.cdiv(rows, block_m) + (min(experts, rows) if grouped else 0)
    args = (x, weight, scale_inv, bias if bias is not None else scale_inv, y,
            offsets if grouped else routes if routed else index[0] if index is not None else scale_inv, x_scales,
            gated_by if gated_by is not None else scale_inv, rows, out, experts, per_row,
            x.stride(0), x_scales.stride(0), weight.stride(0) if grouped or routed else 0, weight.stride(-2),
            scale_inv.stride(0) if grouped or routed else 0, scale_inv.stride(-2), scale_inv.stride(-1), y.stride(0))
    flags = {"K": inp, "BN": block[0], "BK": block[1], "HAS_BIAS": bias is not None, "GROUPED": grouped,
             "ROUTED": routed, "E_POW2": triton.next_power_of_2(experts) if grouped else 1, "FORM": _FORM_IDS[form],
             "PRECISION": "ieee" if y.dtype == torch.float32 else "tf32", "BLOCK_M": block_m,
             "GATED_INPUT": gated_by is not None, "HAS_INDEX": index is not None,
             "ALIGNED_INDEX": index is not None and index[1], **dependent_launch(x.device)}
    if config is None and _INTERPRETED:
        config = _INTERPRETED_CONFIG[form]
    if config is not None:
        if not _fits(form, *config, block[1]):
            raise ValueError(f"FP8 kernel: a {form} slice of {config[1]} columns must divide the block's {block[1]} "
                             "columns; pick a BLOCK_K dividing it")
        _fp8_linear_kernel[(triton.cdiv(out, config[0]), tiles)](*args, **flags, BLOCK_N=config[0],
                                                                  BLOCK_K=config[1])
    else:
        key = ("fp8", form, out, inp, experts, block, bias is not None, grouped, routed, block_m, gated_by is not None,
               None if index is None else index[1])
        launch(_TUNED[form], _fp8_linear_kernel, lambda meta: (triton.cdiv(out, meta["BLOCK_N"]), tiles), key,
               _untuned_config(form, grouped or routed, block[1]), args, flags)
    return y


def _untuned_config(form: str, experts: bool, bk: int) -> triton.Config:
    """The configuration a call outside autotuning runs (`_UNTUNED`), or where its slice does not fit the block's
    columns, the one `_pruned` keeps first."""
    n, k, warps, stages = _UNTUNED[form, experts]
    preferred = triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
    return preferred if _fits(form, n, k, bk) else _pruned([preferred], {"FORM": _FORM_IDS[form], "BK": bk})[0]


def _scaled_dot_serves(bk: int) -> bool:
    """scaled_dot needs a K slice of at least 16 (tl.dot) inside one block column."""
    return bk % 16 == 0


def linear_form(rows: int, bk: int, prefill: str = "dequantized_dot") -> str:
    """The form a dense product of `rows` rows of x takes (see the module docstring): past DECODING_ROWS, `prefill`
    (one of PREFILL_FORMS; "fp8_dot" where the block's columns take its K slices of 32, FP8 tl.dot's least)."""
    if prefill not in PREFILL_FORMS:
        raise ValueError(f"FP8 prefill form {prefill!r}: expected one of {', '.join(PREFILL_FORMS)}")
    if rows == 1:
        return "one_row"
    if rows <= DECODING_ROWS and _scaled_dot_serves(bk):
        return "scaled_dot"
    return "dequantized_dot" if prefill == "fp8_dot" and bk % 32 else prefill


def _tile_rows(rows: int) -> int:
    """Rows per tile of the dot forms for `rows` rows (of one expert, on average): 16 (tl.dot's least), 64 or 128, the
    larger past each of TILE_ROW_BOUNDS."""
    small, middle = TILE_ROW_BOUNDS
    return small if rows <= small else middle if rows <= middle else 128


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, form: str | None = None, config: tuple[int, int] | None = None,
               prefill: str = "dequantized_dot", index: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
    """x [M, in] (unit stride along in; bf16, fp16 or fp32) @ W.T (+ bias) in x's dtype, W (out, in) the real weight of
    FP8 `weight` (unit stride along in) and float32 `scale_inv` [ceil(out / BN), ceil(in / BK)], block (BN, BK).
    `form` picks a form (default: `linear_form` with `prefill`; tests and benchmarks), `config` (BLOCK_N, BLOCK_K) a
    configuration instead of the autotuned one (tests; triton's interpreter runs `_INTERPRETED_CONFIG`).
    "dequantize_then_linear" dequantizes the weight (`dequantize`) and runs F.linear: the reference's product.
    `index` (rows [N] int32/int64 on x's device, whether block-aligned: `kernels_fp8.fp8_row_index`): [M, N], column
    j the product with weight row rows[j] (and bias[rows[j]])."""
    form = form or linear_form(x.shape[0], block[1], prefill)
    if form == "dequantize_then_linear":
        out = F.linear(x, dequantize(weight, scale_inv, block, x.dtype), bias)
        return out if index is None else out.index_select(-1, index[0])
    block_m = 1 if form == "one_row" else _tile_rows(x.shape[0])
    if form == "one_row" and x.shape[0] != 1:
        raise ValueError(f"FP8 kernel: the one_row form takes one row of x, not {x.shape[0]}; use scaled_dot")
    return _launch(x, weight, scale_inv, bias, None, block, form, block_m, config, index=index)


def fp8_grouped_linear(rows: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, offsets: torch.Tensor,
                       block: tuple[int, int], form: str | None = None, config: tuple[int, int] | None = None,
                       prefill: str = "dequantized_dot") -> torch.Tensor:
    """rows [S, in] (sorted by expert, unit stride along in) @ W_e.T for the rows of each expert e: W [E, out, in] FP8
    (unit stride along in) with scale_inv [E, ...], `offsets` [E] (int32/int64, on the device) the cumulative end row
    of each expert (rows offsets[e - 1]:offsets[e] are expert e's). One launch, no host synchronization. `form`:
    "scaled_dot" (default where the rows per expert average at most DECODING_ROWS), else `prefill` ("dequantized_dot"
    or "fp8_dot"; "dequantize_then_linear", which would dequantize every expert, takes "dequantized_dot")."""
    experts = weight.shape[0]
    per_expert = -(-rows.shape[0] // max(experts, 1))
    if form is None:
        form = "scaled_dot" if per_expert <= DECODING_ROWS and _scaled_dot_serves(block[1]) else linear_form(
            DECODING_ROWS + 1, block[1], "dequantized_dot" if prefill == "dequantize_then_linear" else prefill)
    if form not in ("scaled_dot", "dequantized_dot", "fp8_dot"):
        raise ValueError(f"FP8 kernel: the experts' product takes scaled_dot, dequantized_dot or fp8_dot, not {form}")
    return _launch(rows, weight, scale_inv, None, offsets, block, form, _tile_rows(per_expert), config)


def fp8_routed_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, routes: torch.Tensor,
                      block: tuple[int, int], config: tuple[int, int] | None = None,
                      gated_by: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] (unit stride along in) and `routes` [T * R] (int32/int64 on the device: route r's expert, for row
    r // R of x): y [T * R, out], route r's row x[r // R] @ W_e.T, W [E, out, in] FP8 (unit stride along in) with
    scale_inv [E, ...]; a route to an expert outside 0..E-1 (another rank's) gets a row of zeros. One launch of the
    one_row form with a program row per route: no sort, no gather of x, no host synchronization (see the module
    docstring). With `gated_by` [T] (x's dtype), x is [T, 2 in], each row [gate | up], and the product is of
    silu(gate) * up * gated_by[row] (the experts' SwiGLU and routing weight, computed as x is read)."""
    check_routes(x, routes, most=_MAX_GRID_ROWS)
    return _launch(x, weight, scale_inv, None, None, block, "one_row", 1, config, routes=routes, gated_by=gated_by)


__all__ = ["DECODING_ROWS", "FORMS", "PREFILL_FORMS", "dequantize", "fp8_grouped_linear", "fp8_linear",
           "fp8_routed_linear", "linear_form", "quantize_activations"]

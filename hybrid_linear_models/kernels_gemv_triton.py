"""A Triton GEMV for decoding steps: y = x W[rows]^T (+ b[rows]) for x of at most 16 rows, bf16/fp16, float32 sums.

With SWIGLU_PAIRS, the weight rows come in (gate_j, up_j) pairs (picked so through the index from the gated MLP's
stacked [W_gate; W_up]) and the kernel stores silu(gate_j) * up_j, computed as the eager step computes it (each
product rounded to x's dtype, then float32 gate * sigmoid(gate) * up rounded once, as fla's SwiGLU kernel rounds):
the MLP's activation without a kernel of its own, and without its [gate | up] output. (A program's BLOCK_N outputs
hold whole pairs: every configuration has an even BLOCK_N.)

Imported only for CUDA tensors (`kernels_gemv`), since importing triton needs a GPU driver. Each program owns BLOCK_N
output columns (weight rows, optionally picked through an index: a gather of the product's outputs costs nothing
here, since the weight rows are read whole in any order) and streams their K inputs in BLOCK_K slices; the weight is
read once and no second kernel reduces or casts partial sums. Two forms of one kernel:
- up to FEW_ROWS rows of x (batch-1 decoding; a speculative verify round of a few tokens) and, past one row, up to
  `gemv_forms.WIDEST_OUTPUTS["few_rows"]` outputs (`gemv_forms.form`): elementwise products accumulated in a
  [ROWS, BLOCK_N, BLOCK_K] float32 tile (the rows padded to a power of two: 1, 2, 4 or 8), summed over K once at the
  end. No tensor cores, so BLOCK_N may be as small as 2: a 2,048-wide weight then spreads over
  hundreds of programs, several per SM, whose loads together keep enough bytes in flight to approach the bandwidth
  (a 16-row `tl.dot` tile gives 128 programs for 132 SMs, one weight block each, and under half of it). Each weight
  element is used for ROWS products: at 8 rows and the H200's bandwidth that is about 60% of its float32 FMA rate,
  hence no more rows in this form;
- else (up to 16 rows): the rows padded to 16 (masked loads, no memory traffic) so one `tl.dot` per slice runs on the
  tensor cores, software-pipelined by `num_stages`.
With a convolution (`kernels_gemv.linear_conv_step`), output columns below C are the short convolution's decoding
step of the products, run in the epilogue (`_store_convolved`); each program reads its channels' kernels and window
before its sums, and writes the stepped window back.
With programmatic dependent launch (`kernels_launch_triton`, Hopper on) a program reads its row index and its first
weight slice, which no kernel of a decoding step writes, before it waits for the kernel ahead of it (x is that kernel's
output): the weight's bytes move while that kernel ends (docs/performance.md, `--ab pdl`). The row index and the weight
must therefore not be written inside the step that runs the GEMV (decoding steps read fixed weights and index rows made
before the capture). The loop then loads each next slice after using the current one.
Configurations are autotuned per (N, K) inside `kernel_tuning.autotuning()` (`warm_up` enters it; never inside a CUDA
graph's capture; elsewhere a call runs the form's first configuration, `_DEFAULTS`), each timed over 25 ms (the kernels
take microseconds: thousands of runs, the L2 cache cleared before each by triton's do_bench), and the timings are kept
in triton's cache folder, so a machine tunes a shape once, not once per process. On an H200 the one-row form takes
BLOCK_N = 2, BLOCK_K = 1,024, 4 warps for most weights of the benchmark models (`benchmarks/bench_decode_gemv.py` prints
the choice): 1,024 programs for a 2,048-wide weight, each streaming two rows; the configurations listed are those the
tuning chooses for some shape of those models.
"""

from __future__ import annotations

import inspect
import os

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton GEMV needs triton (a CUDA machine); decoding GEMVs run through cuBLAS") from error

from .gemv_forms import FEW_ROWS, form
from .kernel_tuning import launch
from .kernels_launch_triton import await_previous_kernel, dependent_launch

ROWS = 16  # x rows handled by the tl.dot form (padded to this many)

# few configurations: each is compiled on first use, in the first capture's warm-up (about a second each)
_ONE_ROW_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in ((2, 1024, 4, 1), (2, 2048, 4, 1), (4, 512, 4, 1), (4, 512, 4, 3), (4, 2048, 8, 1),
                       (8, 512, 4, 1), (8, 256, 2, 1), (16, 256, 4, 1))
]
# the elementwise form for 2 to FEW_ROWS rows: its tile holds ROWS x BLOCK_N x BLOCK_K float32 sums (at most 64 a
# thread)
_FEW_ROWS_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in ((2, 512, 4, 1), (2, 1024, 8, 1), (2, 256, 4, 1), (4, 256, 4, 1), (4, 512, 8, 1),
                       (8, 128, 4, 1), (2, 256, 2, 1))
]
_ROWS_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in ((16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (16, 256, 8, 4), (32, 256, 4, 3),
                       (32, 128, 8, 4))
]


@triton.jit
def _store_swiglu_of_pairs(acc, y_ptr, rows, M, N, stride_ym, BLOCK_N: tl.constexpr):
    """SwiGLU of the gate and up products side by side in acc [ROWS, BLOCK_N] (gate_j at 2j, up_j at 2j + 1), each
    rounded to the output dtype first (as the eager step's GEMM output is), then silu(gate) * up in float32, rounded
    once (as fla's SwiGLU kernel rounds): output columns program_id * BLOCK_N / 2 + j."""
    products = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(products, (acc.shape[0], BLOCK_N // 2, 2)))
    cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    swiglu = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], swiglu,
             mask=(rows[:, None] < M) & (cols[None, :] < N // 2))


@triton.jit
def _store_convolved(acc, y_ptr, rows, cols, M, N, stride_ym, window, taps_w, window_ptr, stride_window, C,
                     KW: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Output columns below C through the short convolution's decoding step, the others as they are. acc [ROWS,
    BLOCK_N] the products, rounded to the output dtype first (the eager step's GEMM output, which the convolution
    reads); window [ROWS, BLOCK_N, BLOCK_KW] float32, the last KW - 1 inputs of each row and channel in its first KW - 1
    taps; taps_w [BLOCK_N, BLOCK_KW] the kernels. fla's `causal_conv1d_update` math: the input shifted in as the last
    tap, the float32 sum over the taps, silu, rounded once; the new window stored whole ([B, C, KW], fla's layout)."""
    out = acc.to(y_ptr.dtype.element_ty)
    taps = tl.arange(0, BLOCK_KW)
    shifted = tl.where((taps == KW - 1)[None, None, :], out.to(tl.float32)[:, :, None], window)
    conv = tl.sum(shifted * taps_w.to(tl.float32)[None, :, :], axis=2)
    conv = conv * tl.sigmoid(conv)
    convolved = cols < C
    y = tl.where(convolved[None, :], conv.to(y_ptr.dtype.element_ty), out)
    live = rows[:, None] < M
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=live & (cols < N)[None, :])
    tl.store(window_ptr + rows[:, None, None] * stride_window + cols[None, :, None] * KW + taps[None, None, :],
             shifted.to(window_ptr.dtype.element_ty),
             mask=live[:, :, None] & convolved[None, :, None] & (taps < KW)[None, None, :])


# M (rows of x) only bounds the rows (ROWS pads them), so it is not specialised: a batch of another class (1,
# multiples of 16, others) under the same ROWS then compiles nothing new
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, index_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 conv_w_ptr, window_ptr, stride_window, C,
                 HAS_BIAS: tl.constexpr, HAS_INDEX: tl.constexpr, SWIGLU_PAIRS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KW: tl.constexpr = 0, BLOCK_KW: tl.constexpr = 1,
                 PDL: tl.constexpr = False, FEW_ROWS: tl.constexpr = FEW_ROWS):
    # Until await_previous_kernel only the row index, the weight and the convolution's kernels and window are read
    # (no kernel of a step writes them before this one), so with PDL they are on their way while the kernel ahead
    # finishes (kernels_launch_triton)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = cols < N
    if HAS_INDEX:  # output column j is weight row index[j]
        w_rows = tl.load(index_ptr + cols, mask=in_range, other=0).to(tl.int64)
    else:
        w_rows = cols.to(tl.int64)
    rows = tl.arange(0, ROWS)
    if KW > 0:  # the short convolution of the columns below C: its kernels, and each row's last KW - 1 inputs
        taps = tl.arange(0, BLOCK_KW)
        convolved = cols < C
        taps_w = tl.load(conv_w_ptr + cols[:, None] * KW + taps[None, :],
                         mask=convolved[:, None] & (taps < KW)[None, :], other=0.0)
        window = tl.load(window_ptr + rows[:, None, None] * stride_window + cols[None, :, None] * KW
                         + (taps + 1)[None, None, :],
                         mask=(rows < M)[:, None, None] & convolved[None, :, None] & (taps + 1 < KW)[None, None, :],
                         other=0.0).to(tl.float32)
    if ROWS == 1:
        tile = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_rows[:, None] * stride_wn + ks[None, :], mask=in_range[:, None] & (ks[None, :] < K),
                    other=0.0)
        await_previous_kernel(PDL)
        for start in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
            tile += w.to(tl.float32) * x.to(tl.float32)[None, :]
            ks += BLOCK_K  # the next slice's weight (past K: masked, no memory traffic)
            w = tl.load(w_ptr + w_rows[:, None] * stride_wn + ks[None, :],
                        mask=in_range[:, None] & (ks[None, :] < K), other=0.0)
        acc = tl.sum(tile, axis=1)[None, :]
    elif ROWS <= FEW_ROWS:  # the one-row form for each of a few rows, every weight slice read once for all of them
        tile = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_rows[:, None] * stride_wn + ks[None, :], mask=in_range[:, None] & (ks[None, :] < K),
                    other=0.0)
        await_previous_kernel(PDL)
        for start in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0)
            tile += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
            ks += BLOCK_K
            w = tl.load(w_ptr + w_rows[:, None] * stride_wn + ks[None, :],
                        mask=in_range[:, None] & (ks[None, :] < K), other=0.0)
        acc = tl.sum(tile, axis=2)
    else:
        await_previous_kernel(PDL)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + w_rows[:, None] * stride_wn + ks[None, :],
                        mask=in_range[:, None] & (ks[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_rows, mask=in_range, other=0.0).to(tl.float32)[None, :]
    if SWIGLU_PAIRS:  # outputs (2j, 2j + 1) are (gate_j, up_j): store silu(gate_j) * up_j as output j
        _store_swiglu_of_pairs(acc, y_ptr, rows, M, N, stride_ym, BLOCK_N)
    elif KW > 0:
        _store_convolved(acc, y_ptr, rows, cols, M, N, stride_ym, window, taps_w, window_ptr, stride_window, C, KW,
                         BLOCK_KW)
    else:
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & in_range[None, :])


def _timed(kernel_call, quantiles):
    """triton's do_bench timing 25 ms of runs after 5 ms of warm-up (its defaults, 100 and 25 ms, suit longer
    kernels: a GEMV of microseconds runs thousands of times in 25 ms)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _autotuned(configs: list, key: list[str]) -> triton.runtime.Autotuner:
    """The kernel autotuned over `configs` per `key`, with the timing and the on-disk cache of the results where this
    triton's autotune offers them (older ones: its defaults)."""
    offered = inspect.signature(triton.autotune).parameters
    options = {name: value for name, value in (("do_bench", _timed), ("cache_results", True)) if name in offered}
    return triton.autotune(configs=configs, key=key, **options)(_gemv_kernel)


_KEY = ["N", "K", "HAS_BIAS", "HAS_INDEX", "SWIGLU_PAIRS", "KW"]
# per form ("one_row", "few_rows", "rows"): its autotuner, and what a call outside `kernel_tuning.autotuning()` runs,
# the form's first configuration (the one-row form's is the tuning's usual H200 choice, see the module docstring);
# the few-rows form is tuned per padded row count too
_FORMS = {"one_row": (_autotuned(_ONE_ROW_CONFIGS, _KEY), _ONE_ROW_CONFIGS[0]),
          "few_rows": (_autotuned(_FEW_ROWS_CONFIGS, [*_KEY, "ROWS"]), _FEW_ROWS_CONFIGS[0]),
          "rows": (_autotuned(_ROWS_CONFIGS, _KEY), _ROWS_CONFIGS[0])}


def padded_rows(m: int, kind: str) -> int:
    """The rows the kernel computes for m rows of x in form `kind`: 1; a power of two up to FEW_ROWS; else ROWS."""
    return {"one_row": 1, "few_rows": triton.next_power_of_2(m), "rows": ROWS}[kind]


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # tests on CPUs: one fixed configuration, no timing


def triton_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rows: torch.Tensor | None = None, blocks: tuple[int, int] | None = None,
                swiglu_pairs: bool = False,
                convolution: tuple[torch.Tensor, torch.Tensor] | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (M <= ROWS, unit stride along K), weight [W, K] (unit stride along K), bias [W] or None, one dtype
    (see `out_dtype`), rows [N] (int32/int64 indices into W) or None for all W rows in order: [M, N] in x's dtype,
    column j the product
    with weight row rows[j] (see the module docstring); with `swiglu_pairs`, the products come in (gate, up) pairs
    (rows ordered so: `kernels_gemv.swiglu_pair_rows`) and the output is [M, N / 2], silu(gate) * up of each pair.
    `convolution` (kernels [C, KW], window [M, C, KW], both contiguous, C <= N): output columns below C are the short
    convolution's decoding step of the products (silu(sum over the taps of [window[..., 1:], product] * kernel)), and
    the window is updated in place (see the module docstring). `out_dtype` (default x's): the output's dtype, and
    with it a weight (and bias) of that dtype where x is narrower (`kernels_gemv.linear_widened`: the elementwise
    forms convert both to float32 as they read them; not the tl.dot form).
    `blocks` (BLOCK_N, BLOCK_K) runs that configuration instead of the autotuned one (tests; BLOCK_N >= 16 for the
    tl.dot form, `gemv_forms.form`; even for pairs); triton's interpreter runs (16, 128) by default."""
    M, K = x.shape[0], weight.shape[1]
    N = weight.shape[0] if rows is None else rows.shape[0]
    kind = form(M, N)
    y = torch.empty(M, N // 2 if swiglu_pairs else N, device=x.device, dtype=out_dtype or x.dtype)
    taps, window = convolution if convolution is not None else (weight, weight)  # (unread without a convolution)
    channels, width = taps.shape if convolution is not None else (0, 0)
    args = (x, weight, bias if bias is not None else weight, rows if rows is not None else weight, y, M, N, K,
            x.stride(0), weight.stride(0), y.stride(0), taps, window, window.stride(0), channels)
    flags = dict(HAS_BIAS=bias is not None, HAS_INDEX=rows is not None, SWIGLU_PAIRS=swiglu_pairs, KW=width,
                 BLOCK_KW=triton.next_power_of_2(max(width, 1)), ROWS=padded_rows(M, kind),
                 **dependent_launch(x.device))
    if blocks is None and _INTERPRETED:
        blocks = (16, 128)
    if blocks is not None:
        _gemv_kernel[(triton.cdiv(N, blocks[0]),)](*args, **flags, BLOCK_N=blocks[0], BLOCK_K=blocks[1])
    else:
        autotuner, default = _FORMS[kind]
        key = ("gemv", flags["ROWS"], N, K, bias is not None, rows is not None, swiglu_pairs, width)
        launch(autotuner, _gemv_kernel, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),), key, default, args, flags)
    return y

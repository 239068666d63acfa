"""A Triton GEMV for decoding steps: y = x W^T (+ b) for x of at most 16 rows, bf16/fp16, float32 accumulation.

Imported only for CUDA tensors (`kernels_gemv`), since importing triton needs a GPU driver. Each program owns BLOCK_N
output columns (weight rows) and streams their K inputs in BLOCK_K slices, software-pipelined by `num_stages`, with no
split over K: the weight is read once, at full width per row, and no second kernel reduces or casts partial sums. The
rows of x are padded to 16 (masked loads) so one `tl.dot` multiplies a slice on the tensor cores: the padding costs no
memory traffic, and a GEMV is bound by the weight's read. Configurations are autotuned per (N, K) on first use (in the
warm-up steps before a CUDA graph is captured, never inside the capture).
"""

from __future__ import annotations

import os

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton GEMV needs triton (a CUDA machine); decoding GEMVs run through cuBLAS") from error

ROWS = 16  # x rows handled (padded to this many for tl.dot)

# few configurations: each is compiled on first use, in the first capture's warm-up (about a second each)
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in ((16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (16, 256, 8, 4), (32, 256, 4, 3),
                       (32, 128, 8, 4))
]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


_tuned_kernel = triton.autotune(configs=_CONFIGS, key=["N", "K", "HAS_BIAS"])(_gemv_kernel)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # tests on CPUs: one fixed configuration, no timing


def triton_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (M <= ROWS, unit stride along K), weight [N, K] (unit stride along K), bias [N] or None, one dtype:
    [M, N] in x's dtype (see the module docstring)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    args = (x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0))
    if _INTERPRETED:
        _gemv_kernel[(triton.cdiv(N, 16),)](*args, HAS_BIAS=bias is not None, ROWS=ROWS, BLOCK_N=16, BLOCK_K=128)
    else:
        _tuned_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None, ROWS=ROWS)
    return y

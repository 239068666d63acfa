"""Norms of inference on CUDA go to this package's Triton kernels (`kernels_norm_triton`): the block RMSNorm
(`block_ops.rms_norm`, with its residual add), the GDN/KDA gated output norm (`ops.gated_rms_norm`) and the delta
rules' q/k L2 norm (`ops._delta_rule` before fla's chunked kernels). The one place that chooses them.

Why: fla's forward kernels for narrow rows take NB, a bucket of the row count (cdiv(rows, 2048) for the block norm of
up to 512 elements, cdiv(rows, 65536) for the gated norm and the L2 norm, rows = tokens x heads), as a constexpr that
is also an autotuning key. Each prompt length in a new bucket compiles and benchmarks every configuration again,
seconds at a time (on an H200 4 to 12 s per norm and bucket: docs/performance.md), and the buckets have no bound (a
million-token prompt has hundreds). This package's kernels are compiled per width, dtypes and flags: the row count is
a runtime argument, nothing is tuned, and a prompt of a new length compiles nothing
(`tests/test_prompt_lengths_compile_nothing.py`).

A norm runs as the kernel when no gradient is wanted (`torch.no_grad()`, or no input that requires one) and:
- `rms_norm`: x CUDA bf16/fp16/fp32, the weight a vector of its width on its device (bf16/fp16/fp32), the residual
  (if any) of x's shape, dtype and device;
- `gated_rms_norm`: x and gate CUDA bf16/fp16/fp32 of one shape, the weight a vector of their width;
- the L2 norm: q and k CUDA bf16/fp16/fp32, with fla's chunked kernel about to run (a prompt, not the one-token
  decoding step, whose fused recurrent kernel normalises in its own registers, with no NB);
and none of them a DTensor, torch.compile not tracing (a compiled forward keeps fla's kernels, which dynamo traces),
triton importable. Any layout is taken: rows are read at their strides, or copied contiguous where the leading
dimensions do not flatten. Training (a gradient wanted) keeps fla's kernels, whose backward it needs; CPU and float64
keep the torch path. A kernel that failed to compile for a layout is not tried again for it (one warning), and that
norm runs through fla. `NORM_DEVICE_TYPES`, `GATED_NORM_DEVICE_TYPES` and `L2_NORM_DEVICE_TYPES` emptied turn each off
(`benchmarks/profile_decode_step.py --ab norm`, `--ab gated_norm`).

In a decoding step the block norm's gain is latency: it reads the weight with the row, one memory round trip where
fla's kernel takes two (the step's time with each: docs/performance.md); the gated norm's is the dependent launch
(`kernels_launch_triton`) it takes part in, so the output projection's GEMV after it starts early.
"""

from __future__ import annotations

import torch

from .tensor_parallel_heads import device_mesh
from .triton_loading import kernel_result, triton_kernel

NORM_DEVICE_TYPES = ("cuda",)  # tests add "cpu", with the kernels stood in
GATED_NORM_DEVICE_TYPES = ("cuda",)
L2_NORM_DEVICE_TYPES = ("cuda",)
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (kind, width, dtypes, device, flags) -> the first error: that norm runs through fla from then on
_FAILED: dict = {}

_SILU = {"silu": True, "swish": True, "sigmoid": False}  # activation -> the gated kernel's SILU


@triton_kernel
def triton_rms_norm_kernel():
    """`kernels_norm_triton.triton_rms_norm`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_norm_triton import triton_rms_norm

    return triton_rms_norm


@triton_kernel
def triton_gated_rms_norm_kernel():
    """`kernels_norm_triton.triton_gated_rms_norm`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_norm_triton import triton_gated_rms_norm

    return triton_gated_rms_norm


@triton_kernel
def triton_l2_normalize_kernel():
    """`kernels_norm_triton.triton_l2_normalize`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_norm_triton import triton_l2_normalize

    return triton_l2_normalize


def _inference_on(device_types: tuple[str, ...], *tensors: torch.Tensor | None) -> bool:
    """Whether the tensors (None skipped) may go to a kernel of this package: on one of those device types, of a
    dtype it takes, no gradient wanted, no DTensor, torch.compile not tracing."""
    present = [t for t in tensors if t is not None]
    if any(t.device.type not in device_types or t.dtype not in NORM_DTYPES for t in present):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    return not torch.compiler.is_compiling() and all(device_mesh(t) is None for t in present)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as [rows, D] with a unit stride along D: a view where one exists, else a contiguous copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _heads(t: torch.Tensor) -> torch.Tensor:
    """t [..., heads, D] (or [D]: one head) as [outer, heads, D] with a unit stride along D: a view where one exists
    (a gate sliced from a wider projection output is read in place), else a contiguous copy."""
    heads = t.reshape(-1, *t.shape[-2:]) if t.dim() >= 2 else t.reshape(1, 1, -1)
    return heads if heads.stride(-1) == 1 else heads.contiguous()


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `block_ops.rms_norm(x, weight, eps, residual)` runs as the Triton kernel (the module docstring)."""
    if x.dim() == 0 or weight.shape != x.shape[-1:] or weight.device != x.device:
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        return False
    return _inference_on(NORM_DEVICE_TYPES, x, weight, residual) and triton_rms_norm_kernel() is not None


def inference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`block_ops.rms_norm`'s result through the Triton kernel, or None where it does not apply (`rms_norm_applies`)
    or failed for this layout: the caller then runs fla's kernel or torch."""
    if not rms_norm_applies(x, weight, residual):
        return None
    width = x.shape[-1]
    out = kernel_result(
        _FAILED, ("rms", width, x.dtype, weight.dtype, x.device, residual is not None), x,
        f"the Triton RMSNorm failed for width {width} and {x.dtype}; that norm runs through fla",
        lambda: triton_rms_norm_kernel()(_rows(x), weight, eps, _rows(residual) if residual is not None else None))
    if out is None or residual is None:
        return out if out is None else out.view(x.shape)
    return out[0].view(x.shape), out[1].view(x.shape)


def gated_rms_norm_applies(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, activation: str) -> bool:
    """Whether `ops.gated_rms_norm(x, gate, weight, activation=activation)` runs as the Triton kernel (the module
    docstring)."""
    if x.dim() == 0 or gate.shape != x.shape or gate.device != x.device or activation not in _SILU:
        return False
    if weight.shape != x.shape[-1:] or weight.device != x.device:
        return False
    return _inference_on(GATED_NORM_DEVICE_TYPES, x, gate, weight) and triton_gated_rms_norm_kernel() is not None


def inference_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             activation: str) -> torch.Tensor | None:
    """`ops.gated_rms_norm`'s result through the Triton kernel, or None where it does not apply
    (`gated_rms_norm_applies`) or failed for this layout: the caller then runs fla's kernel or torch."""
    if not gated_rms_norm_applies(x, gate, weight, activation):
        return None
    width = x.shape[-1]
    out = kernel_result(
        _FAILED, ("gated", width, x.dtype, gate.dtype, weight.dtype, x.device, activation), x,
        f"the Triton gated RMSNorm failed for width {width} and {x.dtype}; that norm runs through fla",
        lambda: triton_gated_rms_norm_kernel()(_heads(x), _heads(gate), weight, eps, _SILU[activation]))
    return out if out is None else out.view(x.shape)


def l2_normalize_applies(*tensors: torch.Tensor) -> bool:
    """Whether the L2 norms of `tensors` (the delta rules' q and k) run as the Triton kernel (the module docstring)."""
    return (all(t.dim() > 0 for t in tensors) and _inference_on(L2_NORM_DEVICE_TYPES, *tensors)
            and triton_l2_normalize_kernel() is not None)


def inference_l2_normalize(eps: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """x / sqrt(sum(x^2) + eps) over the last dim of each tensor (fla's l2norm), contiguous, through the Triton
    kernel; None where it does not apply (`l2_normalize_applies`) or failed for a layout: the caller then lets fla's
    kernel normalise."""
    if not l2_normalize_applies(*tensors):
        return None
    normed = []
    for t in tensors:
        out = kernel_result(
            _FAILED, ("l2", t.shape[-1], t.dtype, t.device), t,
            f"the Triton L2 norm failed for width {t.shape[-1]} and {t.dtype}; q and k are normalised by fla",
            lambda t=t: triton_l2_normalize_kernel()(_heads(t), eps))
        if out is None:
            return None
        normed.append(out.view(t.shape))
    return tuple(normed)

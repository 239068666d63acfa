"""The block RMSNorms of a captured decoding step (with their residual add) go to a Triton kernel of this package.

A batch-1 step runs 2 norms a layer plus the final one (33 in the 16-layer benchmark models), each a one-row kernel
of a few microseconds that is all memory latency: fla's kernel reads the norm weight only after the row's reduction,
a second round trip to HBM (`kernels_norm_triton` reads it with the row; the step's time with each:
docs/performance.md). Inside the decoding step's mode (`kernels_gemv.DecodeGemvMode`, which routes
`block_ops.rms_norm` here) the norm runs as `triton_rms_norm` when: the input is CUDA bf16/fp16/fp32,
contiguous, the weight a contiguous vector of its width on its device, the residual (if any) of its shape, dtype and
device, contiguous, no gradient wanted, triton importable. Anything else, and a kernel that failed to compile for a
layout (one warning, not tried again), keeps `block_ops.rms_norm` (fla or torch). `NORM_DEVICE_TYPES` emptied turns
it off (`benchmarks/profile_decode_step.py --ab norm`).

The GDN/KDA output norm (`ops.gated_rms_norm`, per head, with its gate) goes to `triton_gated_rms_norm` the same way
(`decode_gated_rms_norm`, `GATED_NORM_DEVICE_TYPES`; `--ab gated_norm`): x and gate CUDA of one dtype, each viewable
as [outer, heads, D] with a unit stride along D (the gate is a slice of the fused projection's output), the weight a
contiguous [D], silu or sigmoid. Its gain is the dependent launch (`kernels_launch_triton`) it takes part in, so the
output projection's GEMV after it starts early; at batch 1 one program takes a row's heads, up to 4,096 elements
(`triton_gated_rms_norm`), which keeps the GDN model's 32 heads in one program.
"""

from __future__ import annotations

import torch

from .block_ops import rms_norm
from .ops import gated_rms_norm
from .triton_loading import kernel_result, triton_kernel

NORM_DEVICE_TYPES = ("cuda",)
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_FAILED: dict = {}  # (width, dtypes, device, has residual) -> the first error: block_ops.rms_norm from then on


@triton_kernel
def triton_rms_norm_kernel():
    """`kernels_norm_triton.triton_rms_norm`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_norm_triton import triton_rms_norm

    return triton_rms_norm


def decode_norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether rms_norm(x, weight, eps, residual) may run as the Triton kernel (the module docstring's conditions)."""
    if x.device.type not in NORM_DEVICE_TYPES or x.dtype not in NORM_DTYPES or not x.is_contiguous():
        return False
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.device != x.device or not weight.is_contiguous():
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or not residual.is_contiguous()):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, residual)):
        return False
    return triton_rms_norm_kernel() is not None


def decode_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`block_ops.rms_norm`'s result, through the Triton kernel where `decode_norm_applies` (see the module
    docstring)."""
    width = x.shape[-1]
    out = None
    if x.numel() and decode_norm_applies(x, weight, residual):
        out = kernel_result(
            _FAILED, (width, x.dtype, weight.dtype, x.device, residual is not None), x,
            f"the Triton RMSNorm failed for width {width} and {x.dtype}; that norm runs through fla",
            lambda: triton_rms_norm_kernel()(x.view(-1, width), weight, eps,
                                             residual.view(-1, width) if residual is not None else None))
    if out is None:
        return rms_norm(x, weight, eps, residual=residual)
    if residual is None:
        return out.view(x.shape)
    return out[0].view(x.shape), out[1].view(x.shape)


GATED_NORM_DEVICE_TYPES = ("cuda",)  # (emptied: fla's kernel; benchmarks/profile_decode_step.py --ab gated_norm)
_GATED_FAILED: dict = {}  # (width, dtypes, device, activation) -> the first error: ops.gated_rms_norm from then on


@triton_kernel
def triton_gated_rms_norm_kernel():
    """`kernels_norm_triton.triton_gated_rms_norm`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_norm_triton import triton_gated_rms_norm

    return triton_gated_rms_norm


def decode_gated_norm_applies(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, activation: str) -> bool:
    """Whether gated_rms_norm(x, gate, weight) may run as the Triton kernel: x and gate [..., heads, D] of one shape,
    dtype (bf16/fp16/fp32) and device, each viewable as [outer, heads, D] with a unit stride along D, the weight a
    contiguous [D] vector on that device, silu or sigmoid, no gradient wanted, triton importable."""
    if x.device.type not in GATED_NORM_DEVICE_TYPES or x.dtype not in NORM_DTYPES or x.dim() < 2:
        return False
    if gate.shape != x.shape or gate.dtype != x.dtype or gate.device != x.device or activation not in _ACTIVATIONS:
        return False
    if weight.shape != x.shape[-1:] or weight.device != x.device or not weight.is_contiguous():
        return False
    if _as_heads(x) is None or _as_heads(gate) is None:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate, weight)):
        return False
    return triton_gated_rms_norm_kernel() is not None


_ACTIVATIONS = {"silu": True, "swish": True, "sigmoid": False}  # -> the kernel's SILU


def _as_heads(t: torch.Tensor) -> torch.Tensor | None:
    """t [..., heads, D] as an [outer, heads, D] view with a unit stride along D (None where the leading dimensions do
    not flatten to one stride)."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        return None


def decode_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                          activation: str = "silu") -> torch.Tensor:
    """`ops.gated_rms_norm`'s result, through the Triton kernel where `decode_gated_norm_applies`."""
    out = None
    if x.numel() and decode_gated_norm_applies(x, gate, weight, activation):
        out = kernel_result(
            _GATED_FAILED, (x.shape[-1], x.dtype, weight.dtype, x.device, activation), x,
            f"the Triton gated RMSNorm failed for width {x.shape[-1]} and {x.dtype}; that norm runs through fla",
            lambda: triton_gated_rms_norm_kernel()(_as_heads(x), _as_heads(gate), weight, eps,
                                                   _ACTIVATIONS[activation]))
    if out is None:
        return gated_rms_norm(x, gate, weight, eps=eps, activation=activation)
    return out.view(x.shape)

"""The linear layers of a captured decoding step: narrow bf16/fp16 GEMVs go to a Triton kernel of this package.

At batch 1 to 16 a linear layer reads its weight once and does little else, so it should run at the memory bandwidth.
cuBLAS does for wide outputs, but not for narrow ones: on an H200 (`benchmarks/bench_decode_gemv.py`, bf16, batch 1)
the GEMVs with 2,048 outputs (GDN's out_proj, the MLPs' down_proj, the attention's o_proj) ran at 29-43% of 4.8 TB/s,
MLA's 576-wide kv_a at 8% and a 1,024-wide shared expert at 7%, against 65-79% for outputs of 8k and more. Weights of
at most `NARROW_OUTPUTS` rows therefore run through `kernels_gemv_triton.triton_gemv` (float32 accumulation, as
cuBLAS's; the sums are ordered differently, so results agree to rounding). Measured side by side (same run, H200,
bf16, batch 1 / 16): 1.07-1.16x cuBLAS for the 2,048-wide outputs, 1.22-1.29x for MLA's 576-wide kv_a, 2.5x / 1.15x
for the 1,024-wide shared expert; MLA's 3,072-wide q was slower (0.89x) and every output of 8k and more too
(0.75-0.96x), hence the limit of 2,048. A replayed step gained 1.6% (GDN) and 2.9% (Kimi-Linear) with its other
kernels on the torch path (`profile_decode_step.py --gemv-ab`). It runs when:
- the input is CUDA bf16/fp16 with at most 16 rows and a unit stride along its features, the weight a plain 2-D tensor
  of the same dtype (a bias too, or none), no gradient wanted, triton importable, a GPU of compute capability 8.0 or
  later (a kernel that still fails to compile is dropped for that shape, with a warning: `decode_linear`);
- the call happens inside a captured decoding step (`decode_gemv_mode`, entered by `CudaGraphDecoder` around the
  step it records): every `F.linear` of the step is looked at there, whichever module calls it (projections, LoRA
  layers' base weights, the LM head), and the graph replays the chosen kernels with no Python at all.
Anything else keeps `F.linear`. The kernel is autotuned in the warm-up steps before the capture.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .tensor_parallel_heads import device_mesh

logger = logging.getLogger(__name__)

NARROW_OUTPUTS = 2048  # out_features up to this go to the Triton GEMV (see the module docstring)
MAX_ROWS = 16  # rows of x (batch x tokens) the kernel takes
GEMV_DTYPES = (torch.bfloat16, torch.float16)
GEMV_DEVICE_TYPES = ("cuda",)  # tests add "cpu", with the kernel stood in


@functools.cache
def triton_gemv_kernel():
    """`kernels_gemv_triton.triton_gemv`, or None where triton cannot be imported (CPU machines)."""
    try:
        from .kernels_gemv_triton import triton_gemv
    except Exception as error:  # ImportError, or triton finding no driver
        logger.debug(f"the Triton GEMV is not available ({error!r}); decoding GEMVs run through cuBLAS")
        return None
    return triton_gemv


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether F.linear(x, weight, bias) may run as the Triton GEMV (the conditions of the module docstring)."""
    if x.device.type not in GEMV_DEVICE_TYPES or x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        return False
    if weight.dim() != 2 or weight.device != x.device or x.shape[-1] != weight.shape[1]:
        return False
    if weight.shape[0] > NARROW_OUTPUTS:
        return False
    if x.numel() // max(x.shape[-1], 1) > MAX_ROWS or x.stride(-1) != 1 or weight.stride(1) != 1:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if device_mesh(weight) is not None or device_mesh(x) is not None:
        return False
    return triton_gemv_kernel() is not None and _capable(x.device)


@functools.cache
def _capable(device: torch.device) -> bool:
    """GPUs whose tensor cores `tl.dot` drives in bf16 and fp16 (compute capability 8.0 on: Ampere, Hopper, ...)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


_FAILED: dict = {}  # (weight shape, dtype, device) -> the error of the kernel's first try: cuBLAS from then on


def decode_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(input, weight, bias), through the Triton GEMV where `gemv_applies`. A kernel that fails (a GPU or triton
    it cannot compile for) is not tried again for that shape, and one warning says so: the step is still captured,
    with cuBLAS (the first try happens in the warm-up before a capture, never inside it). Arguments named as
    F.linear's, so the mode passes a call's positional and keyword arguments through as they are."""
    x = input
    key = (tuple(weight.shape), x.dtype, x.device)
    if key in _FAILED or not gemv_applies(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # a view for a decoding step's inputs (the kernel takes any row stride)
    try:
        out = triton_gemv_kernel()(rows, weight, bias)
    except Exception as error:  # compilation or launch failure
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _FAILED[key] = error
        logger.warning(f"the Triton GEMV failed for a {tuple(weight.shape)} {x.dtype} weight ({type(error).__name__}: "
                       f"{str(error)[:200]}); that product runs through cuBLAS")
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class DecodeGemvMode(TorchFunctionMode):
    """Sends the F.linear calls made while it is active through `decode_linear`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return decode_linear(*args, **kwargs)  # F.linear's own signature: (input, weight, bias=None)
        return func(*args, **kwargs)


def decode_gemv_mode(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a decoding step is recorded in: `DecodeGemvMode` on CUDA with triton importable, else nothing."""
    if device.type not in GEMV_DEVICE_TYPES or triton_gemv_kernel() is None:
        return contextlib.nullcontext()
    return DecodeGemvMode()

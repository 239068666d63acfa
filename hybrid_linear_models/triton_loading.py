"""This package's own Triton kernels, imported on first use: importing triton needs a GPU driver, and CPU machines (CI,
`trust_remote_code`'s import scan) have neither, so a kernel module is imported only when a CUDA step asks for it.

A kernel is loaded by a function decorated with `triton_kernel` whose body imports it with a plain relative line,
`from .kernels_x_triton import f`, inside the function. That line is what makes the kernel travel with a saved
folder: transformers' `save_pretrained` and its remote-code loader follow `from .x import` lines (inside functions
too) to copy a module's siblings, and `conversion.remote_code` follows the same lines to ship them. So a folder loaded
with `trust_remote_code=True` where this package is not installed imports the same kernel modules from its own
dynamic-module folder, and without triton both report them unavailable alike."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


KERNEL_LOADERS: list[Callable[[], object]] = []  # every `triton_kernel` loader, for checks that each one resolves
UNAVAILABLE: dict[str, Exception] = {}  # loader's qualified name -> why its kernel could not be imported


def triton_kernel(load: Callable[[], T]) -> Callable[[], T | None]:
    """`load` (a function that imports a kernel relatively and returns it) run once: the kernel, or None where it
    cannot be imported (no triton, no driver; the reason kept in UNAVAILABLE), and the caller then keeps its torch
    path."""

    @functools.cache
    @functools.wraps(load)
    def loaded() -> T | None:
        try:
            return load()
        except Exception as error:  # ImportError, or triton finding no driver
            UNAVAILABLE[f"{load.__module__}.{load.__qualname__}"] = error
            logger.debug(f"{load.__name__}: the kernel is not available ({error!r}); the torch path runs instead")
            return None

    KERNEL_LOADERS.append(loaded)
    return loaded


@functools.cache
def has_bf16_tensor_cores(device: torch.device) -> bool:
    """GPUs whose tensor cores `tl.dot` drives in bf16 and fp16 (compute capability 8.0 on: Ampere, Hopper, ...);
    True off CUDA (triton's interpreter in tests)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def record_failure(failed: dict, key, error: Exception, tensor: torch.Tensor, what: str) -> None:
    """A kernel of this package failed (a GPU or triton it cannot compile for): inside a CUDA graph capture the error
    propagates (the capture then fails as a whole, with its reason); otherwise it is kept under `key` in `failed`, so
    the caller does not try that kernel again for that layout, and one warning says `what` runs instead."""
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise error
    failed[key] = error
    logger.warning(f"{what} ({type(error).__name__}: {str(error)[:200]})")


def kernel_result(failed: dict, key, tensor: torch.Tensor, what: str, call: Callable[[], T]) -> T | None:
    """call(), a kernel of this package on `tensor`'s device, or None where it failed for `key`, before (kept in
    `failed`) or now (`record_failure`: one warning saying `what` runs instead): the caller then runs its torch
    path."""
    if key in failed:
        return None
    try:
        return call()
    except Exception as error:  # compilation or launch failure
        record_failure(failed, key, error, tensor, what)
        return None


def unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with a unit stride along its last dim (a view where it has one, else a contiguous copy): how the
    kernels read a weight's or an input's rows."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()

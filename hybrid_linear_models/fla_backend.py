"""flash-linear-attention (fla) as an optional backend: its Triton kernels serve CUDA tensors when it is importable.

Nothing here imports fla or triton at import time (CPU machines have neither, and the remote-code import scanner of
`trust_remote_code` must not require them): `fla_kernels()` imports them on the first CUDA call. Every op that has a
slower torch path says once in the log when that path runs. Each op is loaded from its own module (`FLA_KERNELS`),
and `fla_kernel` is the one place where an op is sent to fla or to torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

import torch

from .tensor_parallel_heads import device_mesh

logger = logging.getLogger(__name__)

_announced: set[str] = set()


def announce_once(key: str, message: str, level: int = logging.INFO) -> None:
    if key not in _announced:
        _announced.add(key)
        logger.log(level, message)


# Each op fla serves, and where it lives: loaded one module at a time on first use, so that a module missing from an
# installed fla version (or failing to import) sends only its own ops to the torch path.
FLA_KERNELS = {
    "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule",
    "chunk_kda": "fla.ops.kda",
    "fused_recurrent_kda": "fla.ops.kda",
    # the decoding step's state updated in place (recurrent_in_place.py)
    "fused_recurrent_gated_delta_rule_fwd_kernel": "fla.ops.gated_delta_rule.fused_recurrent",
    "fused_recurrent_kda_fwd": "fla.ops.kda.fused_recurrent",
    "causal_conv1d": "fla.modules.causal_conv1d",
    "causal_conv1d_update": "fla.modules.causal_conv1d",
    "rms_norm": "fla.modules.norm.layernorm",
    "rms_norm_gated": "fla.modules.norm.fused_norm_gate",
    "swiglu": "fla.modules.activations",
    "fused_linear_cross_entropy_loss": "fla.modules.fused_linear_cross_entropy",
}


class LazyFlaKernels:
    """fla's ops as attributes, each imported from its module on first access; None for an op whose module or
    function cannot be imported (said once in the log)."""

    def __getattr__(self, name: str):
        if name not in FLA_KERNELS:
            raise AttributeError(name)
        kernel = _load_kernel(FLA_KERNELS[name], name)
        setattr(self, name, kernel)  # later lookups skip __getattr__
        return kernel


def _load_kernel(module_name: str, name: str):
    try:
        return getattr(importlib.import_module(module_name), name)
    except Exception as error:  # ImportError, AttributeError, or triton failing inside the module
        announce_once(f"fla-missing-{module_name}.{name}",
                      f"fla is installed but {module_name}.{name} is not importable ({error!r}); that op runs on "
                      "this package's torch path. Install a flash-linear-attention version in this package's range.",
                      logging.WARNING)
        return None


@functools.cache
def fla_kernels() -> LazyFlaKernels | None:
    """fla's ops (loaded per op), or None when fla itself (or triton) cannot be imported."""
    try:
        importlib.import_module("fla")
    except Exception as error:  # ImportError, or triton failing to find a driver
        announce_once("fla-missing", f"flash-linear-attention is not importable ({error!r}).", logging.DEBUG)
        return None
    return LazyFlaKernels()


def fla_for(tensor: torch.Tensor) -> LazyFlaKernels | None:
    """fla's ops when calls on this tensor may go to them (a CUDA tensor, fla importable), else None. The one hook
    through which every op reaches fla (tests stand in a namespace of contracts here)."""
    return fla_kernels() if tensor.is_cuda else None


def fla_kernel(name: str, tensor: torch.Tensor, *others: torch.Tensor):
    """The fla kernel `name` for an op on `tensor` (and `others`), or None when the op takes this package's torch
    path: not CUDA, fla or that kernel not importable, float64 (the torch path keeps its precision), or any tensor a
    DTensor (fla's kernels take plain tensors). The one place where fla or torch is chosen."""
    fla = fla_for(tensor)
    if fla is None or tensor.dtype == torch.float64 or any(device_mesh(t) is not None for t in (tensor, *others)):
        return None
    return getattr(fla, name, None)


def fla_training_refusal(device: torch.device) -> str | None:
    """Why fla's gated backward kernels would refuse to train on `device` (None where they run, or fla does not
    serve it): fla 0.6 raises in the first backward on Hopper with triton 3.4 to 3.7.0 (incorrect results, its issue
    #640), after a forward that can take minutes of first-use autotuning; a training script asks here first."""
    if torch.device(device).type != "cuda" or fla_kernels() is None:
        return None
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # (a version without these flags has no such refusal)
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if importlib.util.find_spec("tilelang") is not None:  # (fla's other backend for that kernel)
        return None
    import triton

    return (f"fla's gated backward refuses triton {triton.__version__} on this Hopper GPU (incorrect results, fla "
            "#640): install triton>=3.7.1 (`pip install -U 'triton>=3.7.1'`) or tilelang before training")


def fla_available_for(tensor: torch.Tensor) -> bool:
    """Whether the delta rules on this tensor go to fla's kernels."""
    return fla_kernel("chunk_gated_delta_rule", tensor) is not None


def note_torch_path(tensor: torch.Tensor, what: str) -> None:
    """Says once that an op ran on this package's torch kernels (a warning on CUDA, where fla would be faster)."""
    if tensor.is_cuda:
        announce_once(
            "torch-on-cuda",
            f"{what}: flash-linear-attention is not importable, so GDN/KDA run on this package's pure-PyTorch "
            "kernels on the GPU, much slower than fla's. Install the [gpu] extra (flash-linear-attention, triton).",
            logging.WARNING,
        )
    else:
        announce_once(
            "torch-on-cpu",
            f"{what}: running GDN/KDA with the pure-PyTorch chunked kernels ({tensor.device.type}); "
            "fla's kernels are used for CUDA tensors when installed.",
        )

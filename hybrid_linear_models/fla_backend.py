"""flash-linear-attention (fla) as an optional backend: its Triton kernels serve CUDA tensors when it is importable.

Nothing here imports fla or triton at import time (CPU machines have neither, and the remote-code import scanner of
`trust_remote_code` must not require them): `fla_kernels()` imports them on the first CUDA call. Every op that has a
slower torch path says once in the log when that path runs.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import SimpleNamespace

import torch

from .tensor_parallel_heads import device_mesh

logger = logging.getLogger(__name__)

_announced: set[str] = set()


def announce_once(key: str, message: str, level: int = logging.INFO) -> None:
    if key not in _announced:
        _announced.add(key)
        logger.log(level, message)


@functools.lru_cache(maxsize=None)
def fla_kernels() -> SimpleNamespace | None:
    """fla's ops, or None when fla (or triton) cannot be imported."""
    try:
        gdn = importlib.import_module("fla.ops.gated_delta_rule")
        kda = importlib.import_module("fla.ops.kda")
        conv = importlib.import_module("fla.modules.causal_conv1d")
        norm = importlib.import_module("fla.modules.norm.layernorm")
        gated_norm = importlib.import_module("fla.modules.norm.fused_norm_gate")
        activations = importlib.import_module("fla.modules.activations")
        loss = importlib.import_module("fla.modules.fused_linear_cross_entropy")
    except Exception as error:  # ImportError, or triton failing to find a driver
        announce_once("fla-missing", f"flash-linear-attention is not importable ({error!r}).", logging.DEBUG)
        return None
    return SimpleNamespace(
        chunk_gated_delta_rule=gdn.chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule=gdn.fused_recurrent_gated_delta_rule,
        chunk_kda=kda.chunk_kda,
        fused_recurrent_kda=kda.fused_recurrent_kda,
        causal_conv1d=conv.causal_conv1d,
        causal_conv1d_update=conv.causal_conv1d_update,
        rms_norm=norm.rms_norm,
        rms_norm_gated=gated_norm.rms_norm_gated,
        swiglu=activations.swiglu,
        fused_linear_cross_entropy_loss=loss.fused_linear_cross_entropy_loss,
    )


def fla_for(tensor: torch.Tensor) -> SimpleNamespace | None:
    """fla's ops when calls on this tensor go to them (a CUDA tensor, fla importable), else None."""
    return fla_kernels() if tensor.is_cuda else None


def fla_ops_for(tensor: torch.Tensor, *others: torch.Tensor) -> SimpleNamespace | None:
    """fla's ops for an op on `tensor` (and `others`) that has an exact torch path: `fla_for(tensor)`, but None for
    float64 (the torch path keeps its precision) and when any of them is a DTensor (fla's kernels take plain
    tensors)."""
    fla = fla_for(tensor)
    if fla is None or tensor.dtype == torch.float64 or any(device_mesh(t) is not None for t in (tensor, *others)):
        return None
    return fla


def fla_available_for(tensor: torch.Tensor) -> bool:
    """Whether calls on this tensor go to fla's kernels."""
    return fla_for(tensor) is not None


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

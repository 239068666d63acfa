"""A `from_pretrained` whose device map puts more weight bytes on a GPU than it has free is refused before any
weight is read or any device memory reserved: one line naming the device, the bytes the weights need there, those
free, and what fits instead. transformers would read shard after shard and fail with an out-of-memory error partway
(minutes into the released flagships' 82 to 96 GB).

The bytes are the model's own, counted on the meta device where transformers builds it before loading: every
parameter and buffer in the dtype it will hold (FP8 weights one byte, their float32 scales four), placed by the
device map as transformers places it (`expand_device_map`). Free: the device's free memory plus what torch's
allocator holds unused there. Loads that shard or quantize on the fly (a device mesh, DeepSpeed ZeRO-3, a
transformers quantizer) count other bytes and are not checked here.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn
from transformers.integrations.accelerate import expand_device_map

from .device_placement import placement_device

CHECKED_DEVICE_TYPES = ("cuda",)  # (tests add "cpu", `free_bytes` stood in)
GIB = 2 ** 30


def free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on the CUDA device `device` can take: its free memory plus what torch's caching
    allocator holds there unused."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(index)
    return free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)


def weight_bytes_by_device(model: nn.Module, device_map: dict[str, Any]) -> dict[torch.device, int]:
    """The bytes of `model`'s parameters and buffers that `device_map` places on each device of
    `CHECKED_DEVICE_TYPES` (shared tensors once)."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    placements = expand_device_map(device_map, list(tensors))
    needed: dict[torch.device, int] = collections.Counter()
    for name, tensor in tensors.items():
        device = _indexed(placement_device(placements[name]))
        if device is not None and device.type in CHECKED_DEVICE_TYPES:
            needed[device] += tensor.numel() * tensor.element_size()
    return dict(needed)


def _indexed(device: torch.device | None) -> torch.device | None:
    """`device` with its index: "cuda" is the current CUDA device (a map naming one GPU "cuda" and 0 places both
    parts on it, counted together)."""
    if device is not None and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _size(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB // 10 else f"{count / 2**20:.2f} MiB"


def check_weights_fit(model: nn.Module, load_config: Any) -> None:
    """Raises one ValueError line where the weights `load_config.device_map` places on a device exceed its free
    memory (see the module docstring); nothing for loads it does not check."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if (not load_config.device_map or load_config.device_mesh is not None or load_config.hf_quantizer is not None
            or is_deepspeed_zero3_enabled()):
        return
    fp8 = any(tensor.is_floating_point() and tensor.element_size() == 1 for tensor in model.parameters())
    smaller = "a smaller checkpoint" if fp8 else "a smaller checkpoint (an FP8 one) or dtype (torch.bfloat16)"
    for device, needed in weight_bytes_by_device(model, load_config.device_map).items():
        free = free_bytes(device)
        if needed > free:
            raise ValueError(
                f"The model's weights need {_size(needed)} on {device}, which has {_size(free)} free: load "
                f"{smaller}, free the device, or spread the model over devices with device_map=\"auto\" "
                "(max_memory= sets each device's share).")


__all__ = ["CHECKED_DEVICE_TYPES", "check_weights_fit", "free_bytes", "weight_bytes_by_device"]

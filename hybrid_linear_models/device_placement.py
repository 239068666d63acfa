"""The device a `device_map` value names: a device name or torch.device, an index of the accelerator, "cpu", or
"disk" (accelerate's offload, no device)."""

from __future__ import annotations

from typing import Any

import torch


def placement_device(placement: Any) -> torch.device | None:
    """The torch.device of a device map's value; None for "disk" and for a name this torch does not know."""
    if placement == "disk":
        return None
    if isinstance(placement, int):  # (an index of the accelerator, as accelerate writes them)
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type if accelerator is not None else "cuda", placement)
    try:
        return torch.device(placement)
    except (RuntimeError, TypeError, ValueError):
        return None


def placement_type(placement: Any) -> str:
    """The device type of a device map's value ("disk", or the name itself where torch does not know it)."""
    device = placement_device(placement)
    return device.type if device is not None else str(placement)


__all__ = ["placement_device", "placement_type"]

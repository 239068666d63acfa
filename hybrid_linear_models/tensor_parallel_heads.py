"""Tensor parallelism of the GDN/KDA mixers: which heads a rank computes.

Under transformers' tensor parallelism (`DistributedConfig(tp_plan="auto")` in `from_pretrained`) the mixers' large
projections are split by heads: column-wise on the way in (GDN's fused projections are grouped by key head, so every
rank's rows are whole heads), row-wise on the way out. Their small per-channel parameters (short-convolution kernels,
dt_bias, A_log) and the gated norm's weight stay replicated: each rank slices the rows of its own heads, and since their
gradients then cover only those heads, the gradients are summed over the tensor-parallel group (as transformers'
`replicated_with_grad_allreduce` does for q/k norms).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class LocalHeads(NamedTuple):
    """Heads [offset, offset + count) of `total` are computed on this rank."""

    offset: int
    count: int
    total: int

    @property
    def sharded(self) -> bool:
        return self.count != self.total

    def rows(self, per_head: int) -> slice:
        return slice(self.offset * per_head, (self.offset + self.count) * per_head)


def device_mesh(tensor: torch.Tensor):
    """The device mesh of a DTensor (a tensor-parallel shard or replica); None for a plain tensor."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return tensor.device_mesh if isinstance(tensor, DTensor) else None


def local_heads(projection: nn.Linear, total: int, layer_idx: int | None = None, field: str = "heads") -> LocalHeads:
    """The heads whose rows of `projection` (split by heads when tensor parallel) live on this rank; `layer_idx` and
    `field` name the layer's setting in the error (head counts can differ between layers)."""
    mesh = device_mesh(projection.weight)
    if mesh is None:
        return LocalHeads(0, total, total)
    size = mesh.size()
    if total % size:
        where = f"layer {layer_idx}'s {field}" if layer_idx is not None else "the head count"
        raise ValueError(f"Tensor parallelism over {size} ranks needs {where} divisible by {size}, got {total}; use a "
                         f"tensor-parallel size that divides it (per_layer_config[{layer_idx}].{field} or {field}).")
    count = total // size
    return LocalHeads(mesh.get_local_rank() * count, count, total)


def sum_gradients_over_ranks(module: nn.Module, parameters: list[nn.Parameter], projection: nn.Linear) -> None:
    """Makes the gradients of replicated `parameters`, which each rank fills for its own heads only, summed over the
    tensor-parallel group of `projection`. The hooks are attached on first use (loading replaces the parameters)."""
    mesh = device_mesh(projection.weight)
    if mesh is None or not torch.is_grad_enabled():
        return
    hooked = module.__dict__.setdefault("_tensor_parallel_hooked", [])
    group = mesh.get_group()

    def all_reduce(param: nn.Parameter) -> None:
        torch.distributed.all_reduce(param.grad, group=group)

    for param in parameters:
        if param.requires_grad and not any(param is seen for seen in hooked):
            param.register_post_accumulate_grad_hook(all_reduce)
            hooked.append(param)

"""A MoE block's top-k routing and its gated shared-expert sum, as one kernel each at inference.

    route_top_k:    s = softmax(logits) in float32 (Qwen3-Next), or sigmoid(logits) (Kimi-Linear); the choice c = s,
                    or s + bias (Kimi-Linear's correction bias); e = the k largest c; w = s[e]; w /= sum(w) + eps if
                    asked; w *= scale; w in the logits' dtype
    add_gated:      routed + sigmoid(gate) * shared (or routed + shared: a shared part without a gate)

On CUDA, where no gradient is wanted (and torch.compile is not tracing, no DTensor), each runs as one Triton kernel
(`kernels_moe_triton`) in place of torch's five to ten (the module docstring there gives their rounding). Elsewhere,
and for training, torch's ops below: the reference, whose gradients flow. A kernel that failed for a layout is not
tried again for it (one warning), and that layout runs through torch.
"""

from __future__ import annotations

import torch

from .tensor_parallel_heads import device_mesh
from .triton_loading import kernel_result, triton_kernel

MOE_DEVICE_TYPES = ("cuda",)  # tests add "cpu", the kernels run by triton's interpreter
MOE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MOST_EXPERTS = 8192  # a router row the routing kernel holds in registers (more: torch)

_FAILED: dict = {}  # (kind, shape, dtype, device) -> the first error: torch from then on


@triton_kernel
def triton_route_top_k_kernel():
    """`kernels_moe_triton.triton_route_top_k`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_moe_triton import triton_route_top_k

    return triton_route_top_k


@triton_kernel
def triton_add_gated_kernel():
    """`kernels_moe_triton.triton_add_gated`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_moe_triton import triton_add_gated

    return triton_add_gated


def _inference_on(*tensors: torch.Tensor) -> bool:
    """Whether the tensors may go to a kernel of this module: one device of MOE_DEVICE_TYPES, a dtype of MOE_DTYPES,
    unit stride along the last dim, no gradient wanted, no DTensor, torch.compile not tracing."""
    if any(t.device != tensors[0].device or t.device.type not in MOE_DEVICE_TYPES or t.dtype not in MOE_DTYPES
           or t.dim() != 2 or t.stride(-1) != 1 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not torch.compiler.is_compiling() and all(device_mesh(t) is None for t in tensors)


def route_top_k(logits: torch.Tensor, k: int, *, sigmoid: bool = False, normalize: bool = True,
                bias: torch.Tensor | None = None, eps: float = 0.0, scale: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E]: (weights [T, k] in the logits' dtype, experts [T, k] int64), each row's k experts of the largest
    choice in descending order (see the module docstring)."""
    if (_inference_on(logits) and 0 < k <= logits.shape[1] <= MOST_EXPERTS
            and (bias is None or (bias.shape == logits.shape[1:] and bias.device == logits.device
                                  and bias.dtype in MOE_DTYPES and bias.is_contiguous()))
            and triton_route_top_k_kernel() is not None):
        key = ("top_k", logits.shape[1], k, sigmoid, normalize, bias is not None, logits.dtype, logits.device)
        out = kernel_result(_FAILED, key, logits,
                            f"the Triton top-k routing failed for {logits.shape[1]} experts; routing runs through "
                            "torch",
                            lambda: triton_route_top_k_kernel()(logits, k, sigmoid, normalize, bias, eps, scale))
        if out is not None:
            return out
    if sigmoid:
        scores = logits.sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if bias is None:
        weights, experts = torch.topk(scores, k, dim=-1)
    else:  # only the choice's indices are used: computed outside autograd (no graph kept for it)
        experts = (scores.detach() + bias.to(scores.dtype)).topk(k, dim=-1).indices
        weights = scores.gather(1, experts)
    if normalize:  # (eps 0 and scale 1 leave every value as it is: the weights are >= 0)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return (weights * scale).to(logits.dtype), experts


def add_gated(routed: torch.Tensor, gate: torch.Tensor | None, shared: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(gate [T, 1]) * shared [T, H] (routed + shared where gate is None), in routed's dtype;
    routed may be each token's k routes [T, k, H], summed first (in float32 for bf16/fp16 rows, rounded once)."""
    flat = routed.flatten(1) if routed.dim() == 3 and routed.is_contiguous() else routed  # ([T, k H] for the checks)
    gates = (gate,) if gate is not None else ()
    if (_inference_on(flat, *gates, shared) and (routed.shape[0], routed.shape[-1]) == shared.shape
            and (gate is None or (gate.shape == (routed.shape[0], 1) and gate.dtype == routed.dtype))
            and routed.dtype == shared.dtype and triton_add_gated_kernel() is not None):
        out = kernel_result(_FAILED, ("add_gated", routed.shape[1:], routed.dtype, routed.device), routed,
                            f"the Triton gated sum failed for routed rows {tuple(routed.shape[1:])}; it runs through "
                            "torch", lambda: triton_add_gated_kernel()(routed, gate, shared))
        if out is not None:
            return out
    routed = sum_routes(routed)
    return routed + (shared if gate is None else torch.sigmoid(gate) * shared)


def sum_routes(routed: torch.Tensor) -> torch.Tensor:
    """routed [T, H] as it is, or each token's k rows [T, k, H] summed (in float32 for bf16/fp16, rounded once: as
    the experts' grouped path sums them)."""
    if routed.dim() == 2:
        return routed
    return routed.sum(1, dtype=torch.promote_types(routed.dtype, torch.float32)).to(routed.dtype)


__all__ = ["MOE_DEVICE_TYPES", "add_gated", "route_top_k", "sum_routes"]

"""The experts of a decoding step as one GEMV launch per projection, each (token, expert) route's row times its
expert's weight: no sort, no offsets, no gather (`HybridLinearExperts.route_rows`).

    gate_up[r] = x[r // k] @ W_gate_up[e_r]^T                    r = t k + j: token t's j-th route, to expert e_r
    rows[t, j] = (silu(gate) * up * w_r)[r] @ W_down[e_r]^T      the routing weight applied before down_proj

The MoE block sums each token's k rows (in float32, rounded once: `moe_inference_ops.add_gated`, or the block's own
sum) and adds its shared part. These are the grouped path's values (experts_grouped_gather: the same products,
SwiGLU and weight each rounded to the dtype as its torch ops round, the same float32 sum of the k rows) up to the
order of each product's float32 sums.

At batch 1 the grouped path is a sort, a search for the offsets, gathers of the rows and weights, two grouped GEMMs of
one row per expert and the un-permutation: some dozen kernels a layer, where this is two. Each route reads its
expert's weight, so two routes to one expert read it twice, which a decoding step's few routes seldom do: past
ROUTED_MAX_ROUTES routes (a prompt), the grouped path reads each expert once. On CUDA, where no gradient is wanted
(training keeps the grouped path's autograd), the kernel is `kernels_routed_experts_triton`; `routed_linear` off the
GPU is the torch reference it is checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations as transformers_activations

from .tensor_parallel_heads import device_mesh
from .triton_loading import kernel_result, triton_kernel, unit_stride

ROUTED_DEVICE_TYPES = ("cuda",)  # (tests add "cpu": the kernel run by triton's interpreter, or the reference)
ROUTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# routes (tokens x top-k) up to which a step's experts take the routed GEMV (a decoding step's, a verify round's);
# emptied to 0 by benchmarks/profile_decode_step.py --ab routed_bf16
ROUTED_MAX_ROUTES = 64

# the activations that are silu (torch's module, transformers' ACT2FN["silu"]): their experts' SwiGLU is computed as
# the down projection reads its input
_SILU_TYPES = tuple({nn.SiLU, getattr(transformers_activations, "SiLUActivation", nn.SiLU)})
_FAILED: dict = {}  # (key) -> the first error: the reference from then on


def is_silu(act_fn: Callable) -> bool:
    """Whether the activation `act_fn` (a module, or F.silu itself) computes silu."""
    return act_fn is F.silu or isinstance(act_fn, _SILU_TYPES)


@triton_kernel
def routed_experts_kernel():
    """`kernels_routed_experts_triton.triton_routed_experts`, or None where triton cannot be imported."""
    from .kernels_routed_experts_triton import triton_routed_experts

    return triton_routed_experts


def check_routes(x: torch.Tensor, weight: torch.Tensor, routes: torch.Tensor, gated_by: torch.Tensor | None) -> None:
    """A ValueError line unless weight is [E, N, K], routes [S] integer with S a multiple of x's rows, and x [T, K]
    (or, with gated_by [S], [S, 2K])."""
    inputs = weight.shape[-1] * (2 if gated_by is not None else 1)
    rows = x.shape[0] if x.dim() == 2 else 0
    if (weight.dim() != 3 or x.dim() != 2 or x.shape[1] != inputs or routes.dim() != 1 or routes.is_floating_point()
            or (rows and routes.shape[0] % rows) or (not rows and routes.shape[0])):
        per_route = " (a [gate | up] row per route)" if gated_by is not None else ""
        raise ValueError(f"routed experts: x {tuple(x.shape)} must be [T, {inputs}]{per_route} for the weight "
                         f"{tuple(weight.shape)} [E, N, K] and routes {tuple(routes.shape)} {routes.dtype} one integer "
                         "expert per route, the same number for each row of x")
    if gated_by is not None and (gated_by.shape != (routes.shape[0],) or rows != routes.shape[0]):
        raise ValueError(f"routed experts: gated_by {tuple(gated_by.shape)} must hold one routing weight per route "
                         f"({routes.shape[0]}), and x one row per route")


def kernel_applies(x: torch.Tensor, weight: torch.Tensor, routes: torch.Tensor) -> bool:
    """Whether `routed_linear` runs the kernel: x on a device of ROUTED_DEVICE_TYPES, x and the weight of one
    ROUTED_DTYPES dtype and device (routes there too), no gradient wanted, no sharded weight, no compiler tracing."""
    if (x.device.type not in ROUTED_DEVICE_TYPES or x.dtype not in ROUTED_DTYPES or weight.dtype != x.dtype
            or weight.device != x.device or routes.device != x.device):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return not torch.compiler.is_compiling() and device_mesh(weight) is None


def routed_linear(x: torch.Tensor, weight: torch.Tensor, routes: torch.Tensor,
                  gated_by: torch.Tensor | None = None) -> torch.Tensor:
    """[S, N]: route r's row of x times its expert's weight, x [T, K] with S / T routes a row, weight [E, N, K], routes
    [S]; with `gated_by` [S] (any float dtype, taken in x's), x is a [gate | up] row per route and the input
    silu(gate) * up * gated_by[r], each op rounded to x's dtype. A route outside 0..E-1 (another rank's expert) gives a row of zeros. On CUDA one launch
    (`kernels_routed_experts_triton`); elsewhere each route's weight gathered and multiplied (the reference)."""
    check_routes(x, weight, routes, gated_by)
    if kernel_applies(x, weight, routes) and routed_experts_kernel() is not None and (
            gated_by is None or (gated_by.is_floating_point() and gated_by.device == x.device)):
        out = kernel_result(_FAILED, (tuple(weight.shape[1:]), gated_by is not None, x.dtype, x.device), x,
                            f"the routed experts' Triton GEMV failed for a {tuple(weight.shape)} weight; the "
                            "experts gather each route's weight",
                            lambda: routed_experts_kernel()(unit_stride(x), unit_stride(weight), routes,
                                                            gated_by.contiguous() if gated_by is not None else None))
        if out is not None:
            return out
    rows = x
    if gated_by is not None:
        gate, up = x.chunk(2, dim=-1)
        rows = F.silu(gate) * up * gated_by.to(x.dtype)[:, None]
    elif x.shape[0]:
        rows = x.repeat_interleave(routes.shape[0] // x.shape[0], dim=0)
    experts = weight.shape[0]
    served = (routes >= 0) & (routes < experts)
    out = torch.bmm(weight[routes.clamp(0, max(experts - 1, 0))], rows.unsqueeze(-1)).squeeze(-1)
    return torch.where(served[:, None], out, 0)


def route_rows(experts: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """[T, k, H]: each (token, slot) route's weighted expert output, for `experts` with 3-D `gate_up_proj` [E, 2I, H]
    (gate rows first) and `down_proj` [E, H, I] and its `act_fn`; None where the kernel does not apply (more than
    ROUTED_MAX_ROUTES routes, or `kernel_applies` says no): the caller then runs the experts' own forward."""
    routes = top_k_index.reshape(-1)
    if routes.shape[0] > ROUTED_MAX_ROUTES or not kernel_applies(x, experts.gate_up_proj, routes):
        return None
    gate_up = routed_linear(x, experts.gate_up_proj, routes)
    weights = top_k_weights.reshape(-1)  # (a float32 router's: rounded to the dtype where they are read)
    if is_silu(experts.act_fn):
        out = routed_linear(gate_up, experts.down_proj, routes, gated_by=weights)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        out = routed_linear(experts.act_fn(gate) * up * weights.to(gate_up.dtype)[:, None], experts.down_proj, routes)
    return out.view(-1, top_k_index.shape[1], out.shape[-1])


__all__ = ["ROUTED_DEVICE_TYPES", "ROUTED_MAX_ROUTES", "is_silu", "route_rows", "routed_linear"]

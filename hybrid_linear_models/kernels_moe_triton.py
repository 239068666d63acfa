"""Triton kernels for the elementwise ends of a MoE block at inference: the top-k router's choice (softmax or
sigmoid scores), and the sigmoid-gated shared expert added to the routed experts' output. Each is one launch where
torch takes several (softmax or sigmoid, the bias, the top-k's two kernels, the gather, its sum and division, the
scale, the cast; sigmoid, product, sum): a decoding step runs one MoE block a layer, so these launches, not their
bytes, are their cost.

- `triton_route_top_k`: a program per row of logits [T, E] (E up to a few thousand: the row in registers). Scores
  in float32: softmax (the max subtracted first, as torch's softmax; Qwen3-Next) or sigmoid (Kimi-Linear); the choice
  is the score plus a correction bias where given (Kimi-Linear's `e_score_correction_bias`: it steers the choice,
  not the weight). The k largest choices in descending order, ties by the lowest expert index (as torch's CUDA top-k
  picks among values equal to its k-th), a NaN above every number (as torch ranks it: a row of NaN logits routes to
  experts 0..k-1 with NaN weights, never past E - 1); each weight is its expert's score, with `normalize` divided by
  their float32 sum plus `eps`, then times `scale`. The weights are stored in the logits' dtype, the experts as int64.
- `triton_add_gated`: routed + sigmoid(gate) * shared over rows [T, H], gate [T, 1] (or routed + shared, without a
  gate: Kimi-Linear's shared experts), each op rounded to the dtype as torch's bf16/fp16 elementwise ops round
  (computed in float32, rounded once per op): the eager block's value. The routed output may come as each token's k
  routes [T, k, H], summed here in float32 and rounded once, as torch's sum of them (the routed experts' rows:
  `route_rows` of the FP8 and the bf16 experts).

exp is triton's (a fast approximation on NVIDIA GPUs: a few float32 ulps from torch's, so a weight may differ from
torch's in its last float32 bits, rarely in its last bf16 bit; the experts chosen are the same but where choices tie
or lie within those ulps).
Imported only for CUDA tensors (`moe_inference_ops`), since importing triton needs a GPU driver.
"""

from __future__ import annotations

import torch

try:  # (in a try: transformers' remote-code check then does not require triton of a CPU machine loading a folder)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the MoE Triton kernels need triton (a CUDA machine); routing runs through torch") from error

from .kernels_launch_triton import await_previous_kernel, dependent_launch


@triton.jit
def swiglu_input(gate, up, weight, dtype: tl.constexpr):
    """silu(gate) * up * weight (float32 in and out), each op rounded to `dtype` as the experts' torch ops round them
    (silu, the product, the product with the route's weight): the routed experts' down projection computes its input
    so as it reads gate and up (kernels_fp8_triton, kernels_routed_experts_triton)."""
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return ((activated * up).to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["E"])
def _route_top_k_kernel(logits_ptr, bias_ptr, weights_ptr, experts_ptr, E, stride_l, stride_w, stride_e, eps, scale,
                        K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    if HAS_BIAS:  # (a weight of the model: read before the wait)
        bias = tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)
    await_previous_kernel(PDL)
    logits = tl.load(logits_ptr + row * stride_l + cols, mask=live, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        exps = tl.where(live, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
        scores = exps / tl.sum(exps, axis=0)
    choice = scores + bias if HAS_BIAS else scores
    # a NaN ranks above every number (as torch's top-k ranks it); each pick takes the largest choice left among the
    # experts, its ties by the lowest index, and its weight is that expert's score (a NaN kept)
    choice = tl.where(choice != choice, float("inf"), choice)  # noqa: PLR0124 (NaN)
    left = live
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    experts = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for slot in tl.static_range(K):
        best = tl.max(tl.where(left, choice, float("-inf")), axis=0)
        expert = tl.min(tl.where(left & (choice == best), cols, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(cols == expert, scores, 0.0), axis=0)
        weights = tl.where(slots == slot, weight, weights)
        experts = tl.where(slots == slot, expert, experts)
        left = left & (cols != expert)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + eps)  # (slots past K hold 0)
    weights = weights * scale
    kept = slots < K
    tl.store(weights_ptr + row * stride_w + slots, weights.to(weights_ptr.dtype.element_ty), mask=kept)
    tl.store(experts_ptr + row * stride_e + slots, experts.to(tl.int64), mask=kept)


def routing_warps(block_e: int) -> int:
    """Warps of the routing kernel for a row of block_e experts: at most 32 of the row's values a thread (more spill
    registers on an H200: tests/test_moe_inference_ops.py compiles the widest)."""
    return max(4, min(16, block_e // 256))


def triton_route_top_k(logits: torch.Tensor, k: int, sigmoid: bool, normalize: bool, bias: torch.Tensor | None = None,
                       eps: float = 0.0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E), bias [E] (contiguous) or None: (weights [T, k] in the logits' dtype,
    experts [T, k] int64); see the module docstring."""
    rows, experts = logits.shape
    weights = torch.empty(rows, k, device=logits.device, dtype=logits.dtype)
    chosen = torch.empty(rows, k, device=logits.device, dtype=torch.int64)
    if rows:
        block_e = triton.next_power_of_2(experts)
        _route_top_k_kernel[(rows,)](logits, bias if bias is not None else logits, weights, chosen, experts,
                                     logits.stride(0), weights.stride(0), chosen.stride(0), eps, scale, K=k,
                                     BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k), SIGMOID=sigmoid,
                                     HAS_BIAS=bias is not None, NORMALIZE=normalize, num_warps=routing_warps(block_e),
                                     **dependent_launch(logits.device))
    return weights, chosen


@triton.jit(do_not_specialize=["H"])
def _add_gated_kernel(routed_ptr, gate_ptr, shared_ptr, out_ptr, H, stride_r, stride_rk, stride_g, stride_s, stride_o,
                      ROUTES: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
                      GATED: tl.constexpr = True):
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = cols < H
    await_previous_kernel(PDL)
    dtype = out_ptr.dtype.element_ty
    shared = tl.load(shared_ptr + row * stride_s + cols, mask=live, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.load(gate_ptr + row * stride_g).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # torch.sigmoid's value, rounded
        shared = (gate * shared).to(dtype).to(tl.float32)
    if ROUTES > 0:  # the token's routes summed in float32 in route order, rounded once (as torch's sum of them)
        routed = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for route in tl.static_range(ROUTES):
            routed += tl.load(routed_ptr + row * stride_r + route * stride_rk + cols, mask=live, other=0.0).to(
                tl.float32)
        routed = routed.to(dtype).to(tl.float32)
    else:
        routed = tl.load(routed_ptr + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (routed + shared).to(dtype), mask=live)


def triton_add_gated(routed: torch.Tensor, gate: torch.Tensor | None, shared: torch.Tensor) -> torch.Tensor:
    """routed [T, H] (or [T, k, H]: each token's k routes, summed first) + sigmoid(gate [T, 1]) * shared [T, H] (each
    with unit stride along its last dim; without a gate, routed + shared), [T, H] in routed's dtype; see the module
    docstring."""
    rows, width = routed.shape[0], routed.shape[-1]
    routes = routed.shape[1] if routed.dim() == 3 else 0
    out = torch.empty(rows, width, device=routed.device, dtype=routed.dtype)
    block = min(1024, triton.next_power_of_2(max(width, 1)))
    if rows:
        gated = gate is not None
        _add_gated_kernel[(triton.cdiv(width, block), rows)](routed, gate if gated else shared, shared, out, width,
                                                            routed.stride(0), routed.stride(1) if routes else 0,
                                                            gate.stride(0) if gated else 0, shared.stride(0),
                                                            out.stride(0), ROUTES=routes, BLOCK_H=block, num_warps=4,
                                                            GATED=gated, **dependent_launch(routed.device))
    return out


__all__ = ["routing_warps", "swiglu_input", "triton_add_gated", "triton_route_top_k"]

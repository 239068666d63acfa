"""Triton kernels for the elementwise ends of a sparse MoE block at inference: the softmax top-k router's choice, and
the sigmoid-gated shared expert added to the routed experts' output. Each is one launch where torch takes several
(softmax, the top-k's two kernels, its sum and division, the cast; sigmoid, product, sum): a decoding step of a
512-expert model runs one MoE block a layer, so these launches, not their bytes, are their cost.

- `triton_softmax_top_k`: a program per row of logits [T, E] (E up to a few thousand: the row in registers). p =
  softmax(logits) in float32 (the max subtracted first, as torch's softmax); the k largest p in descending order,
  ties by the lowest expert index (as torch's CUDA top-k picks among values equal to its k-th), a NaN above every
  number (as torch ranks it: a row of NaN logits routes to experts 0..k-1 with NaN weights, never past E - 1); with
  `normalize`, divided by their float32 sum. The weights are stored in the logits' dtype, the experts as int64.
- `triton_add_gated`: routed + sigmoid(gate) * shared over rows [T, H], gate [T, 1], each op rounded to the dtype as
  torch's bf16/fp16 elementwise ops round (computed in float32, rounded once per op): the eager block's value.

exp is triton's (a fast approximation on NVIDIA GPUs: a few float32 ulps from torch's, so a weight may differ from
torch's in its last float32 bits, rarely in its last bf16 bit; the experts chosen are the same but where logits tie).
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


@triton.jit(do_not_specialize=["E"])
def _softmax_top_k_kernel(logits_ptr, weights_ptr, experts_ptr, E, stride_l, stride_w, stride_e,
                          K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
                          PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    await_previous_kernel(PDL)
    logits = tl.load(logits_ptr + row * stride_l + cols, mask=live, other=float("-inf")).to(tl.float32)
    exps = tl.where(live, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    probabilities = exps / tl.sum(exps, axis=0)
    # the choice: probabilities are in [0, 1], so -1 (past E) is never chosen and 2 (a NaN: torch's top-k ranks NaN
    # above every number) always is; each pick takes the largest left, its ties by the lowest index
    left = tl.where(live, tl.where(probabilities != probabilities, 2.0, probabilities), -1.0)  # noqa: PLR0124 (NaN)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    experts = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for slot in tl.static_range(K):
        best = tl.max(left, axis=0)
        expert = tl.min(tl.where(left == best, cols, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(cols == expert, probabilities, 0.0), axis=0)  # (its probability, a NaN kept)
        weights = tl.where(slots == slot, weight, weights)
        experts = tl.where(slots == slot, expert, experts)
        left = tl.where(cols == expert, -2.0, left)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # (slots past K hold 0)
    kept = slots < K
    tl.store(weights_ptr + row * stride_w + slots, weights.to(weights_ptr.dtype.element_ty), mask=kept)
    tl.store(experts_ptr + row * stride_e + slots, experts.to(tl.int64), mask=kept)


def routing_warps(block_e: int) -> int:
    """Warps of the routing kernel for a row of block_e experts: at most 32 of the row's values a thread (more spill
    registers on an H200: tests/test_moe_inference_ops.py compiles the widest)."""
    return max(4, min(16, block_e // 256))


def triton_softmax_top_k(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E): (weights [T, k] in the logits' dtype, experts [T, k] int64); see the
    module docstring."""
    rows, experts = logits.shape
    weights = torch.empty(rows, k, device=logits.device, dtype=logits.dtype)
    chosen = torch.empty(rows, k, device=logits.device, dtype=torch.int64)
    if rows:
        block_e = triton.next_power_of_2(experts)
        _softmax_top_k_kernel[(rows,)](logits, weights, chosen, experts, logits.stride(0), weights.stride(0),
                                       chosen.stride(0), K=k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
                                       NORMALIZE=normalize, num_warps=routing_warps(block_e),
                                       **dependent_launch(logits.device))
    return weights, chosen


@triton.jit(do_not_specialize=["H"])
def _add_gated_kernel(routed_ptr, gate_ptr, shared_ptr, out_ptr, H, stride_r, stride_g, stride_s, stride_o,
                      BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = cols < H
    await_previous_kernel(PDL)
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * stride_g).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # torch.sigmoid's value, rounded
    shared = tl.load(shared_ptr + row * stride_s + cols, mask=live, other=0.0).to(tl.float32)
    routed = tl.load(routed_ptr + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
    gated = (gate * shared).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (routed + gated).to(dtype), mask=live)


def triton_add_gated(routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(gate [T, 1]) * shared [T, H] (each with unit stride along its last dim), in routed's
    dtype; see the module docstring."""
    rows, width = routed.shape
    out = torch.empty_like(routed, memory_format=torch.contiguous_format)
    block = min(1024, triton.next_power_of_2(max(width, 1)))
    if rows:
        _add_gated_kernel[(triton.cdiv(width, block), rows)](routed, gate, shared, out, width, routed.stride(0),
                                                            gate.stride(0), shared.stride(0), out.stride(0),
                                                            BLOCK_H=block, num_warps=4,
                                                            **dependent_launch(routed.device))
    return out


__all__ = ["triton_add_gated", "triton_softmax_top_k"]

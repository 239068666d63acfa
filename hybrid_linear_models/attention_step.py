"""A full-attention layer of a captured decoding step (one token a row) or of a speculative verify round (2 to
`MAX_STEP_TOKENS` tokens a row), from the fused q/k/v projection to o_proj's input, in three Triton kernels
(`kernels_attention_step_triton`) instead of the torch path's fifteen to thirty.

The torch path (`HybridLinearAttention._project` and `forward`, the reference of the kernels' tests) runs, per layer:
the q and k RMSNorms (fla's kernel, plus a copy for a strided input), the rotary embedding of both (`rotate_together`:
cat, two products, a gather, a sum), the cache writes (two index_copy_ or scatters, and their slot arithmetic), the
attention (`attention_one_query`: two GEMMs, the mask add, softmax, a cast) and the output gate (sigmoid, product):
at batch 1 each a kernel of a few microseconds whose time is mostly its launch and ramp. The kernels do the same math
with the same roundings (each bf16/fp16 op's result rounded where the torch path rounds it), except where the sums are
ordered differently: the attention's, flash-decoding style (split over the cache slots, probabilities rounded
unnormalised for the P V product, as fused attention kernels do, where `one_query_attention` rounds them normalised).

The cache says where the tokens go, by `kernel_kv_layer(layer_idx)`: a `KernelKVLayer` (the layer's key and value
buffers [B, H_kv, slots, D] and the device counter of each row's first slot: token t of row b goes to first[b] + t),
or None where its update is not that. A captured step's `StepCache` lends its full-attention layers (one counter for
all rows; not a sliding one, whose buffer rolls); `VerifyCache` lends every attention layer (a counter per row: its
sliding windows are in the mask, every slot kept).

Taken when all hold (checked as the step is recorded, so a replay runs the kernels with no Python): such a cache, no
gradient, CUDA bf16/fp16 activations and cache, sdpa chosen (eager keeps its own math), the fused q/k/v projection,
the whole-head rotary tables, an additive mask [B or 1, 1, T or 1, slots], head widths a power of two from 16 to 256,
no tensor-parallel shards, triton importable and a GPU of compute capability 8.0 or later. A kernel that fails to
compile is not tried again for that layout (one warning); the step is then recorded with the torch path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .tensor_parallel_heads import device_mesh
from .triton_loading import has_bf16_tensor_cores, kernel_result, triton_kernel

STEP_DEVICE_TYPES = ("cuda",)  # tests add "cpu", running the kernels under triton's interpreter
STEP_DTYPES = (torch.bfloat16, torch.float16)
MAX_STEP_TOKENS = 16  # tokens a row up to which the kernels take a forward (a verify round's k)
_FAILED: dict = {}  # layouts whose kernels failed -> the error (the torch path from then on)


class KernelKVLayer(NamedTuple):
    """An attention layer's cache as the kernels write it: keys / values [B, H_kv, slots, D]; first, the slot of each
    row's first token of the forward (one value: the same for every row; or [B]), on the device."""

    keys: torch.Tensor
    values: torch.Tensor
    first: torch.Tensor


@triton_kernel
def attention_step_kernel():
    """`kernels_attention_step_triton.attention_step`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_attention_step_triton import attention_step

    return attention_step


def _layout_problem(attention, hidden_states, tables, mask, layer: KernelKVLayer) -> bool:
    """True when the forward's tensors are not what the kernels take (see the module docstring). `tables` qualifies
    when it is `mixer_attention.RotaryTables` (told by its `rotated_dims`, which the kernels read: this module is
    imported by mixer_attention, and importing it back would make the two depend on each other)."""
    D = attention.head_dim
    gate = 2 if attention.output_gate else 1
    keys, values, first = layer
    (B, T), L = hidden_states.shape[:2], keys.shape[2]
    return (hidden_states.device.type not in STEP_DEVICE_TYPES or hidden_states.dtype not in STEP_DTYPES
            or not 1 <= T <= MAX_STEP_TOKENS or keys.dtype != hidden_states.dtype or values.dtype != keys.dtype
            or D & (D - 1) or not 16 <= D <= 256 or keys.shape[-1] != D or values.shape[-1] != D
            or keys.shape[:3] != (B, attention.num_key_value_heads, L) or values.shape[:3] != keys.shape[:3]
            or keys.stride(-1) != 1 or values.stride(-1) != 1 or first.shape not in ((), (1,), (B,))
            or attention.q_proj.out_features != attention.num_heads * D * gate
            or not callable(getattr(tables, "rotated_dims", None)) or tables.rotated_dims(D) % 2
            or not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1
            or mask.shape[0] not in (1, B) or mask.shape[2] not in (1, T) or mask.shape[-1] != L
            or not mask.dtype.is_floating_point or mask.stride(-1) != 1)


def fused_attention_step(attention, hidden_states: torch.Tensor, tables, mask, cache) -> torch.Tensor | None:
    """o_proj's input [B, T, heads * D] for a forward of T <= MAX_STEP_TOKENS tokens a row of the full-attention mixer
    `attention` (HybridLinearAttention), their keys and values written to the cache; None where the kernels do not
    apply (see the module docstring): the caller then runs the torch path."""
    kernel_kv_layer = getattr(cache, "kernel_kv_layer", None)
    layer = kernel_kv_layer(attention.layer_idx) if kernel_kv_layer is not None else None
    if layer is None or attention.training or torch.is_grad_enabled():
        return None
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    if (attention.config._attn_implementation != "sdpa"
            or _layout_problem(attention, hidden_states, tables, mask, layer)
            or not attention._qkv.applies(hidden_states, projections)
            or any(device_mesh(p.weight) is not None for p in projections)
            or attention_step_kernel() is None or not has_bf16_tensor_cores(hidden_states.device)):
        return None
    key = (attention.num_heads, attention.num_key_value_heads, attention.head_dim, attention.output_gate,
           attention.q_norm is not None, hidden_states.shape[1], hidden_states.dtype, hidden_states.device)
    if key in _FAILED:  # (before the projection below: the torch path projects for itself)
        return None
    D = attention.head_dim
    qkv = attention._qkv(hidden_states, projections)
    cos, sin, _ = tables.whole_head(D)  # [B or 1, T or 1, 1, D]
    norms = (attention.q_norm, attention.k_norm)
    scales = [norm.scale(qkv) if norm is not None else None for norm in norms]
    return kernel_result(
        _FAILED, key, hidden_states, "the fused attention step failed; the attention layers of captured steps and "
        "verify rounds run the torch path", lambda: attention_step_kernel()(
            qkv, layer.keys, layer.values, layer.first, *scales,
            tuple(norm.eps if norm is not None else 0.0 for norm in norms), cos[:, :, 0], sin[:, :, 0],
            tables.rotated_dims(D), mask[:, 0], attention.scaling, attention.num_heads, attention.output_gate))

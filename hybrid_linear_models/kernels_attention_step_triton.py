"""Triton kernels of a captured decoding step's full-attention layer: three kernels from the fused q/k/v projection's
output to the input of o_proj (`attention_step.py` says when they run; its torch path is the reference).

1. `_prepare_kernel`, one program per (row, head) of the queries, keys and values: the per-head RMSNorm of q and k
   (x * rstd * w in float32, rounded once, as fla's RMSNorm), the rotary embedding on the whole-head tables of
   `RotaryTables.whole_head` (y * cos' + y[swap] * sin', each product and the sum rounded to the activations' dtype,
   as the torch path's bf16/fp16 ops round them), the query stored for kernel 2, the key and value written at the
   step's slot of the static cache (its device counter: no host value is read).
2. `_attend_kernel`, flash-decoding: one program per (row, KV head, split of the cache slots); the query heads that
   share a KV head are the rows of one `tl.dot` tile (padded to 16), scores in float32 plus the additive mask, an
   online softmax over its slots, probabilities rounded to the value dtype for the P V product (as fused attention
   kernels do), the partial sums kept in float32. Slots past the step's own are never written yet (masked anyway):
   their blocks are skipped. A tile's values are loaded with its keys (one memory round trip a tile). The cache's
   slot count, the mask's row stride, the tiles per split and the split count are runtime arguments (`tiles` tiles of
   `BLOCK_SLOTS` a split, `splits` splits covering the slots, at most `MAX_SPLITS`), none specialised: one compiled
   kernel per head layout serves a static cache of any length (generation makes one of prompt plus new tokens per
   call).
3. `_combine_kernel`, one program per (row, query head): the splits' partial sums merged by their maxima, divided by
   the softmax's sum, rounded, then the output gate sigmoid(gate) (rounded, and the product rounded, as torch's ops).
   The splits are loaded together, `CHUNK` of them at once (fixed per head width D: min(MAX_SPLITS,
   COMBINED_ELEMENTS // D), a power of two, those past `splits` masked; the online rescale kept between such chunks),
   not one after another, which would make the merge a chain of dependent L2 reads, one per split.

All three are launched with programmatic dependent launch where it is on (`kernels_launch_triton`): each waits for
the kernel ahead first (everything they read, the cache's counter included, a kernel of the step writes), and lets
the next start early (o_proj's GEMV then loads its weight while the merge runs).

Imported only for CUDA tensors (triton needs a GPU driver), or in tests under triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the fused attention step needs triton (a CUDA machine)") from error

from .kernels_launch_triton import await_previous_kernel, dependent_launch

BLOCK_SLOTS = 64  # cache slots per tl.dot tile
MAX_SPLITS = 64  # programs per (row, KV head) at most: a split then covers several tiles
COMBINED_ELEMENTS = 8192  # partial sums (splits x head dim) `_combine_kernel` loads at once (64 registers a thread)


@triton.jit
def _normed(ptr, offsets, scale_ptr, rstd, NORM: tl.constexpr):
    """x[offsets] * rstd * w[offsets] in float32 (x alone without NORM), rounded to x's dtype."""
    x = tl.load(ptr + offsets)
    if NORM:
        x = (x.to(tl.float32) * rstd * tl.load(scale_ptr + offsets).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _prepare_kernel(qkv_ptr, stride_qkv, query_ptr, keys_ptr, values_ptr, slot_ptr, q_scale_ptr, k_scale_ptr,
                    cos_ptr, sin_ptr, stride_table, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                    q_eps, k_eps, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROTARY: tl.constexpr,
                    GATE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)  # (everything it reads, the cache's counter too, a kernel of the step writes)
    b = tl.program_id(0)
    head = tl.program_id(1)  # H query heads, then HKV key heads, then HKV value heads
    d = tl.arange(0, D)
    half: tl.constexpr = ROTARY // 2
    swap = tl.where(d < half, d + half, tl.where(d < ROTARY, d - half, d))  # the rotated halves exchanged
    row = qkv_ptr + b * stride_qkv
    q_width: tl.constexpr = H * D * (2 if GATE else 1)
    slot = tl.load(slot_ptr)
    if head < H + HKV:
        if head < H:
            x_ptr = row + head * D * (2 if GATE else 1)  # per query head: [query | gate]
            scale_ptr = q_scale_ptr
        else:
            x_ptr = row + q_width + (head - H) * D
            scale_ptr = k_scale_ptr
        rstd = 1.0
        if NORM:
            x = tl.load(x_ptr + d).to(tl.float32)
            eps = tl.where(head < H, q_eps, k_eps)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = _normed(x_ptr, d, scale_ptr, rstd, NORM)
        y_swapped = _normed(x_ptr, swap, scale_ptr, rstd, NORM)
        cos = tl.load(cos_ptr + b * stride_table + d)
        sin = tl.load(sin_ptr + b * stride_table + d)
        # each product rounded, then their sum (as the torch path's three bf16/fp16 ops round)
        straight = (y.to(tl.float32) * cos.to(tl.float32)).to(y.dtype)
        crossed = (y_swapped.to(tl.float32) * sin.to(tl.float32)).to(y.dtype)
        rotated = (straight.to(tl.float32) + crossed.to(tl.float32)).to(y.dtype)
        if head < H:
            tl.store(query_ptr + (b * H + head) * D + d, rotated)
        else:
            kv = head - H
            tl.store(keys_ptr + b * stride_kb + kv * stride_kh + slot * stride_kl + d,
                     rotated.to(keys_ptr.dtype.element_ty))
    else:
        kv = head - H - HKV
        value = tl.load(row + q_width + HKV * D + kv * D + d)
        tl.store(values_ptr + b * stride_vb + kv * stride_vh + slot * stride_vl + d,
                 value.to(values_ptr.dtype.element_ty))


# the cache length's arguments are not specialised (by value 1 or divisibility by 16), so that no length compiles a
# kernel of its own; the cache's strides scale with it too but stay multiples of D >= 16
@triton.jit(do_not_specialize=["stride_mask", "slots", "tiles", "splits"])
def _attend_kernel(query_ptr, keys_ptr, values_ptr, mask_ptr, stride_mask, slot_ptr, acc_ptr, max_ptr, sum_ptr,
                   stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, scale, slots, tiles, splits,
                   H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    bj = tl.program_id(0)
    split = tl.program_id(1)
    b = bj // HKV
    j = bj % HKV
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    query = tl.load(query_ptr + (b * H + j * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    last = tl.load(slot_ptr)  # the step's own slot: later slots are not written yet
    running_max = tl.full([G_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    tile = 0
    while tile < tiles:  # (while, not range: triton's interpreter takes no runtime range bound under numpy >= 2.4)
        start = (split * tiles + tile) * BLOCK
        if start <= last:
            s_idx = start + tl.arange(0, BLOCK)
            seen = (s_idx < slots) & (s_idx <= last)
            keys = tl.load(keys_ptr + b * stride_kb + j * stride_kh + s_idx[:, None] * stride_kl + d[None, :],
                           mask=seen[:, None], other=0.0)
            # the values with the keys: one memory round trip for the tile, not a second one after the softmax
            values = tl.load(values_ptr + b * stride_vb + j * stride_vh + s_idx[:, None] * stride_vl + d[None, :],
                             mask=seen[:, None], other=0.0)
            scores = tl.dot(query, tl.trans(keys))  # [G_PAD, BLOCK], float32
            added = tl.load(mask_ptr + b * stride_mask + s_idx, mask=seen, other=float("-inf")).to(tl.float32)
            scores = scores * scale + added[None, :]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)
            kept = tl.exp(running_max - base)
            probs = tl.exp(scores - base[:, None])
            running_sum = running_sum * kept + tl.sum(probs, axis=1)
            acc = acc * kept[:, None] + tl.dot(probs.to(values.dtype), values)
            running_max = new_max
        tile += 1
    part = (bj * splits + split) * G_PAD + g
    tl.store(max_ptr + part, running_max)
    tl.store(sum_ptr + part, running_sum)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)


@triton.jit(do_not_specialize=["splits"])
def _combine_kernel(acc_ptr, max_ptr, sum_ptr, qkv_ptr, stride_qkv, out_ptr, splits, H: tl.constexpr,
                    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                    GATE: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    j = h // G
    d = tl.arange(0, D)
    first = (b * HKV + j) * splits * G_PAD + h % G  # split 0 of this head's row
    overall = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    start = 0
    while start < splits:  # CHUNK splits loaded at once: one memory round trip for them
        split = start + tl.arange(0, CHUNK)
        inside = split < splits
        parts = first + split * G_PAD
        maxima = tl.load(max_ptr + parts, mask=inside, other=float("-inf"))
        sums = tl.load(sum_ptr + parts, mask=inside, other=0.0)
        partial = tl.load(acc_ptr + parts[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
        new_max = tl.maximum(overall, tl.max(maxima, axis=0))
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
        kept, taken = tl.exp(overall - base), tl.exp(maxima - base)  # (an empty split: exp(-inf) = 0)
        total = total * kept + tl.sum(sums * taken, axis=0)
        acc = acc * kept + tl.sum(partial * taken[:, None], axis=0)
        overall = new_max
        start += CHUNK
    out = (acc / total).to(out_ptr.dtype.element_ty)
    if GATE:
        gate = tl.load(qkv_ptr + b * stride_qkv + h * 2 * D + D + d).to(tl.float32)
        opened = tl.sigmoid(gate).to(out.dtype)
        out = (out.to(tl.float32) * opened.to(tl.float32)).to(out.dtype)
    tl.store(out_ptr + bh * D + d, out)


def combined_splits(head_dim: int) -> int:
    """The splits `_combine_kernel` loads at once for heads of width `head_dim` (a power of two): as many as
    `COMBINED_ELEMENTS` partial sums hold, at most `MAX_SPLITS`; a power of two, whatever the cache's length."""
    return max(min(MAX_SPLITS, COMBINED_ELEMENTS // head_dim), 1)


def attention_step(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor,
                   q_scale: torch.Tensor | None, k_scale: torch.Tensor | None, eps: tuple[float, float],
                   cos: torch.Tensor, sin: torch.Tensor, rotary: int, mask: torch.Tensor, scale: float, heads: int,
                   gate: bool) -> torch.Tensor:
    """qkv [B, W] (per query head [query | gate] when `gate`, then the keys, then the values), keys / values the
    static cache layer's [B, H_kv, L, D], slot its counter (0-dim), q_scale / k_scale the RMSNorms' multipliers
    (None: no norm) and eps their epsilons, cos / sin [B, D] whole-head tables (any row stride), mask [B or 1, L]
    additive. Writes the step's key and value at `slot`; returns the gated attention output [B, heads * D] (see the
    module docstring)."""
    B = qkv.shape[0]
    HKV, slots, D = keys.shape[1], keys.shape[2], keys.shape[3]
    G = heads // HKV
    G_PAD = max(16, triton.next_power_of_2(G))
    tiles = triton.cdiv(triton.cdiv(slots, BLOCK_SLOTS), MAX_SPLITS)  # tiles a split: the splits <= MAX_SPLITS
    splits = triton.cdiv(slots, BLOCK_SLOTS * tiles)
    query = qkv.new_empty(B, heads, D)
    norm = q_scale is not None
    launch = dependent_launch(qkv.device)
    _prepare_kernel[(B, heads + 2 * HKV)](
        qkv, qkv.stride(0), query, keys, values, slot, q_scale if norm else qkv, k_scale if norm else qkv, cos, sin,
        cos.stride(0), *keys.stride()[:3], *values.stride()[:3], *eps, H=heads, HKV=HKV, D=D, ROTARY=rotary,
        GATE=gate, NORM=norm, **launch)
    partial = B * HKV * splits * G_PAD
    acc = qkv.new_empty(partial, D, dtype=torch.float32)
    maxima = qkv.new_empty(partial, dtype=torch.float32)
    sums = qkv.new_empty(partial, dtype=torch.float32)
    mask_stride = mask.stride(0) if mask.shape[0] > 1 else 0
    _attend_kernel[(B * HKV, splits)](
        query, keys, values, mask, mask_stride, slot, acc, maxima, sums, *keys.stride()[:3], *values.stride()[:3],
        scale, slots, tiles, splits, H=heads, HKV=HKV, G=G, G_PAD=G_PAD, D=D, BLOCK=BLOCK_SLOTS, **launch)
    out = qkv.new_empty(B, heads * D)
    _combine_kernel[(B * heads,)](acc, maxima, sums, qkv, qkv.stride(0), out, splits, H=heads, HKV=HKV, G=G,
                                  G_PAD=G_PAD, D=D, CHUNK=combined_splits(D), GATE=gate, **launch)
    return out

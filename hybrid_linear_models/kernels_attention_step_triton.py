"""Triton kernels of a full-attention layer for a few query tokens per row against a static cache (a captured decoding
step's one token, or a speculative verify round's T <= 16): three kernels from the fused q/k/v projection's output to
the input of o_proj (`attention_step.py` says when they run; its torch path is the reference).

Token t of row b is written at slot first[b] + t of the cache, `first` the cache's device counter (one for all rows:
a decoding step's static cache; per row: a verify round's `VerifyCache.lengths`); what each token sees is the
additive mask's row for it ([B or 1, T or 1, slots]), the causal order between the round's tokens included.

1. `_prepare_kernel`, one program per (row, token, head) of the queries, keys and values: the per-head RMSNorm of q
   and k (x * rstd * w in float32, rounded once, as fla's RMSNorm), the rotary embedding on the whole-head tables of
   `RotaryTables.whole_head` (y * cos' + y[swap] * sin', each product and the sum rounded to the activations' dtype,
   as the torch path's bf16/fp16 ops round them), the query stored for kernel 2, the key and value written at the
   token's slot of the static cache (from its device counter: no host value is read).
2. `_attend_kernel`, flash-decoding: one program per (row, KV head, split of the cache slots, block of query rows);
   the query heads that share a KV head, times the tokens, are the rows of one `tl.dot` tile (row i = token i // G,
   head i % G of the group; padded to 16, at most `MAX_ROW_BLOCK` a program), scores in float32 plus each token's
   mask row, an online softmax over its slots, probabilities rounded to the value dtype for the P V product (as fused
   attention kernels do), the partial sums kept in float32 (those of the real query rows stored). Slots past the last
   token's own are not written yet, or hold a rejected round's keys (masked anyway): their blocks are skipped. A
   tile's values are loaded with its keys (one memory round trip a tile). The cache's slot count, the mask's strides,
   the tiles per split and the split count are runtime arguments (`tiles` tiles of `BLOCK_SLOTS` a split, `splits`
   splits covering the slots, at most `split_limit`), none specialised: one compiled kernel per head layout and token
   count serves a static cache of any length (generation makes one of prompt plus new tokens per call).
   The split limit: `MAX_SPLITS`, or, where the rows, KV heads and row blocks are too few for it to give every
   multiprocessor `PROGRAMS_PER_SM` programs, that many. A program streams its tiles one after another, so one
   program per multiprocessor leaves the memory idle between a tile's loads and its products; two keep it busy.
   At batch 1 with 2 KV heads (the benchmark models) a long cache then gets up to 132 splits on an H200 (132
   multiprocessors), not 64. One token, 16 query heads of 256, bf16, a replayed step's three kernels: at 131,072 /
   262,144 / 1,048,576 slots 110 / 188 / 637 us (2.4 / 2.9 / 3.4 TB/s of keys and values read) against 160 / 300 /
   1,151 us with 64 splits (1.7-1.9 TB/s); a verify round's 4 tokens at 131,072 slots 146 against 247 us; batch 16
   (rows that fill the GPU: 64 splits either way) 192 us at 16,384 slots. In a sweep of 64 to 512 splits, 32 or 64
   slots a tile and 4 or 8 warps, about 128 splits of 64 slots with 4 warps were fastest at every length from 131,072
   (`benchmarks/bench_attention_step.py` times the split limit against 64 splits).
3. `_combine_kernel`, one program per (row, token, query head): the splits' partial sums merged by their maxima,
   divided by the softmax's sum, rounded, then the output gate sigmoid(gate) (rounded, and the product rounded, as
   torch's ops). The splits are loaded together, `CHUNK` of them at once (fixed per head width D: min(MAX_SPLITS,
   COMBINED_ELEMENTS // D), a power of two, those past `splits` masked; the online rescale kept between such
   chunks), not one after another, which would make the merge a chain of dependent L2 reads, one per split.

All three are launched with programmatic dependent launch where it is on (`kernels_launch_triton`): each waits for
the kernel ahead first (everything they read, the cache's counter included, a kernel of the step writes), and lets
the next start early (o_proj's GEMV then loads its weight while the merge runs).

Imported only for CUDA tensors (triton needs a GPU driver), or in tests under triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the fused attention step needs triton (a CUDA machine)") from error

from .kernels_launch_triton import await_previous_kernel, dependent_launch

BLOCK_SLOTS = 64  # cache slots per tl.dot tile
MAX_ROW_BLOCK = 64  # query rows (heads of a KV group x tokens) per `_attend_kernel` program at most
MAX_SPLITS = 64  # programs per (row, KV head, row block) at most where they fill the GPU: a split then covers several
# tiles
PROGRAMS_PER_SM = 2  # `_attend_kernel` programs a multiprocessor gets where the rows leave it idle (`split_limit`)
COMBINED_ELEMENTS = 8192  # partial sums (splits x head dim) `_combine_kernel` loads at once (64 registers a thread)


@triton.jit
def _normed(ptr, offsets, scale_ptr, rstd, NORM: tl.constexpr):
    """x[offsets] * rstd * w[offsets] in float32 (x alone without NORM), rounded to x's dtype."""
    x = tl.load(ptr + offsets)
    if NORM:
        x = (x.to(tl.float32) * rstd * tl.load(scale_ptr + offsets).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _prepare_kernel(qkv_ptr, stride_qkv, query_ptr, keys_ptr, values_ptr, slot_ptr, stride_slot, q_scale_ptr,
                    k_scale_ptr, cos_ptr, sin_ptr, stride_table_b, stride_table_t, stride_kb, stride_kh, stride_kl,
                    stride_vb, stride_vh, stride_vl, q_eps, k_eps, T: tl.constexpr, H: tl.constexpr,
                    HKV: tl.constexpr, D: tl.constexpr, ROTARY: tl.constexpr, GATE: tl.constexpr, NORM: tl.constexpr,
                    PDL: tl.constexpr = False):
    await_previous_kernel(PDL)  # (everything it reads, the cache's counter too, a kernel of the step writes)
    r = tl.program_id(0)  # row b's token t: r = b * T + t
    b = r // T
    t = r % T
    head = tl.program_id(1)  # H query heads, then HKV key heads, then HKV value heads
    d = tl.arange(0, D)
    half: tl.constexpr = ROTARY // 2
    swap = tl.where(d < half, d + half, tl.where(d < ROTARY, d - half, d))  # the rotated halves exchanged
    row = qkv_ptr + r * stride_qkv
    q_width: tl.constexpr = H * D * (2 if GATE else 1)
    slot = tl.load(slot_ptr + b * stride_slot) + t
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
        table = b * stride_table_b + t * stride_table_t + d
        cos = tl.load(cos_ptr + table)
        sin = tl.load(sin_ptr + table)
        # each product rounded, then their sum (as the torch path's three bf16/fp16 ops round)
        straight = (y.to(tl.float32) * cos.to(tl.float32)).to(y.dtype)
        crossed = (y_swapped.to(tl.float32) * sin.to(tl.float32)).to(y.dtype)
        rotated = (straight.to(tl.float32) + crossed.to(tl.float32)).to(y.dtype)
        if head < H:
            tl.store(query_ptr + (r * H + head) * D + d, rotated)
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
@triton.jit(do_not_specialize=["stride_mask_b", "stride_mask_t", "slots", "tiles", "splits"])
def _attend_kernel(query_ptr, keys_ptr, values_ptr, mask_ptr, stride_mask_b, stride_mask_t, slot_ptr, stride_slot,
                   acc_ptr, max_ptr, sum_ptr, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, scale,
                   slots, tiles, splits, T: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    bj = tl.program_id(0)
    split = tl.program_id(1)
    b = bj // HKV
    j = bj % HKV
    i = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # query rows: token i // G, head j * G + i % G
    t = i // G
    real = i < G * T
    d = tl.arange(0, D)
    query = tl.load(query_ptr + ((b * T + t) * H + j * G + i % G)[:, None] * D + d[None, :], mask=real[:, None],
                    other=0.0)
    last = tl.load(slot_ptr + b * stride_slot) + T - 1  # the last token's own slot: later ones are not written yet
    mask_rows = mask_ptr + b * stride_mask_b + t * stride_mask_t
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
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
            scores = tl.dot(query, tl.trans(keys))  # [ROWS, BLOCK], float32
            visible = real[:, None] & seen[None, :]
            added = tl.load(mask_rows[:, None] + s_idx[None, :], mask=visible, other=float("-inf")).to(tl.float32)
            scores = tl.where(visible, scores * scale + added, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)
            kept = tl.exp(running_max - base)
            probs = tl.exp(scores - base[:, None])
            running_sum = running_sum * kept + tl.sum(probs, axis=1)
            acc = acc * kept[:, None] + tl.dot(probs.to(values.dtype), values)
            running_max = new_max
        tile += 1
    part = (bj * splits + split) * (tl.num_programs(2) * ROWS) + i
    tl.store(max_ptr + part, running_max, mask=real)  # (the padding rows: nothing reads them)
    tl.store(sum_ptr + part, running_sum, mask=real)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=real[:, None])


@triton.jit(do_not_specialize=["splits", "rows"])
def _combine_kernel(acc_ptr, max_ptr, sum_ptr, qkv_ptr, stride_qkv, out_ptr, splits, rows, T: tl.constexpr,
                    H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                    GATE: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    rh = tl.program_id(0)  # (row b's token t, query head h)
    r = rh // H
    h = rh % H
    b = r // T
    j = h // G
    d = tl.arange(0, D)
    first = (b * HKV + j) * splits * rows + (r % T) * G + h % G  # split 0 of this query's row (`rows` a split)
    overall = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    start = 0
    while start < splits:  # CHUNK splits loaded at once: one memory round trip for them
        split = start + tl.arange(0, CHUNK)
        inside = split < splits
        parts = first + split * rows
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
        gate = tl.load(qkv_ptr + r * stride_qkv + h * 2 * D + D + d).to(tl.float32)
        opened = tl.sigmoid(gate).to(out.dtype)
        out = (out.to(tl.float32) * opened.to(tl.float32)).to(out.dtype)
    tl.store(out_ptr + rh * D + d, out)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_limit(device: torch.device, programs_per_split: int) -> int:
    """The splits of the cache slots `_attend_kernel` may use when each split runs `programs_per_split` programs
    (rows x KV heads x row blocks): MAX_SPLITS, or more where that leaves a CUDA device's multiprocessors fewer than
    PROGRAMS_PER_SM programs each (the module docstring)."""
    if device.type != "cuda":  # (triton's interpreter)
        return MAX_SPLITS
    return max(MAX_SPLITS, PROGRAMS_PER_SM * _multiprocessors(device) // programs_per_split)


def combined_splits(head_dim: int) -> int:
    """The splits `_combine_kernel` loads at once for heads of width `head_dim` (a power of two): as many as
    `COMBINED_ELEMENTS` partial sums hold, at most `MAX_SPLITS`; a power of two, whatever the cache's length."""
    return max(min(MAX_SPLITS, COMBINED_ELEMENTS // head_dim), 1)


def _broadcast_strides(tensor: torch.Tensor, dims: tuple[int, int]) -> tuple[int, int]:
    """The strides of `tensor`'s dims `dims`, 0 where a dim of size 1 is broadcast."""
    return tuple(tensor.stride(dim) if tensor.shape[dim] > 1 else 0 for dim in dims)


def attention_step(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: torch.Tensor,
                   q_scale: torch.Tensor | None, k_scale: torch.Tensor | None, eps: tuple[float, float],
                   cos: torch.Tensor, sin: torch.Tensor, rotary: int, mask: torch.Tensor, scale: float, heads: int,
                   gate: bool) -> torch.Tensor:
    """qkv [B, T, W] (per query head [query | gate] when `gate`, then the keys, then the values),
    keys / values the static cache layer's [B, H_kv, L, D], first the slot of each row's first token (one value: the
    same for all rows; or [B]), q_scale / k_scale the RMSNorms' multipliers (None: no norm) and eps their epsilons,
    cos / sin [B or 1, T or 1, D] whole-head tables (any strides, the last 1), mask [B or 1, T or 1, L] additive (its
    last stride 1). Writes each token's key and value at its slot first[b] + t; returns the gated attention output
    [B, T, heads * D] (see the module docstring)."""
    B, T = qkv.shape[:2]
    qkv = qkv.reshape(B * T, qkv.shape[-1])  # row b * T + t (a view where the rows are evenly strided)
    HKV, slots, D = keys.shape[1], keys.shape[2], keys.shape[3]
    G = heads // HKV
    rows = G * T  # query rows a KV head
    row_block = min(MAX_ROW_BLOCK, max(16, triton.next_power_of_2(rows)))
    row_blocks = triton.cdiv(rows, row_block)
    # tiles a split: the splits within split_limit
    tiles = triton.cdiv(triton.cdiv(slots, BLOCK_SLOTS), split_limit(qkv.device, B * HKV * row_blocks))
    splits = triton.cdiv(slots, BLOCK_SLOTS * tiles)
    query = qkv.new_empty(B, T, heads, D)
    norm = q_scale is not None
    launch = dependent_launch(qkv.device)
    slot_stride = first.stride(0) if first.numel() > 1 else 0
    common = dict(T=T, H=heads, HKV=HKV, D=D, **launch)
    _prepare_kernel[(B * T, heads + 2 * HKV)](
        qkv, qkv.stride(0), query, keys, values, first, slot_stride,
        q_scale if norm else qkv, k_scale if norm else qkv, cos, sin, *_broadcast_strides(cos, (0, 1)),
        *keys.stride()[:3], *values.stride()[:3], *eps, ROTARY=rotary, GATE=gate, NORM=norm, **common)
    padded = row_blocks * row_block
    partial = B * HKV * splits * padded
    acc = qkv.new_empty(partial, D, dtype=torch.float32)
    maxima = qkv.new_empty(partial, dtype=torch.float32)
    sums = qkv.new_empty(partial, dtype=torch.float32)
    _attend_kernel[(B * HKV, splits, row_blocks)](
        query, keys, values, mask, *_broadcast_strides(mask, (0, 1)), first, slot_stride, acc, maxima, sums,
        *keys.stride()[:3], *values.stride()[:3], scale, slots, tiles, splits, G=G, ROWS=row_block,
        BLOCK=BLOCK_SLOTS, **common)
    out = qkv.new_empty(B, T, heads * D)
    _combine_kernel[(B * T * heads,)](acc, maxima, sums, qkv, qkv.stride(0), out,
                                      splits, padded, G=G, CHUNK=combined_splits(D), GATE=gate, **common)
    return out

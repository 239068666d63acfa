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
   token's own are not written yet, or hold a rejected round's keys (masked anyway): their tiles are skipped. A
   tile's values are loaded with its keys (one memory round trip a tile). The cache's slot count, the mask's strides,
   the tiles per split and the split count are runtime arguments (`tiles` tiles a split, `splits` splits covering the
   slots, at most `split_limit`), none specialised: one compiled kernel per head layout and token count serves a
   static cache of any length (generation makes one of prompt plus new tokens per call).
   How a program streams its slots is an `AttendSettings` (`attend_settings`, by head width and query rows): tiles of
   `slots_per_tile` slots; on a GPU the tile loop software-pipelined, `stages` tiles' loads in flight while a tile's
   products run (a loop that waits for each tile's loads leaves the memory idle between them); `warps` a program;
   and the split limit: `MAX_SPLITS`, or, where the rows, KV heads and row blocks are too few for that to give every
   multiprocessor `programs_per_sm` programs, that many (at batch 1 with 2 KV heads, the benchmark models, 66 or 132
   splits on an H200's 132 multiprocessors). Heads of up to 128 take tiles of 128 slots: with few rows 3 stages, 8
   warps and one program a multiprocessor (192 KiB of tiles in flight each), with many 2 stages. Heads of 256 take
   tiles of 32 with 3 stages, and no pipeline for blocks of more than 32 query rows (the float32 accumulator of 64
   rows fills the registers; stages make it spill). Where a compiled kernel needs more shared memory than the GPU has
   (an A100's 164 KiB a program against an H200's 227), it runs with the stages that fit (`_launch_in_shared_memory`).
   One token, 16 query / 2 KV heads, bf16, a replayed step's three kernels (`benchmarks/bench_attention_step.py`,
   H200): heads of 128 at 131,072 / 1,048,576 slots 52.0 / 301.7 us (2.58 / 3.56 TB/s of keys and values read),
   heads of 256 96.1 / 599.0 us (2.79 / 3.58 TB/s); tiles of 64 slots without a pipeline take 1.12-1.57x these
   times (docs/performance.md).
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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError as error:
    raise ImportError("the fused attention step needs triton (a CUDA machine)") from error

from .kernels_launch_triton import await_previous_kernel, dependent_launch

MAX_ROW_BLOCK = 64  # query rows (heads of a KV group x tokens) per `_attend_kernel` program at most
MAX_SPLITS = 64  # programs per (row, KV head, row block) at most where they fill the GPU: a split then covers several
# tiles


@dataclasses.dataclass(frozen=True)
class AttendSettings:
    """How `_attend_kernel` streams the cache: `slots_per_tile` slots a tl.dot tile, `stages` tiles in flight (the
    tile loop's software pipeline on a GPU; 0: a loop that waits for each tile's loads), `warps` a program, and
    `programs_per_sm` the programs a multiprocessor gets where the rows leave it idle (`split_limit`)."""

    slots_per_tile: int
    stages: int
    warps: int
    programs_per_sm: int


# measured on an H200 (`benchmarks/bench_attention_step.py`; the module docstring): heads of up to 128 where the rows
# (batch x KV heads x row blocks) are too few to fill the GPU (a long cache at batch 1: few deep programs, 192 KiB of
# tiles in flight each) and where they fill it; wider heads (256) either way (their tiles need more registers)
NARROW_FEW_ROWS = AttendSettings(slots_per_tile=128, stages=3, warps=8, programs_per_sm=1)
NARROW_MANY_ROWS = AttendSettings(slots_per_tile=128, stages=2, warps=4, programs_per_sm=2)
WIDE_HEADS = AttendSettings(slots_per_tile=32, stages=3, warps=4, programs_per_sm=2)
# wider heads with blocks of more than 32 query rows (a verify round of 5 tokens or more for a group of 8): the float32
# accumulator of 64 rows fills the registers, and a pipeline's tiles in flight make it spill (1.65x slower)
WIDE_HEADS_MANY_QUERIES = AttendSettings(slots_per_tile=32, stages=0, warps=4, programs_per_sm=2)
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


@triton.jit
def _attend_tile(query, keys_ptr, values_ptr, mask_rows, real, start, last, slots, stride_kl, stride_vl, scale,
                 running_max, running_sum, acc, D: tl.constexpr, BLOCK: tl.constexpr):
    """The online softmax of `_attend_kernel` one tile further: slots start .. start + BLOCK - 1 of one KV head (its
    keys_ptr / values_ptr), returning the new running maxima, sums and accumulators."""
    d = tl.arange(0, D)
    s_idx = start + tl.arange(0, BLOCK)
    seen = (s_idx < slots) & (s_idx <= last)
    keys = tl.load(keys_ptr + s_idx[:, None] * stride_kl + d[None, :], mask=seen[:, None], other=0.0)
    # the values with the keys: one memory round trip for the tile, not a second one after the softmax
    values = tl.load(values_ptr + s_idx[:, None] * stride_vl + d[None, :], mask=seen[:, None], other=0.0)
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
    return new_max, running_sum, acc


# the cache length's arguments are not specialised (by value 1 or divisibility by 16), so that no length compiles a
# kernel of its own; the cache's strides scale with it too but stay multiples of D >= 16
@triton.jit(do_not_specialize=["stride_mask_b", "stride_mask_t", "slots", "tiles", "splits"])
def _attend_kernel(query_ptr, keys_ptr, values_ptr, mask_ptr, stride_mask_b, stride_mask_t, slot_ptr, stride_slot,
                   acc_ptr, max_ptr, sum_ptr, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, scale,
                   slots, tiles, splits, T: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                   PDL: tl.constexpr = False):
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
    keys_ptr += b * stride_kb + j * stride_kh
    values_ptr += b * stride_vb + j * stride_vh
    mask_rows = mask_ptr + b * stride_mask_b + t * stride_mask_t
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    first_tile = split * tiles
    written = tl.minimum(tiles, last // BLOCK + 1 - first_tile)  # the split's tiles up to the last one written (<= 0:
    # none)
    if STAGES > 0:  # a compiled kernel: the loop's loads issued STAGES - 1 tiles ahead of their products
        for tile in tl.range(0, written, num_stages=STAGES):
            running_max, running_sum, acc = _attend_tile(
                query, keys_ptr, values_ptr, mask_rows, real, (first_tile + tile) * BLOCK, last, slots, stride_kl,
                stride_vl, scale, running_max, running_sum, acc, D, BLOCK)
    else:  # (triton's interpreter, whose range takes no runtime bound under numpy >= 2.4)
        tile = 0
        while tile < written:
            running_max, running_sum, acc = _attend_tile(
                query, keys_ptr, values_ptr, mask_rows, real, (first_tile + tile) * BLOCK, last, slots, stride_kl,
                stride_vl, scale, running_max, running_sum, acc, D, BLOCK)
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


def attend_settings(device: torch.device, head_dim: int, row_block: int, programs_per_split: int) -> AttendSettings:
    """The `AttendSettings` of heads of `head_dim`, blocks of `row_block` query rows, and splits that run
    `programs_per_split` programs each (rows x KV heads x row blocks): few rows where `MAX_SPLITS` splits would leave
    a CUDA device's multiprocessors under two programs each."""
    if head_dim > 128:
        return WIDE_HEADS if row_block <= 32 else WIDE_HEADS_MANY_QUERIES
    few = device.type == "cuda" and MAX_SPLITS * programs_per_split < 2 * _multiprocessors(device)
    return NARROW_FEW_ROWS if few else NARROW_MANY_ROWS


def split_limit(device: torch.device, programs_per_split: int, programs_per_sm: int) -> int:
    """The splits of the cache slots `_attend_kernel` may use when each split runs `programs_per_split` programs:
    MAX_SPLITS, or more where that leaves a CUDA device's multiprocessors fewer than `programs_per_sm` programs each
    (the module docstring)."""
    if device.type != "cuda":  # (triton's interpreter)
        return MAX_SPLITS
    return max(MAX_SPLITS, programs_per_sm * _multiprocessors(device) // programs_per_split)


def combined_splits(head_dim: int) -> int:
    """The splits `_combine_kernel` loads at once for heads of width `head_dim` (a power of two): as many as
    `COMBINED_ELEMENTS` partial sums hold, at most `MAX_SPLITS`; a power of two, whatever the cache's length."""
    return max(min(MAX_SPLITS, COMBINED_ELEMENTS // head_dim), 1)


_stages_that_fit: dict[tuple, int] = {}  # (device, layout, settings, dtypes) -> the pipeline stages its kernel took


def _launch_in_shared_memory(attend: Callable[..., Any], stages: int, key: tuple) -> None:
    """attend(STAGES=stages), with fewer stages where the compiled kernel needs more shared memory than the device
    has (the settings were measured on an H200; triton raises OutOfResources as it loads the kernel, before any
    launch): the stages that fit are kept per `key` for the next calls."""
    stages = _stages_that_fit.get(key, stages)
    while True:
        try:
            attend(STAGES=stages)
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _stages_that_fit[key] = stages
        return


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
    settings = attend_settings(qkv.device, D, row_block, B * HKV * row_blocks)
    block = settings.slots_per_tile
    # tiles a split: the splits within split_limit
    tiles = triton.cdiv(triton.cdiv(slots, block), split_limit(qkv.device, B * HKV * row_blocks,
                                                               settings.programs_per_sm))
    splits = triton.cdiv(slots, block * tiles)
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
    attend = functools.partial(
        _attend_kernel[(B * HKV, splits, row_blocks)], query, keys, values, mask, *_broadcast_strides(mask, (0, 1)),
        first, slot_stride, acc, maxima, sums, *keys.stride()[:3], *values.stride()[:3], scale, slots, tiles, splits,
        G=G, ROWS=row_block, BLOCK=block, num_warps=settings.warps, **common)
    if qkv.device.type != "cuda" or not settings.stages:  # (triton's interpreter, or settings without a pipeline)
        attend(STAGES=0)
    else:
        _launch_in_shared_memory(attend, settings.stages, (qkv.device, T, G, D, row_block, settings, keys.dtype,
                                                           mask.dtype, query.dtype))
    out = qkv.new_empty(B, T, heads * D)
    _combine_kernel[(B * T * heads,)](acc, maxima, sums, qkv, qkv.stride(0), out,
                                      splits, padded, G=G, CHUNK=combined_splits(D), GATE=gate, **common)
    return out

"""Attention of a decoding step (one query per head and row) as two batched GEMMs, for the GPU's captured steps.

At batch 1 a decoding step's attention is tiny (one query per head against a few thousand cached keys), and the
fused SDPA kernels are built for long query blocks: for one query they take tens of microseconds per layer (cuDNN's,
and the memory-efficient kernel that MLA's absorbed step, a 576-wide key, falls back to), against a few microseconds
for the GEMMs' reads (profile_decode_step.py). Here the query heads that
share a KV head are the rows of one matrix, so each KV head is read once, with no copy per query head:

    rows = q [B, H_kv, G * T_q, d]  (query head h = j * G + g reads KV head j, transformers' repeat_kv order)
    s = rows K^T  (float32, accumulated in float32 from bf16/fp16 inputs)
    p = softmax(scale * s + mask)  (float32),   o = p V  (p rounded to the value dtype, as fused kernels do)

Every row of a KV head must see the same keys: one query position per row (T_q = 1, any G), or, for MLA's absorbed
step, heads as rows of a single KV head (G = 1) under a mask with one query row: the caller knows which, and
`one_query_applies` checks the rest. A few query positions (a speculative verify round's k tokens, 2 <= T_q <=
MAX_FEW_QUERIES) take the same two GEMMs with one mask row per position, broadcast over the G heads of a KV head
(`few_queries_apply`): there too the fused kernels plan for long query blocks (cuDNN's flash kernel took some 70 us a
layer for a 4-token round of the 1.2B benchmark model on an H200). That path is taken only where the caller guarantees
that every query sees at least one key (a row with none would be NaN, and a NaN key poisons every query's sums even
where masked): `VerifyCache`'s masks do. Takes transformers' attention-interface arguments and returns
(output [B, T_q, H, dv], None).
"""

from __future__ import annotations

import functools

import torch

# Devices whose one-query steps take this path (tests add "cpu" to run it there: on CPUs SDPA's math path is as fast).
ONE_QUERY_DEVICES = ("cuda",)
MAX_FEW_QUERIES = 16  # query positions per row up to which a verify round's attention takes the two GEMMs


def one_query_applies(query: torch.Tensor, attention_mask, implementation: str) -> bool:
    """Whether a step whose rows share their mask (the caller knows: see the module docstring) may attend by
    `one_query_attention`: sdpa chosen (eager keeps its own math and returns weights), a device that takes it, and a
    mask that is a tensor with one query row and one head (broadcast over all), or none."""
    if implementation != "sdpa" or query.device.type not in ONE_QUERY_DEVICES:
        return False
    return attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                                      and attention_mask.shape[1] == 1 and attention_mask.shape[-2] == 1)


def few_queries_apply(query: torch.Tensor, attention_mask, implementation: str, cache) -> bool:
    """Whether a forward of 2 to MAX_FEW_QUERIES query positions may attend by `one_query_attention`: sdpa chosen, a
    device that takes it, a mask tensor with one row per query position and one head, and a cache whose masks give
    every query at least one key (`every_query_sees_a_key`: see the module docstring)."""
    if implementation != "sdpa" or query.device.type not in ONE_QUERY_DEVICES:
        return False
    if not 2 <= query.shape[-2] <= MAX_FEW_QUERIES or not getattr(cache, "every_query_sees_a_key", False):
        return False
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[-2] == query.shape[-2])


@functools.cache
def _bmm_returns_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has bmm's `out_dtype` (torch >= 2.8, CUDA) for `dtype` inputs on `device` (asked once, by
    the warm-up steps that precede a capture)."""
    try:
        one = torch.ones(1, 1, 1, device=device, dtype=dtype)
        return torch.bmm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _scores(rows: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """rows [N, R, d] times keys_t [N, d, L] in float32 (bf16/fp16 products accumulated and returned in float32)."""
    if rows.dtype in (torch.bfloat16, torch.float16) and _bmm_returns_float32(rows.device, rows.dtype):
        return torch.bmm(rows, keys_t, out_dtype=torch.float32)
    if rows.dtype in (torch.float32, torch.float64):
        return torch.bmm(rows, keys_t)
    return torch.bmm(rows.float(), keys_t.float())


def one_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T_q, d], key [B, H_kv, L, d], value [B, H_kv, L, dv] (a strided view is read in place), mask
    [B or 1, 1, 1 or T_q, L] additive or bool (True: seen), or None. Returns ([B, T_q, H, dv], None)."""
    B, H, Tq, d = query.shape
    Hkv, L, dv = key.shape[1], key.shape[2], value.shape[-1]
    G = H // Hkv
    rows = query.reshape(B * Hkv, G * Tq, d)  # KV head j's rows: its G query heads' T_q positions, (g, t) order
    scores = _scores(rows, key.reshape(B * Hkv, L, d).transpose(1, 2)).view(B, Hkv, G, Tq, L)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, None]  # [B, 1, 1, 1 or T_q, L]: a position's row for all G heads
    if attention_mask is None:
        scores = scores * scaling
    elif attention_mask.dtype == torch.bool:
        scores = (scores * scaling).masked_fill_(~attention_mask, float("-inf"))
    else:
        scores = torch.add(attention_mask, scores, alpha=scaling)  # one kernel: mask + scale * s, in float32
    # (float32 softmax, float64 for a float64 model: its exactness tests compare in float64)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    output = torch.matmul(probs.view(B, Hkv, G * Tq, L), value)  # [B, H_kv, G * T_q, dv]
    return output.view(B, H, Tq, dv).transpose(1, 2), None

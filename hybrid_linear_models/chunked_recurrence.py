"""A GDN/KDA layer over a long prompt without gradients, a chunk of tokens at a time, its state carried between chunks.

A GDN/KDA mixer over T tokens holds its projections, convolution output and the delta rule's per-chunk states for all
T at once: for the GPU GDN benchmark model about 120 KiB per token in bf16 (in_proj_qkvz's 12,288 outputs, the
convolved q | k | v, fla's [T / 64, heads, dk, dv] chunk states and its w, u and v_new), some 120 GiB for a 1M-token
prompt, where the layer's input and output are 4 KiB per token. The recurrence needs no more than its state to go on:
run over consecutive chunks of the tokens (token_chunks.chunk_bounds: aligned at 64, the delta rule's own chunk
length, so each piece splits into the kernel's chunks as the whole does), each piece starts from the conv and
recurrent states the last one left (a cache layer of the forward's cache, or one made for the call), and the layer's
working set is that of one piece. Packed sequences (cu_seqlens) run whole; padded rows take their piece of the
padding mask (a pad keeps the state as it was, in whichever piece it falls).

The result equals the whole layer's to float32 summation order (measured identical in float64 on the CPU:
tests/test_long_context.py); gradients, torch.compile and prompts of at most a chunk run whole (token_chunks).
"""

from __future__ import annotations

import torch
from torch import nn

from .cache_hybrid_linear import LinearStateLayer
from .sequence_info import SequenceInfo
from .token_chunks import chunk_bounds, chunks_apply


def recurrence_chunks_apply(hidden_states: torch.Tensor, info: SequenceInfo) -> bool:
    """Whether a GDN/KDA layer runs `recur_in_token_chunks` on these inputs (see the module docstring)."""
    return info.cu_seqlens is None and chunks_apply(hidden_states.shape[1])


def recur_in_token_chunks(mixer: nn.Module, hidden_states: torch.Tensor, info: SequenceInfo,
                          cache: LinearStateLayer | None) -> torch.Tensor:
    """mixer(hidden_states [B, T, H], info, cache) a chunk of tokens at a time, the states carried in `cache` (one made
    for the call when None), the outputs written into one [B, T, H'] tensor."""
    state = cache if cache is not None else LinearStateLayer()
    batch, tokens = hidden_states.shape[:2]
    bounds = chunk_bounds(tokens)
    out = None
    for start, end in zip(bounds[:-1], bounds[1:]):
        padding = None if info.padding_mask is None else info.padding_mask[:, start:end]
        result = mixer(hidden_states[:, start:end], SequenceInfo(batch, end - start, padding_mask=padding), state)
        if out is None:
            out = result.new_empty((batch, tokens, *result.shape[2:]))
        out[:, start:end] = result
        del result
    return out


__all__ = ["recur_in_token_chunks", "recurrence_chunks_apply"]

"""Token-wise work on a long prompt, a chunk of tokens at a time, so its wide intermediates stay bounded.

A token-wise op f (each output row a function of the same input row alone: the gated MLP, an MoE layer's experts
after routing) over T tokens holds its intermediates for all T at once: the gated MLP of width I holds gate, up and
their product, 3 x T x I values, 33 GiB in bf16 for a 1M-token prompt at I = 5632 (the GPU benchmark models), where
the hidden states themselves are T x H (4 GiB at H = 2048). Without gradients (inference, where nothing is kept for a
backward), `token_chunked` runs f on consecutive chunks of the rows and writes each result into one preallocated
output: the peak holds one chunk's intermediates, and the result is the same rows.

Chunks start at multiples of TOKENS_PER_CHUNK (itself a multiple of ROW_ALIGNMENT), and a remainder of less than
half a chunk joins the last chunk: no chunk has fewer than TOKENS_PER_CHUNK / 2 rows. A GEMM computes a row the same way
in a chunk as in the whole when both group it with the same rows: CPU BLAS kernels work on blocks of a few rows from
the first (a one-column GEMV, as the shared expert's gate, on blocks of 4 here) and take other kernels for very few
rows (below 12 here); aligned chunks, none short, keep each row in the same block with the same tail. Measured on the
CPU in float32: the dense MLP's and the shared expert's chunked outputs are bit-identical to the whole ones; the routed
experts' are not quite (each expert's GEMM gets the tokens routed to it within the chunk: other row counts, the same
values up to float32 summation order, ~1e-6), and their routes are the same (routed once, whole). On CUDA, cuBLAS
picks a kernel per shape, which agrees up to the rounding of the GEMM's sums. tests/test_long_context.py checks the
chunked forward against the whole one to summation order, which holds whatever the BLAS.

With gradients (training) the op runs whole: the backward keeps the intermediates anyway, and gradient checkpointing
is the tool there. Under torch.compile too: the compiler plans the memory of the graph it traces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Tokens per chunk. 8192 rows keep each GEMM large enough to run at full speed on a GPU (8192 x 2048 x 5632 is 0.19
# TFLOP), while the gated MLP's intermediates of a chunk, 3 x 8192 x I values (at most 1.5 times that for the last
# chunk), stay small: 0.26 GiB in bf16 for I = 5632, 0.66 GiB for I = 14336.
TOKENS_PER_CHUNK = 8192
ROW_ALIGNMENT = 64  # chunks start at multiples of it (see the module docstring; also a GPU GEMM's tile height)


def chunk_bounds(tokens: int) -> list[int]:
    """Where `token_chunked` splits `tokens` rows: [0, s, 2s, ..., tokens], s = TOKENS_PER_CHUNK rounded up to a
    multiple of ROW_ALIGNMENT, a last piece shorter than s / 2 joined to the one before."""
    size = -(-TOKENS_PER_CHUNK // ROW_ALIGNMENT) * ROW_ALIGNMENT
    bounds = list(range(0, tokens, size)) + [tokens]
    if len(bounds) > 2 and 2 * (bounds[-1] - bounds[-2]) < size:
        del bounds[-2]
    return bounds


def shortest_chunked_length() -> int:
    """The fewest rows `chunk_bounds` splits in more than one piece (a chunk and a last piece of half of one)."""
    size = -(-TOKENS_PER_CHUNK // ROW_ALIGNMENT) * ROW_ALIGNMENT
    return size + -(-size // 2)


def chunks_apply(tokens: int) -> bool:
    """Whether a token-wise op over `tokens` rows runs in chunks here: more rows than a chunk, no gradient, not
    traced by torch.compile (asked first: a traced comparison of the token count would be a guard on it)."""
    return not torch.compiler.is_compiling() and not torch.is_grad_enabled() and tokens > TOKENS_PER_CHUNK


def token_chunked(op: Callable[..., torch.Tensor], rows: torch.Tensor, *row_aligned: torch.Tensor) -> torch.Tensor:
    """op(rows, *row_aligned), with rows [N, ...] and each of `row_aligned` [N, ...] (per-row inputs the op takes with
    them: an MoE layer's routing), run on chunks of the rows when `chunks_apply(N)` (see the module docstring). The
    op's output is [n, ...] for n input rows."""
    tokens = rows.shape[0]
    if not chunks_apply(tokens):
        return op(rows, *row_aligned)
    out = None
    bounds = chunk_bounds(tokens)
    for start, end in zip(bounds[:-1], bounds[1:]):
        result = op(rows[start:end], *(tensor[start:end] for tensor in row_aligned))
        if out is None:
            out = result.new_empty((tokens, *result.shape[1:]))
        out[start:end] = result
        del result
    return out


__all__ = ["ROW_ALIGNMENT", "TOKENS_PER_CHUNK", "chunk_bounds", "chunks_apply", "token_chunked"]

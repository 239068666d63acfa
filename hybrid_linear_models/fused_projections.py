"""Several projections of one input run as one GEMM at decoding time (and in speculative verify rounds).

A decoding step at batch 1 is a few hundred small kernels, and each linear layer is one of them: the attention's q, k
and v projections, the MLP's gate and up projections, GDN's in_proj_qkvz and in_proj_ba, KDA's six input
projections all read the same hidden state. Stacked by rows, their weights W = [W_1; ...; W_n] give
x W^T = [x W_1^T | ... | x W_n^T] in one GEMM, every output element the same dot product as separately (the order in
which a BLAS sums it may differ with the matrix width: the same float result up to rounding).

The stacked weight is not a copy: the parameters become views of its row blocks (`derived_weights.SharedRows`), so
it costs no memory and in-place updates (optimiser steps, `load_state_dict`) are in it by construction; a parameter
given new data (`module.to`) is stacked again on the next use.

The mixers and the MLP stack them (`stacks_projections`) in a decoding step (one token per row) and, inside
`projections_stacked_for_few_rows()`, in any forward of at most kernels_gemv.MAX_ROWS rows in all: a speculative
verify round of a few tokens (speculative_decoding), whose products a captured round runs on the decoding GEMV.
Other forwards keep the layers' own GEMMs, so a prompt's logits are bit for bit those of the same model with its
projections wrapped (LoRA) or compiled.

Plain `nn.Linear` layers (or subclasses keeping its forward: MLA's `LatentProjection`) are stacked, and so are
block-scaled FP8 layers (`fp8_layers.Fp8Linear`, a released FP8 checkpoint's attention and shared-expert
projections) of one block size whose outputs keep the blocks whole (each layer's out_features but the last a
multiple of the block's rows): their FP8 weights and their scales stack by rows alike, and the stack is one FP8
product (`kernels_fp8.block_fp8_linear`); gathered outputs, SwiGLU and the convolution's step then run after it,
except a gated MLP's SwiGLU at batch 1, which its FP8 down projection computes as it reads its input (`swiglu_down`:
`kernels_fp8.block_fp8_swiglu_linear`). A subclass with a forward of its own, a wrapper (peft's LoRA layers replace
the module), hooks, sharded (DTensor) weights or a compiler tracing the step keep the projections separate, as do
steps that need gradients (training keeps the parameters' own storage untouched).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .block_ops import silu_and_mul
from .derived_weights import SharedRows
from .kernels_fp8 import block_fp8_linear, block_fp8_swiglu_linear
from .kernels_gemv import (
    MAX_ROWS,
    convolve_first,
    linear_conv_step,
    linear_rows,
    linear_swiglu,
)
from .tensor_parallel_heads import device_mesh


def _unwrapped(linear: nn.Module) -> bool:
    return (not linear._forward_hooks and not linear._forward_pre_hooks and "forward" not in vars(linear)
            and device_mesh(linear.weight) is None)


def is_plain_linear(linear: nn.Module) -> bool:
    """An nn.Linear computing nn.Linear's forward (itself, or a subclass that keeps that forward and adds no
    parametrization: mixer_mla's LatentProjection), with no wrapper, hooks, replaced forward or sharded weight: its
    output is F.linear(x, weight, bias), so a fused kernel may compute it."""
    return (isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward
            and not hasattr(linear, "parametrizations") and _unwrapped(linear))


def _fp8_stackable(linears: Sequence[nn.Module]) -> bool:
    """FP8 layers whose weights and scales stack by rows into one FP8 layer's: one block size, every layer's outputs
    but the last's whole blocks (see the module docstring)."""
    from .fp8_layers import Fp8Linear

    if not all(type(m) is Fp8Linear and _unwrapped(m) for m in linears):
        return False
    block = linears[0].block
    return (all(m.block == block and m.weight.dtype == linears[0].weight.dtype for m in linears)
            and all(m.out_features % block[0] == 0 for m in linears[:-1]))


_FEW_ROWS = [0]  # rows up to which any forward stacks its projections; raised by `projections_stacked_for_few_rows`


@contextlib.contextmanager
def projections_stacked_for_few_rows(max_rows: int = MAX_ROWS) -> Iterator[None]:
    """Inside: a forward of at most `max_rows` rows (batch x tokens) stacks its projections as a decoding step does
    (see the module docstring)."""
    _FEW_ROWS.append(max_rows)
    try:
        yield
    finally:
        _FEW_ROWS.pop()


def stacks_projections(x: torch.Tensor) -> bool:
    """Whether a forward of x [B, T, in] stacks its projections (when `FusedProjections.applies`): one token per row,
    or few rows in all inside `projections_stacked_for_few_rows` (see the module docstring)."""
    return x.dim() == 3 and (x.shape[1] == 1 or x.shape[0] * x.shape[1] <= _FEW_ROWS[-1])


class FusedProjections:
    """The projections `linears` (plain nn.Linear layers of one input width, all with biases or none) of one input
    as one GEMM (see the module docstring); held by the module that owns them."""

    def __init__(self):
        self._weight = SharedRows()
        self._bias = SharedRows()
        self._scale = SharedRows()  # (FP8 layers' weight_scale_inv)

    def kept_tensors(self) -> list[SharedRows]:
        return [self._weight, self._bias, self._scale]

    def applies(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> bool:
        """Whether `__call__` may stack these projections for input x: no gradient wanted, no compiler tracing, plain
        layers on x's device and dtype (or stackable FP8 layers on x's device), biases all or none."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        if not all(is_plain_linear(m) for m in linears) and not _fp8_stackable(linears):
            return False
        first = linears[0].weight
        if any(m.weight.device != x.device or m.weight.dtype != first.dtype or m.in_features != linears[0].in_features
               for m in linears):
            return False
        biases = [m.bias is not None for m in linears]
        return all(biases) or not any(biases)

    def __call__(self, x: torch.Tensor, linears: Sequence[nn.Module], rows: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """[... , sum of the layers' out_features]: x through every layer, side by side (check `applies` first);
        with `rows`, only those outputs, in that order (`kernels_gemv.linear_rows`: a captured decoding step reads
        the stacked weight's rows in that order instead of gathering the outputs)."""
        if self._is_fp8(linears):
            out = self._fp8_product(x, linears)
            return out if rows is None else out.index_select(-1, rows)
        weight, bias = self._stacked(linears)
        return F.linear(x, weight, bias) if rows is None else linear_rows(x, weight, bias, rows)

    def swiglu(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> torch.Tensor:
        """silu(gate(x)) * up(x) for linears = (gate, up) of one width (check `applies` first), as one GEMM
        (`kernels_gemv.linear_swiglu`: in a captured decoding step one GEMV whose epilogue computes the SwiGLU)."""
        if self._is_fp8(linears):
            return silu_and_mul(*self._fp8_product(x, linears).chunk(2, dim=-1))
        return linear_swiglu(x, *self._stacked(linears))

    def swiglu_down(self, x: torch.Tensor, linears: Sequence[nn.Module], down: nn.Module) -> torch.Tensor | None:
        """down(silu(gate(x)) * up(x)) for FP8 linears = (gate, up) (check `applies` first) and a plain bias-less FP8
        `down`: the stacked gate/up product, then `kernels_fp8.block_fp8_swiglu_linear` (at batch 1 on a GPU, the down
        projection computing SwiGLU as it reads its input; elsewhere SwiGLU, then down's own product); None for other
        layers (the caller runs `swiglu`, then down)."""
        if not (self._is_fp8(linears) and _fp8_stackable([down]) and down.bias is None):
            return None
        return block_fp8_swiglu_linear(self._fp8_product(x, linears), down.weight, down.weight_scale_inv, down.block)

    def convolved(self, x: torch.Tensor, linears: Sequence[nn.Module], rows: torch.Tensor | None,
                  conv_weight: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked projection's outputs (`rows` of them when given) split at C, the short convolution's channels:
        its decoding step on the first C, `window` updated in place, and the rest as they are (check `applies`
        first; `kernels_gemv.linear_conv_step`: in a captured decoding step one GEMV whose epilogue convolves)."""
        if self._is_fp8(linears):
            return convolve_first(self(x, linears, rows), conv_weight, window)
        return linear_conv_step(x, *self._stacked(linears), rows, conv_weight, window)

    @staticmethod
    def _is_fp8(linears: Sequence[nn.Module]) -> bool:
        return not isinstance(linears[0], nn.Linear)

    def _fp8_product(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> torch.Tensor:
        """The FP8 layers' stacked weight and scales (and biases) as one FP8 product."""
        weight, bias = self._stacked(linears)
        scale = self._scale.get([m.weight_scale_inv for m in linears])
        return block_fp8_linear(x, weight, scale, linears[0].block, bias)

    def _stacked(self, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers' weights stacked by rows, and their biases (None without)."""
        weight = self._weight.get([m.weight for m in linears])
        return weight, self._bias.get([m.bias for m in linears]) if linears[0].bias is not None else None

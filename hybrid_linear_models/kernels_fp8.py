"""Linear layers on block-scaled FP8 weights (the layout of Qwen3-Next's released FP8 build): the plain reference.

A weight W (out, in) is stored as W_fp8 in float8_e4m3fn with one float32 `scale_inv` per bn x bk block (shape
[ceil(out/bn), ceil(in/bk)], the last row and column of blocks possibly partial):

    W[r, c] = W_fp8[r, c] * scale_inv[r // bn, c // bk]

An e4m3 value has 4 significant bits and a float32 scale 24, so their product is exact in float64:
`dequantize_block_fp8` multiplies in float64 and converts to the target dtype. torch converts float64 to bf16 and fp16
through float32, so for those the weight is float32's product w * s rounded to the dtype (in about one element in 2^13
(fp16) or 2^16 (bf16) one unit off a single rounding of the exact product); float32 gets one rounding. The Triton
kernels' dequantized weights round the same way, bit for bit.

`block_fp8_linear` (x @ W.T, optionally only the weight rows of a `RowIndex`, in its order), `block_fp8_grouped_linear`
(the experts: rows sorted by expert, rows of expert e times W_e.T), `block_fp8_routed_linear` (the experts of a
decoding step: each route's row times its expert's W.T, no sort), `block_fp8_routed_swiglu_linear` (their down
projection, reading silu(gate) * up * routing weight from the gate/up rows) and `block_fp8_swiglu_linear` (a gated
MLP's down projection at batch 1 reading silu(gate) * up: the same kernel with the weight as its one expert) are the
entry points the model's FP8 layers call. On CUDA tensors they run this package's Triton kernels
(`kernels_fp8_triton`: the FP8 weight read once, scaled per block as it is loaded, float32 sums) where
`triton_applies`; anything else (the CPU, a gradient wanted for x, triton missing, a GPU older than compute capability
8.9, whose triton has no e4m3) dequantizes and runs the dense op: the plain reference the kernels are checked against.
`PREFILL_FORM` picks what products of more than 16 rows run: the kernel's dequantize-on-load GEMM (the default), the
weight dequantized by a kernel then F.linear, or FP8 tensor cores with x quantized to e4m3 (whose error bound
`kernels_fp8_triton` derives).
A kernel that fails to compile for a layout is not tried again for it, and one warning says the reference runs
instead (inside a CUDA graph capture the error propagates).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .block_ops import silu_and_mul
from .fp8_kernel_contract import OFFSET_DTYPES, PREFILL_FORMS, check_routes
from .tensor_parallel_heads import device_mesh
from .triton_loading import kernel_result, triton_kernel, unit_stride

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations the Triton kernels take
KERNEL_DEVICE_TYPES = ("cuda",)
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
# what products of more than 16 rows (prefill) run (`fp8_kernel_contract.PREFILL_FORMS`): "dequantized_dot" (the
# weight dequantized on load to x's dtype, tl.dot: the reference's product up to the order of its float32 sums),
# "dequantize_then_linear" (dense layers: the weight dequantized by a kernel, then F.linear: the reference's product;
# the experts take "dequantized_dot") or "fp8_dot" (x quantized to e4m3 per row and block column, FP8 tensor cores:
# not the reference's product, each term within 2^-4 of itself)
PREFILL_FORM = "dequantized_dot"
# routes (tokens x top-k) up to which the experts take `block_fp8_routed_linear` on CUDA: a decoding step's. Each
# route reads its expert's weight, so two routes to one expert read it twice; past this, rows sorted by expert
# (`block_fp8_grouped_linear`) read each expert once, for the price of the sort and gathers.
ROUTED_MAX_ROUTES = 64
# where the routed experts' down projection computes SwiGLU and the routing weight as it reads its input
# (`block_fp8_routed_swiglu_linear`; emptied: those ops run apart, as benchmarks/profile_decode_step.py --ab compares)
SWIGLU_INPUT_DEVICE_TYPES = ("cuda",)  # (tests add "cpu")


@triton_kernel
def fp8_linear_kernel():
    """`kernels_fp8_triton.fp8_linear`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_fp8_triton import fp8_linear

    return fp8_linear


@triton_kernel
def fp8_grouped_linear_kernel():
    """`kernels_fp8_triton.fp8_grouped_linear`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_fp8_triton import fp8_grouped_linear

    return fp8_grouped_linear


@triton_kernel
def fp8_routed_linear_kernel():
    """`kernels_fp8_triton.fp8_routed_linear`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_fp8_triton import fp8_routed_linear

    return fp8_routed_linear


@functools.cache
def _has_e4m3(device: torch.device) -> bool:
    """GPUs whose triton converts e4m3 (compute capability 8.9 on: Ada, Hopper, ...); True off CUDA (the
    interpreter)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight (..., out, in) (experts lead with their count): one entry per block of
    the last two dimensions, partial blocks included."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # stored scales that load exactly into float32


def first_bad_scale(scale_inv: torch.Tensor) -> tuple[list[int], float] | None:
    """The block index and value of the first scale that is not finite and positive (a zero, negative, inf or NaN
    scale makes no real weight); None where every scale is."""
    bad = ~(torch.isfinite(scale_inv) & (scale_inv > 0))
    if not bool(bad.any()):
        return None
    index = [int(i) for i in bad.nonzero()[0]]
    return index, scale_inv[tuple(index)].item()


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The real weight of an FP8 `weight` (..., out, in) with its per-block `scale_inv` (block: rows, columns), exact
    in float64, then converted to `dtype` (bf16 and fp16 through float32: see the module docstring). For a dtype
    other than float64 the product is taken in float32: IEEE's product rounds the exact value once, as float64's
    exact product converted to float32 does, so the bits are the same (and torch.compile's Triton code, which has no
    float8 -> float64 conversion, can run it)."""
    rows, cols = weight.shape[-2:]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    scale = scale_inv.to(wide)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(wide) * scale).to(dtype)


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int], power_of_two: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_block_fp8`'s inverse up to e4m3's rounding: weight (..., out, in) -> (float8_e4m3fn weight, float32
    scale_inv (..., ceil(out / bn), ceil(in / bk))), each block divided by its amax / 448 (as the released FP8
    builds scale; an all-zero block gets the smallest normal scale) and rounded to e4m3, the last blocks possibly
    partial. With `power_of_two`, each scale is rounded up to a power of two (every real weight value is then exact
    in bfloat16 too)."""
    rows, cols = weight.shape[-2:]
    bn, bk = block
    grid = scale_shape(tuple(weight.shape), block)[-2:]
    padded = weight.new_zeros(*weight.shape[:-2], grid[0] * bn, grid[1] * bk, dtype=torch.float32)
    padded[..., :rows, :cols] = weight
    blocks = padded.unflatten(-1, (grid[1], bk)).unflatten(-3, (grid[0], bn))  # (..., R, bn, C, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).div_(E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (blocks / scale[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return values.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].to(FP8_WEIGHT_DTYPE), scale


class RowIndex(NamedTuple):
    """Weight rows a product outputs, in order (int64 on the weight's device), and whether they are block-aligned:
    each aligned run of BN outputs comes from one block row of the weight (a kernel tile then takes one row of
    scales)."""

    rows: torch.Tensor
    aligned: bool


def fp8_row_index(rows: torch.Tensor, block_rows: int, device: torch.device) -> RowIndex:
    """`rows` (a CPU integer tensor: read here, once, where the index is built) on `device`, with its alignment to
    blocks of `block_rows` weight rows."""
    runs = rows.to(torch.int64) // block_rows
    aligned = all(bool((run == run[0]).all()) for run in runs.split(block_rows))
    return RowIndex(rows.to(device, torch.int64), aligned)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, rows: RowIndex | None = None) -> torch.Tensor:
    """x (..., in) @ W.T (+ bias) in x's dtype, W the real weight of the FP8 `weight` (out, in) and `scale_inv`; with
    `rows`, only those outputs, in that order (on CUDA the kernel reads those weight rows: no gather after it)."""
    check_block_fp8_weight(weight, scale_inv, block, x.shape[-1], grouped=False)
    if triton_applies(x, weight, scale_inv, bias) and _checked_prefill_form() and (
            rows is None or rows.rows.device == x.device):
        flat = unit_stride(x.reshape(-1, x.shape[-1]))
        out = kernel_result(_FAILED, ("linear", tuple(weight.shape), tuple(block), x.dtype, x.device,
                                      rows is not None), x,
                            f"the FP8 Triton kernel failed for a {tuple(weight.shape)} weight; that product "
                            "dequantizes and runs F.linear",
                            lambda: fp8_linear_kernel()(flat, unit_stride(weight), scale_inv, block, bias,
                                                        prefill=PREFILL_FORM, index=rows))
        if out is not None:
            return out.view(*x.shape[:-1], out.shape[-1])
    out = F.linear(x, dequantize_block_fp8(weight, scale_inv, block, x.dtype), bias)
    return out if rows is None else out.index_select(-1, rows.rows)


def block_fp8_grouped_linear(rows: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                             offsets: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """rows [S, in] @ W_e.T for the rows of each expert e, W (E, out, in) FP8 with `scale_inv` (E, ...); `offsets`
    [E] the cumulative end row of each expert's rows (torch's grouped_mm convention: expert e owns rows
    offsets[e-1]:offsets[e]). On CUDA one kernel launch for all experts, with no host synchronization (capturable
    in a CUDA graph); `offsets` must then be non-decreasing (not checked: that would read them; no row past S is read
    or written whatever they say)."""
    check_block_fp8_weight(weight, scale_inv, block, rows.shape[-1], grouped=True)
    if (rows.dim() != 2 or offsets.dim() != 1 or offsets.shape[0] != weight.shape[0]
            or offsets.dtype not in OFFSET_DTYPES):
        raise ValueError(f"block_fp8_grouped_linear: rows {tuple(rows.shape)} must be [S, in] and offsets "
                         f"{tuple(offsets.shape)} {offsets.dtype} one int32/int64 end per expert ({weight.shape[0]}); "
                         "sort the rows by expert and pass the cumulative counts")
    if triton_applies(rows, weight, scale_inv, None) and offsets.device == rows.device and _checked_prefill_form():
        out = kernel_result(_FAILED, ("grouped", tuple(weight.shape), tuple(block), rows.dtype, rows.device), rows,
                            f"the FP8 Triton grouped kernel failed for a {tuple(weight.shape)} weight; the experts "
                            "dequantize and run F.linear one by one",
                            lambda: fp8_grouped_linear_kernel()(unit_stride(rows), unit_stride(weight), scale_inv,
                                                                offsets, block, prefill=PREFILL_FORM))
        if out is not None:
            return out
    out = rows.new_empty(rows.shape[0], weight.shape[-2])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = block_fp8_linear(rows[start:end], weight[expert], scale_inv[expert], block)
        start = end
    return out


def routed_applies(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, routes: int) -> bool:
    """Whether experts of `routes` routes over rows x run as `block_fp8_routed_linear`'s kernel: at most
    ROUTED_MAX_ROUTES routes, where the Triton kernels apply (`triton_applies`)."""
    return routes <= ROUTED_MAX_ROUTES and triton_applies(x, weight, scale_inv, None)


def block_fp8_routed_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, routes: torch.Tensor,
                            block: tuple[int, int]) -> torch.Tensor:
    """x [T, in] and `routes` [T * R] (an int32/int64 tensor, route r's expert for row r // R of x): [T * R, out],
    row r = x[r // R] @ W_e.T, W (E, out, in) FP8 with `scale_inv` (E, ...); a route to an expert outside 0..E-1
    (expert parallelism's other ranks) is a row of zeros. On CUDA one launch with no host synchronization; elsewhere
    each route's dequantized weight (the reference)."""
    check_block_fp8_weight(weight, scale_inv, block, x.shape[-1], grouped=True)
    check_routes(x, routes)
    if triton_applies(x, weight, scale_inv, None) and routes.device == x.device:
        out = kernel_result(_FAILED, ("routed", tuple(weight.shape), tuple(block), x.dtype, x.device), x,
                            f"the FP8 Triton routed kernel failed for a {tuple(weight.shape)} weight; the experts "
                            "dequantize each route's weight",
                            lambda: fp8_routed_linear_kernel()(unit_stride(x), unit_stride(weight), scale_inv,
                                                               routes, block))
        if out is not None:
            return out
    experts = weight.shape[0]
    served = (routes >= 0) & (routes < experts)
    chosen = routes.clamp(0, max(experts - 1, 0))
    weights = dequantize_block_fp8(weight[chosen], scale_inv[chosen], block, x.dtype)  # [T * R, out, in]
    rows = x.repeat_interleave(routes.shape[0] // max(x.shape[0], 1), dim=0)
    out = torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)
    return torch.where(served[:, None], out, 0)


def block_fp8_routed_swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                                   routes: torch.Tensor, route_weights: torch.Tensor,
                                   block: tuple[int, int]) -> torch.Tensor:
    """gate_up [T * R, 2 in] (each route's [gate | up] row, as `block_fp8_routed_linear` gives it), `routes` [T * R]
    and `route_weights` [T * R] in gate_up's dtype: [T * R, out], route r's row (silu(gate_r) * up_r *
    route_weights[r]) @ W_e.T, each elementwise op rounded to the dtype (the experts' SwiGLU and routing weight as
    torch's ops compute them). On CUDA one launch, whose loads of gate_up compute that input; elsewhere (and where
    the kernel failed) those ops, then `block_fp8_routed_linear`."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2 or route_weights.shape != (gate_up.shape[0],):
        raise ValueError(f"routed SwiGLU experts: gate_up {tuple(gate_up.shape)} must be [routes, 2 * in] and "
                         f"route_weights {tuple(route_weights.shape)} one weight per route")
    check_block_fp8_weight(weight, scale_inv, block, gate_up.shape[-1] // 2, grouped=True)
    check_routes(gate_up, routes)
    if (gate_up.device.type in SWIGLU_INPUT_DEVICE_TYPES and triton_applies(gate_up, weight, scale_inv, None)
            and routes.device == gate_up.device
            and route_weights.dtype == gate_up.dtype and route_weights.device == gate_up.device):
        out = kernel_result(_FAILED, ("routed_swiglu", tuple(weight.shape), tuple(block), gate_up.dtype,
                                      gate_up.device), gate_up,
                            f"the FP8 Triton routed SwiGLU kernel failed for a {tuple(weight.shape)} weight; the "
                            "experts run SwiGLU apart",
                            lambda: fp8_routed_linear_kernel()(unit_stride(gate_up), unit_stride(weight), scale_inv,
                                                               routes, block, gated_by=route_weights.contiguous()))
        if out is not None:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    gated = F.silu(gate) * up * route_weights[:, None]
    return block_fp8_routed_linear(gated, weight, scale_inv, routes, block)


def swiglu_input_applies(gate_up: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    """Whether `block_fp8_swiglu_linear` runs as one kernel for gate_up of one row in all (a decoding step at batch
    1), where the routed SwiGLU kernel applies (and its one route's constants exist or may be made: not first inside a
    CUDA graph's capture, whose memory they would outlive)."""
    if gate_up.numel() != gate_up.shape[-1] or gate_up.device.type not in SWIGLU_INPUT_DEVICE_TYPES:
        return False
    made = (gate_up.device, gate_up.dtype) in _ONE_ROUTE
    if not made and gate_up.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return triton_applies(gate_up, weight, scale_inv, None)


def block_fp8_swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            block: tuple[int, int]) -> torch.Tensor:
    """gate_up [..., 2 in] ([gate | up], as the stacked gate/up product gives it): [..., out], (silu(gate) * up) @
    W.T, W (out, in) FP8 with `scale_inv`. Where `swiglu_input_applies` (one row), one launch of
    `block_fp8_routed_swiglu_linear`'s kernel with W as the one expert of one route of weight 1: its loads compute the
    input, each elementwise op rounded to the dtype as torch's ops round (x 1 is exact), so no SwiGLU kernel runs
    before it; elsewhere SwiGLU (`block_ops.silu_and_mul`), then `block_fp8_linear`."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"FP8 SwiGLU down projection: gate_up {tuple(gate_up.shape)} must end in 2 * in ([gate | up])")
    check_block_fp8_weight(weight, scale_inv, block, gate_up.shape[-1] // 2, grouped=False)
    if swiglu_input_applies(gate_up, weight, scale_inv):
        key = (gate_up.device, gate_up.dtype)
        if key not in _ONE_ROUTE:  # (made once, outside any capture: every graph reads the same two tensors)
            with torch.inference_mode(False):  # (normal tensors, whatever mode the first call runs in)
                _ONE_ROUTE[key] = (torch.zeros(1, dtype=torch.int64, device=gate_up.device),
                                   torch.ones(1, dtype=gate_up.dtype, device=gate_up.device))
        expert, one = _ONE_ROUTE[key]
        out = block_fp8_routed_swiglu_linear(gate_up.reshape(1, -1), weight[None], scale_inv[None], expert, one,
                                             block)
        return out.view(*gate_up.shape[:-1], out.shape[-1])
    return block_fp8_linear(silu_and_mul(*gate_up.chunk(2, dim=-1)), weight, scale_inv, block)


_ONE_ROUTE: dict = {}  # (device, dtype) -> (expert 0 as the one route, its weight 1): `block_fp8_swiglu_linear`
_FAILED: dict = {}  # (kind, weight shape, block, dtype, device) -> the first error: the reference from then on


def _checked_prefill_form() -> bool:
    """True; a ValueError line where PREFILL_FORM names no form."""
    if PREFILL_FORM not in PREFILL_FORMS:
        raise ValueError(f"kernels_fp8.PREFILL_FORM {PREFILL_FORM!r}: expected one of {', '.join(PREFILL_FORMS)}")
    return True


def check_block_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], inputs: int,
                           grouped: bool) -> None:
    """One ValueError line naming what does not fit: the weight's dimensions ([E,] out, in), its inputs against x's,
    the block (two positive integers) and scale_inv's shape ([E,] ceil(out / BN), ceil(in / BK))."""
    dims = 3 if grouped else 2
    if weight.dim() != dims:
        raise ValueError(f"FP8 weight of shape {tuple(weight.shape)}: expected {dims} dimensions "
                         f"({'[experts, out, in]' if grouped else '[out, in]'})")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"FP8 block {block!r}: expected two positive integers (rows, columns), as the checkpoint's "
                         "weight_block_size")
    if weight.shape[-1] != inputs:
        raise ValueError(f"FP8 weight of shape {tuple(weight.shape)} takes {weight.shape[-1]} inputs, x has {inputs}")
    expected = scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 scale_inv of shape {tuple(scale_inv.shape)} for a {tuple(weight.shape)} weight in "
                         f"{block[0]}x{block[1]} blocks: expected {expected}, one scale per block")


def triton_applies(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the product runs as a Triton kernel: x CUDA bf16/fp16/fp32, weight e4m3 and scale_inv float32 on x's
    device (a bias too, in x's dtype, 1-D), no gradient wanted, no device mesh, triton importable, a GPU with e4m3."""
    if x.device.type not in KERNEL_DEVICE_TYPES or x.dtype not in KERNEL_DTYPES:
        return False
    if weight.dtype != FP8_WEIGHT_DTYPE or scale_inv.dtype != torch.float32:
        return False
    if weight.device != x.device or scale_inv.device != x.device:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.device != x.device
                             or bias.stride(0) != 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if any(device_mesh(t) is not None for t in (x, weight, scale_inv)):
        return False
    return fp8_linear_kernel() is not None and _has_e4m3(x.device)


__all__ = [
    "SCALE_DTYPES",
    "RowIndex",
    "block_fp8_grouped_linear",
    "block_fp8_linear",
    "block_fp8_routed_linear",
    "block_fp8_routed_swiglu_linear",
    "block_fp8_swiglu_linear",
    "check_block_fp8_weight",
    "dequantize_block_fp8",
    "first_bad_scale",
    "fp8_row_index",
    "quantize_block_fp8",
    "routed_applies",
    "scale_shape",
    "swiglu_input_applies",
    "triton_applies",
]

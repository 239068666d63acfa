"""The linear layers of a captured decoding step: bf16/fp16 GEMVs go to a Triton kernel of this package.

At batch 1 to 16 a linear layer reads its weight once and does little else, so it should run at the memory bandwidth.
cuBLAS does for wide outputs, but not for narrow ones (2,048 outputs and fewer: GDN's out_proj, the MLPs' down_proj,
the attention's o_proj, MLA's kv_a, a shared expert). The products within `WIDEST_OUTPUTS` therefore run through
`kernels_gemv_triton.triton_gemv` (float32 accumulation, as cuBLAS's; the sums are ordered differently, so results
agree to rounding). At batch 1 its one-row form beats cuBLAS on every shape of the benchmark models, narrow and wide,
hence no width limit for one row. For 2 to 8 rows (a speculative verify round of a few tokens, small batches) its
elementwise form beats cuBLAS up to 1,024 outputs (4 rows: MLA's kv_a 3.5 against 6.0 us, a shared expert's gate and
up 5.7 against 12.7 us) and loses past them, where cuBLAS reads at 65-80% of the bandwidth; the tl.dot form then
serves a gathered product (GDN's regrouped input projection at 4 rows: 17.1 us against 22.5 for cuBLAS and the
gather), but not SwiGLU's pairs (24.2 against 15.1 for cuBLAS and SwiGLU's kernel). For 9 to 16 rows the tl.dot form
wins up to 2,048 outputs and loses beyond. Hence the limits (`form`, `WIDEST_OUTPUTS`; figures of
`benchmarks/bench_decode_gemv.py --batches 1 4 8`, H200, in docs/performance.md). It runs when:
- the input is CUDA bf16/fp16 with at most 16 rows and a unit stride along its features, the weight a plain 2-D tensor
  of the same dtype (a bias too, or none), no gradient wanted, triton importable, a GPU of compute capability 8.0 or
  later (a kernel that still fails to compile is dropped for that shape, with a warning: `decode_linear`);
- the call happens inside a captured decoding step (`decode_gemv_mode`, entered by `CudaGraphDecoder` around the
  step it records): every `F.linear` of the step is looked at there, whichever module calls it (projections, LoRA
  layers' base weights, the LM head), and the graph replays the chosen kernels with no Python at all.
Anything else keeps `F.linear`. The kernel is autotuned in the warm-up steps before the capture.

Four products with more to them take part in `__torch_function__` dispatch (`torch.overrides.handle_torch_function`),
as torch's own functions do, so the mode sees them:
- `linear_rows(x, W, b, rows)`, F.linear followed by a gather of its outputs (GDN's decoding step regroups its fused
  input projection so): one kernel reads the weight rows in the gathered order, and the gather, a kernel of its own
  otherwise, disappears;
- `linear_swiglu(x, [W_gate; W_up], b)`, the gated MLP's silu(x W_gate^T) * (x W_up^T): one kernel reads the rows in
  (gate_j, up_j) pairs (`swiglu_pair_rows`) and stores each pair's SwiGLU, so neither SwiGLU's kernel nor the
  [gate | up] output exists, and the down projection is a plain GEMV. (SwiGLU computed as the down projection loads
  its input would be computed again by every program for its slice, a slower down projection, and at batch 16 a much
  slower one.)
- `linear_conv_step(x, W, b, rows, conv_weight, window)`, GDN's and KDA's input projection followed by the short
  convolution's decoding step on its first C outputs (the flat [q | k | v]): the GEMV's programs hold those sums, so
  each runs the step for its own channels as it stores them (fla's `causal_conv1d_update` math: the window's last
  KW - 1 inputs, the product rounded to the dtype shifted in, float32 taps, silu, one rounding; the window written
  back whole), and the convolution's kernel disappears. Where the epilogue does not apply the GEMV runs alone and the
  convolution's kernel after it;
- `linear_widened(x, W, b)`, F.linear(x.to(W.dtype), W, b) for a float32 W and bf16/fp16 x (Kimi-Linear's float32
  router on the hidden states): one kernel reads x as it is and W in float32 (the elementwise forms convert both to
  float32 anyway), and writes float32, so neither the cast of x nor cuBLAS's float32 GEMV runs; 9 to 16 rows (the
  tl.dot form, which takes one dtype) keep the cast and cuBLAS.
The step's norms need no routing here: with no gradient wanted `block_ops.rms_norm` and `ops.gated_rms_norm` run as
this package's Triton kernels wherever they are called (`inference_norm`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_variadic

from .block_ops import silu_and_mul
from .gemv_forms import FEW_ROWS, MAX_ROWS, WIDEST_OUTPUTS, form, within_width  # noqa: F401 (re-exported)
from .ops import causal_conv1d_step
from .tensor_parallel_heads import device_mesh
from .triton_loading import has_bf16_tensor_cores, kernel_result, triton_kernel

GEMV_DTYPES = (torch.bfloat16, torch.float16)
WIDENED_DTYPE = torch.float32  # the weight dtype of `linear_widened`'s products the kernel takes
GEMV_DEVICE_TYPES = ("cuda",)  # tests add "cpu", with the kernel stood in
# where a GEMV runs the convolution's decoding step in its epilogue (`linear_conv_step`; emptied: the step's own kernel
# after the GEMV, `benchmarks/profile_decode_step.py --ab conv`)
CONV_STEP_DEVICE_TYPES = ("cuda", "cpu")
INDEX_DTYPES = (torch.int32, torch.int64)


@triton_kernel
def triton_gemv_kernel():
    """`kernels_gemv_triton.triton_gemv`, or None where triton cannot be imported (CPU machines)."""
    from .kernels_gemv_triton import triton_gemv

    return triton_gemv


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 rows: torch.Tensor | None = None, paired: bool = False, widened: bool = False) -> bool:
    """Whether F.linear(x, weight, bias)[..., rows] (the SwiGLU of its (gate, up) pairs when `paired`; with
    `widened`, `linear_widened`'s product, weight and bias float32) may run as the Triton GEMV (the conditions of the
    module docstring)."""
    if x.device.type not in GEMV_DEVICE_TYPES or x.dtype not in GEMV_DTYPES:
        return False
    if weight.dtype != (WIDENED_DTYPE if widened else x.dtype):
        return False
    if weight.dim() != 2 or weight.device != x.device or x.shape[-1] != weight.shape[1]:
        return False
    rows_of_x = x.numel() // max(x.shape[-1], 1)
    if rows_of_x > MAX_ROWS or x.stride(-1) != 1 or weight.stride(1) != 1:
        return False
    if widened and (rows is not None or paired or form(rows_of_x, weight.shape[0]) == "rows"):
        return False  # (tl.dot takes one dtype)
    if paired and (rows is None or rows.shape[0] % 2):
        return False
    if rows is not None and (rows.dtype not in INDEX_DTYPES or rows.dim() != 1 or rows.device != x.device
                             or rows.stride(0) != 1):
        return False
    if not within_width(weight.shape[0] if rows is None else rows.shape[0], rows_of_x, rows is not None, paired):
        return False
    if bias is not None and (bias.dtype != weight.dtype or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if device_mesh(weight) is not None or device_mesh(x) is not None:
        return False
    return triton_gemv_kernel() is not None and has_bf16_tensor_cores(x.device)


_FAILED: dict = {}  # (weight shape, dtype, device, gathered, paired) -> the first error: cuBLAS from then on


def torch_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      rows: torch.Tensor | None) -> torch.Tensor:
    """`linear_rows` without the Triton GEMV: F.linear (cuBLAS), the gather of `rows` as a kernel of its own."""
    out = F.linear(x, weight, bias)
    return out if rows is None else out.index_select(-1, rows)


def torch_linear_widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear_widened` without the Triton GEMV: x cast to the weight's dtype (a kernel of its own), then F.linear."""
    return F.linear(x.to(weight.dtype), weight, bias)


def torch_linear_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear_swiglu` without the Triton GEMV: F.linear (cuBLAS), then SwiGLU's own kernel."""
    return silu_and_mul(*F.linear(x, weight, bias).chunk(2, dim=-1))


def torch_linear_conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           rows: torch.Tensor | None, conv_weight: torch.Tensor,
                           window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_conv_step` without the Triton GEMV: `torch_linear_rows`, then the convolution's step on its first
    columns (`ops.causal_conv1d_step`: fla's kernel or torch)."""
    return convolve_first(torch_linear_rows(x, weight, bias, rows), conv_weight, window)


def convolve_first(out: torch.Tensor, conv_weight: torch.Tensor,
                    window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the convolution's step on out's first C columns, `window` updated in place; the other columns)."""
    channels = conv_weight.shape[0]
    return causal_conv1d_step(out[..., :channels], conv_weight, window, activation="silu"), out[..., channels:]


MAX_CONV_TAPS = 16  # widest convolution kernel the epilogue holds (every row's window is in registers)


def conv_step_applies(x: torch.Tensor, taps: torch.Tensor, window: torch.Tensor, outputs: int) -> bool:
    """Whether the GEMV's epilogue may run the convolution's step: kernels [C, KW] (KW <= MAX_CONV_TAPS) and window
    [rows of x, C, KW] contiguous on x's device, C within the product's `outputs`, no gradient wanted."""
    rows_of_x = x.numel() // max(x.shape[-1], 1)
    return (taps.dim() == 2 and 0 < taps.shape[0] <= outputs and 0 < taps.shape[1] <= MAX_CONV_TAPS
            and taps.is_contiguous() and taps.device == x.device
            and window.shape == (rows_of_x, *taps.shape) and window.is_contiguous() and window.device == x.device
            and window.dtype.is_floating_point and taps.dtype.is_floating_point
            and not (torch.is_grad_enabled() and (window.requires_grad or taps.requires_grad)))


def decode_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None, paired: bool = False) -> torch.Tensor:
    """F.linear(input, weight, bias) (its outputs `rows` when given), or with `paired` `linear_swiglu`'s result
    (`rows` then None: the kernel reads the stacked weight in `swiglu_pair_rows` order), through the Triton GEMV where
    `gemv_applies`. Arguments named as F.linear's, so the mode passes a call's positional and keyword arguments
    through as they are."""
    if paired:
        pairs = swiglu_pair_rows(weight.shape[0] // 2, weight.device) if weight.shape[0] % 2 == 0 else None
        out = _gemv(input, weight, bias, pairs, paired=True)
        return out if out is not None else torch_linear_swiglu(input, weight, bias)
    out = _gemv(input, weight, bias, rows)
    return out if out is not None else torch_linear_rows(input, weight, bias, rows)


def decode_linear_widened(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_widened`'s result through the Triton GEMV where `gemv_applies` (widened), else the cast and F.linear."""
    out = _gemv(input, weight, bias, None, widened=True)
    return out if out is not None else torch_linear_widened(input, weight, bias)


def decode_linear_conv_step(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            rows: torch.Tensor | None, conv_weight: torch.Tensor,
                            window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_conv_step`'s result: one Triton GEMV with the convolution's step in its epilogue where
    `conv_step_applies` (and `CONV_STEP_DEVICE_TYPES` allows it), else the projection (`decode_linear`) and then the
    step's own kernel (`ops.causal_conv1d_step`)."""
    taps = conv_weight.reshape(conv_weight.shape[0], -1)  # [C, KW]
    channels, outputs = taps.shape[0], weight.shape[0] if rows is None else rows.shape[0]
    if input.device.type in CONV_STEP_DEVICE_TYPES and conv_step_applies(input, taps, window, outputs):
        out = _gemv(input, weight, bias, rows, convolution=(taps, window))
        if out is not None:
            return out[..., :channels], out[..., channels:]
    return convolve_first(decode_linear(input, weight, bias, rows), conv_weight, window)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor | None,
          paired: bool = False, convolution: tuple[torch.Tensor, torch.Tensor] | None = None,
          widened: bool = False) -> torch.Tensor | None:
    """The Triton GEMV's output [..., outputs] where `gemv_applies`, else None (the caller's torch path runs). A
    kernel that fails (a GPU or triton it cannot compile for) is not tried again for that shape, and one warning says
    so: the step is still captured, with cuBLAS (the first try happens in the warm-up before a capture, never inside
    it)."""
    if not gemv_applies(x, weight, bias, rows, paired, widened):
        return None
    key = (tuple(weight.shape), x.dtype, weight.dtype, x.device, rows is not None, paired,
           tuple(convolution[0].shape) if convolution is not None else None)
    flat = x.reshape(-1, x.shape[-1])  # a view for a decoding step's inputs (the kernel takes any row stride)
    options = ({"swiglu_pairs": True} if paired else {"convolution": convolution} if convolution is not None
               else {"out_dtype": weight.dtype} if widened else {})
    fallback = ("that product runs without the convolution's step in it (the step's own kernel follows)"
                if convolution is not None else "that product runs through cuBLAS")
    out = kernel_result(_FAILED, key, x, f"the Triton GEMV failed for a {tuple(weight.shape)} {x.dtype} weight; "
                        f"{fallback}", lambda: triton_gemv_kernel()(flat, weight, bias, rows, **options))
    return out.view(*x.shape[:-1], out.shape[-1]) if out is not None else None


def linear_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(input, weight, bias).index_select(-1, rows): the outputs `rows` (int32/int64, 1-D), in that order.
    Inside `DecodeGemvMode` one GEMV kernel reads the weight rows in that order (see the module docstring); it reads
    `rows`, like the weight, before the kernel ahead of it has finished (kernels_launch_triton), so neither may be
    written inside the captured step (index rows made once, before the capture)."""
    if has_torch_function_variadic(input, weight, bias, rows):
        return handle_torch_function(linear_rows, (input, weight, bias, rows), input, weight, bias=bias, rows=rows)
    return torch_linear_rows(input, weight, bias, rows)


def swiglu_pair_rows(width: int, device: torch.device) -> torch.Tensor:
    """[0, width, 1, width + 1, ...]: the rows of a [gate; up] stacked weight (each `width` rows) in (gate_j, up_j)
    pairs (kept per width and device: made once, in the warm-up before a capture)."""
    key = (width, device)
    if key not in _PAIR_ROWS:
        _PAIR_ROWS[key] = torch.arange(2 * width, device=device).view(2, width).T.reshape(-1)
    return _PAIR_ROWS[key]


_PAIR_ROWS: dict = {}


def linear_swiglu(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = F.linear(input, weight, bias), weight = [W_gate; W_up] (the gated MLP's gate
    and up projections stacked by rows): [..., weight rows / 2]. Inside `DecodeGemvMode` one GEMV kernel reads the
    weight rows in (gate_j, up_j) pairs (`swiglu_pair_rows`) and stores each pair's SwiGLU: neither the [gate | up]
    output nor SwiGLU's own kernel (see the module docstring)."""
    if has_torch_function_variadic(input, weight, bias):
        return handle_torch_function(linear_swiglu, (input, weight, bias), input, weight, bias=bias)
    return torch_linear_swiglu(input, weight, bias)


def linear_widened(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(input.to(weight.dtype), weight, bias): the product in its weight's wider dtype (a float32 router on
    bf16 hidden states). Inside `DecodeGemvMode` one GEMV kernel reads the input as it is and writes the weight's dtype:
    no cast of the input before it (see the module docstring)."""
    if has_torch_function_variadic(input, weight, bias):
        return handle_torch_function(linear_widened, (input, weight, bias), input, weight, bias=bias)
    return torch_linear_widened(input, weight, bias)


def linear_conv_step(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor | None,
                     conv_weight: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's input projection and its short convolution: out = `linear_rows(input, weight, bias, rows)`
    (input [B, 1, K]), then (silu(causal_conv1d_step(out[..., :C], conv_weight, window)), out[..., C:]), C the
    convolution's channels (conv_weight [C, KW] or [C, 1, KW]), `window` [B, C, KW] updated in place
    (`ops.causal_conv1d_step`). Inside `DecodeGemvMode` one GEMV kernel runs the convolution's step in its epilogue on
    the products it has just summed: no kernel of its own for the convolution (see the module docstring)."""
    tensors = (input, weight, bias, rows, conv_weight, window)
    if has_torch_function_variadic(*tensors):
        return handle_torch_function(linear_conv_step, tensors, *tensors)
    return torch_linear_conv_step(*tensors)


class DecodeGemvMode(TorchFunctionMode):
    """Sends the F.linear, `linear_rows` and `linear_swiglu` calls made while it is active through `decode_linear`,
    `linear_conv_step` through `decode_linear_conv_step`, `linear_widened` through `decode_linear_widened`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or func is linear_rows:  # F.linear's own signature: (input, weight, bias=None), + rows
            return decode_linear(*args, **kwargs)
        if func is linear_conv_step:
            return decode_linear_conv_step(*args, **kwargs)
        if func is linear_swiglu:
            return decode_linear(*args, **kwargs, paired=True)
        if func is linear_widened:
            return decode_linear_widened(*args, **kwargs)
        return func(*args, **kwargs)


def decode_gemv_mode(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a decoding step is recorded in: `DecodeGemvMode` on CUDA with triton importable, else nothing."""
    if device.type not in GEMV_DEVICE_TYPES or triton_gemv_kernel() is None:
        return contextlib.nullcontext()
    return DecodeGemvMode()

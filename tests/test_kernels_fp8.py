"""The block-scaled FP8 linear layers' Triton kernels (kernels_fp8_triton) and their dispatch (kernels_fp8): each form
against float64, the dequantized weight bit for bit against the reference's, the experts' grouped product with empty
experts and experts of several tiles, the dispatch's reshapes and fallbacks, bad input refused in one line, and
(slow, with triton's NVIDIA backend, no GPU needed) every autotuning configuration compiled for an H200 without
spilling (`fp8_kernel_compile.py`).

The kernel tests run on a GPU, or on a CPU through triton's interpreter (`TRITON_INTERPRET=1` with triton on the
path: `PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 pytest tests/test_kernels_fp8.py`), at tiny shapes with
32 x 32 blocks and partial last blocks; the interpreter has no bfloat16 arithmetic, so bf16 runs only on a GPU. They
carry the `gpu` mark too, so a GPU run of `-m gpu` takes them with `test_gpu_*` (Qwen3-Next's shapes, 128 x 128
blocks, the experts captured in a CUDA graph).

Tolerances, from the float64 product of the exact real weight W = W_fp8 * scale_inv (an e4m3 value times a float32
scale is exact in float64), with S = sum_k |x_k W_k| (+ |b|) per output:
- float32 sums of K exact products (bf16/fp16 x times the e4m3 value, or fp32 products), each scaled once more in
  float32: at most (K + 2) 2^-23 S (one unit in the last place per operation, not half: tensor cores may truncate
  their float32 sums rather than round them);
- the output rounded once to x's dtype: u (|y| + the sums' bound), u its unit roundoff (fp32 2^-24, fp16 2^-11,
  bf16 2^-8);
- "dequantized_dot" rounds W to x's dtype as the reference does, so it is compared with the float64 product of the
  reference's rounded weight (`dequantize_block_fp8(..., x.dtype)`), with the same bound, and that weight is checked
  bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_helpers import runs_triton_kernels

from hybrid_linear_models import kernels_fp8
from hybrid_linear_models.kernels_fp8 import (
    block_fp8_grouped_linear,
    block_fp8_linear,
    block_fp8_routed_linear,
    block_fp8_swiglu_linear,
    dequantize_block_fp8,
    triton_applies,
)

UNIT = {torch.float32: 2 ** -24, torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(out: int, inp: int, block: tuple[int, int], experts: int | None = None, seed: int = 0):
    """An e4m3 weight spanning e4m3's range (±448 and subnormals) and float32 scales of unit-size outputs."""
    g = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    w = (torch.randn(*lead, out, inp, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (-(-out // block[0]), -(-inp // block[1]))
    scale = (torch.rand(*lead, *blocks, generator=g) + 0.5) / (64 * inp ** 0.5)
    return w.to(DEVICE), scale.to(DEVICE)


def _x(rows: int, inp: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _reference_weight(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
    """The reference's weight (`dequantize_block_fp8`) on w's device, rounded to bf16/fp16 on the CPU as the converter
    rounds it (float64 is exact wherever it is computed)."""
    if dtype == torch.float64:
        return dequantize_block_fp8(w, scale, block, dtype)
    return dequantize_block_fp8(w.cpu(), scale.cpu(), block, dtype).to(w.device)


def _assert_within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, what: str):
    """got against x @ w.T (+ bias) in float64 (w the weight the form multiplies), the module docstring's bound."""
    exact = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    sizes = x.double().abs() @ w.double().abs().T + (bias.double().abs() if bias is not None else 0)
    summed = (x.shape[-1] + 2) * 2 ** -23 * sizes
    bound = summed + UNIT[x.dtype] * (exact.abs() + summed)
    assert got.dtype == x.dtype and got.shape == exact.shape, what
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"{what}: off by {excess.max().item():.3g} beyond the bound"


def _skip_bf16_on_interpreter(dtype: torch.dtype):
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")


@runs_triton_kernels
@pytest.mark.parametrize("form", ["scaled_dot", "fp8_dot", "dequantized_dot", "one_row"])
@pytest.mark.parametrize("bk", [16, 48, 128, 256])
def test_autotuning_only_tries_slices_within_one_block_column(form, bk):
    """Whatever the block's columns, the configurations the autotuner may pick for a form fit it (`_fits`): a
    scaled_dot or fp8_dot slice of BLOCK_K columns never spans two block columns (one scale per slice), also where
    the listed slices are all wider than the block (16 or 48 columns)."""
    from hybrid_linear_models.kernels_fp8_triton import (
        _CONFIGS,
        FORMS,
        _autotuned,
        _fits,
        _pruned,
    )

    configs = _autotuned(form).configs
    assert len(configs) == len(_CONFIGS[form])
    picked = _pruned(configs, {"FORM": FORMS.index(form), "BK": bk})
    assert picked and all(_fits(form, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], bk) for c in picked)
    assert all(c.kwargs["BLOCK_K"] >= 16 for c in picked)  # (tl.dot's smallest K)


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form, rows, config", [
    ("one_row", 1, (4, 16)), ("one_row", 1, (16, 64)),  # a slice within one block / over two block columns
    ("one_row", 1, (64, 16)),  # BLOCK_N not dividing the block's rows: per-element scales
    ("scaled_dot", 5, (16, 16)), ("scaled_dot", 16, (32, 32)),
    ("dequantized_dot", 40, (16, 16)), ("dequantized_dot", 40, (32, 64)),  # slices over two block columns
])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [(32, 32), (16, 32)])
def test_each_form_against_float64(dtype, form, rows, config, bias, block):
    """out 70 and in 100 in 32 x 32 and 16 x 32 blocks: partial last blocks both ways; configurations whose BLOCK_N
    does and does not divide the block's rows, slices within one block column and across two."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import fp8_linear

    w, scale = _weight(70, 100, block)
    x = _x(rows, 100, dtype)
    b = torch.randn(70, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype) if bias else None
    got = fp8_linear(x, w, scale, block, b, form=form, config=config)
    weight = _reference_weight(w, scale, block, dtype if form == "dequantized_dot" else torch.float64)
    _assert_within(got, x, weight, b, f"{form} {config}")


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_the_dequantized_weight_is_the_references_bit_for_bit(dtype):
    """x = the identity: each output is one weight times 1, so "dequantized_dot" returns its weight, which must be the
    reference's (float32's product w * s rounded to the dtype) in every element, whichever way the slices meet the
    block columns. (A weight computed in the dtype, scale rounded first, differs in about one element in seven.)"""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import fp8_linear

    block = (32, 32)
    w, scale = _weight(72, 100, block, seed=5)
    expected = _reference_weight(w, scale, block, dtype)
    eye = torch.eye(100, dtype=dtype, device=DEVICE)
    for config in ((16, 16), (16, 64)):  # a slice within a block column, one across two (per-element scales)
        got = fp8_linear(eye, w, scale, block, form="dequantized_dot", config=config)
        assert torch.equal(got.T, expected), config


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(16, 48), (16, 40)])
def test_dequantize_then_linear_is_the_reference(dtype, block):
    """`dequantize` returns the reference's weight bit for bit (partial blocks both ways; tiles within one block column,
    and across block columns of 40), and the "dequantize_then_linear" form is F.linear on it: the reference's product,
    bit for bit."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import dequantize, fp8_linear

    w, scale = _weight(70, 100, block, seed=10)
    expected = _reference_weight(w, scale, block, dtype)
    assert torch.equal(dequantize(w, scale, block, dtype), expected)
    x = _x(20, 100, dtype)
    b = torch.randn(70, generator=torch.Generator().manual_seed(11)).to(DEVICE, dtype)
    got = fp8_linear(x, w, scale, block, b, prefill="dequantize_then_linear")
    assert torch.equal(got, F.linear(x, expected, b))


@runs_triton_kernels
def test_a_prefill_form_is_checked_by_name():
    from hybrid_linear_models.kernels_fp8_triton import linear_form

    assert [linear_form(rows, 128) for rows in (1, 16, 17)] == ["one_row", "scaled_dot", "dequantized_dot"]
    assert linear_form(17, 128, "fp8_dot") == "fp8_dot" and linear_form(17, 48, "fp8_dot") == "dequantized_dot"
    with pytest.raises(ValueError, match="FP8 prefill form 'fp16_dot': expected one of dequantized_dot, fp8_dot"):
        linear_form(17, 128, "fp16_dot")


def _quantized_reference(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] per row and `bk` columns in e4m3, by torch: scale = max |x| / 448 in float32 (1 for a zero group),
    q = x / scale (float32) rounded to e4m3 by torch's conversion."""
    rows, inp = x.shape
    groups = -(-inp // bk)
    padded = F.pad(x.float(), (0, groups * bk - inp)).view(rows, groups, bk)
    largest = padded.abs().amax(-1)
    scale = torch.where(largest > 0, largest / 448.0, torch.ones_like(largest))
    q = (padded / scale[..., None]).to(torch.float8_e4m3fn).view(rows, groups * bk)[:, :inp]
    return q.contiguous(), scale


def test_the_activation_quantization_bound():
    """The bound `fp8_dot`'s docstring derives, on torch's quantization of wide-ranging rows: |q s - x| <= 2^-4 |x|
    (e4m3's 3 fraction bits, normal range) + 2^-10 s (half its subnormal spacing 2^-9, times the scale), plus x /
    scale's float32 rounding (2^-24 relative, carried by the same factors)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-6, 3, 300)[torch.randperm(300, generator=g)]
    q, scale = _quantized_reference(x, 128)
    per_column = scale.repeat_interleave(128, 1)[:, :300].double()
    error = (q.double() * per_column - x.double()).abs()
    bound = (2 ** -4 * x.double().abs() + 2 ** -10 * per_column) * (1 + 2 ** -20)
    assert (error <= bound).all()
    assert (q.float().abs() <= 448).all() and q.float().abs().amax() == 448


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, block", [(40, (32, 32)), (17, (16, 64))])
def test_fp8_dot_against_float64(dtype, rows, block, monkeypatch):
    """`fp8_dot` (PREFILL_FORM "fp8_dot"): x quantized per row and block column (`quantize_activations`: on a GPU bit
    for bit torch's `_quantized_reference`; triton's interpreter drops the carry of a float32 -> e4m3 rounding into the
    exponent (126.8 -> 64), so there the test's quantization stands in for the kernel's), then FP8 tensor cores. The
    product against the float64 one of the quantized x (q s) and the real weight: each BLOCK_K slice summed by the
    FP8 tensor cores (Hopper keeps about 14 significant bits of those sums, DeepSeek-V3 3.3.2: at most 128 2^-13 =
    2^-6 of the slice's sum of |terms|), scaled and added in float32 ((K + 2) 2^-23 S), rounded to the dtype."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models import kernels_fp8_triton
    from hybrid_linear_models.kernels_fp8_triton import fp8_linear, quantize_activations

    w, scale = _weight(70, 100, block)
    x = _x(rows, 100, dtype)
    q, x_scale = _quantized_reference(x.cpu(), block[1])
    if torch.cuda.is_available():
        got_q, got_scale = quantize_activations(x, block[1])
        assert torch.equal(got_q.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_scale.cpu(), x_scale)
    else:
        monkeypatch.setattr(kernels_fp8_triton, "quantize_activations", lambda x, bk: _quantized_reference(x, bk))
    got = fp8_linear(x, w, scale, block, form="fp8_dot", config=(16, 32))
    quantized = (q.double() * x_scale.double().repeat_interleave(block[1], 1)[:, :100]).to(DEVICE)
    weight = dequantize_block_fp8(w, scale, block, torch.float64)
    exact = quantized @ weight.T
    summed = (2 ** -6 + (100 + 2) * 2 ** -23) * (quantized.abs() @ weight.abs().T)
    bound = summed + UNIT[dtype] * (exact.abs() + summed)
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= bound).all()


def _routing(counts: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(DEVICE, dtype)


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["scaled_dot", "dequantized_dot"])
@pytest.mark.parametrize("counts", [[0, 3, 0, 1, 2, 0], [0, 35, 0, 5], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0]],
                         ids=["empty-first-and-last", "several-tiles", "one-each", "all-empty"])
def test_grouped_against_float64(dtype, form, counts):
    """Each expert's rows against its weight (float64, 32 x 16 blocks), whichever tile and program serves them; empty
    experts (first, last, all) get no rows; an expert of 35 rows spans three 16-row tiles; two rows past offsets[-1]
    belong to no expert; int32 and int64 offsets."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import fp8_grouped_linear

    block = (32, 16)
    experts, total = len(counts), sum(counts)
    w, scale = _weight(40, 72, block, experts=experts, seed=3)
    x = _x(total + 2, 72, dtype, seed=4)  # two rows past the last expert's
    for offsets_dtype in (torch.int32, torch.int64):
        got = fp8_grouped_linear(x, w, scale, _routing(counts, offsets_dtype), block, form=form, config=(16, 16))
        assert got.shape == (total + 2, 40)
        start = 0
        for expert, count in enumerate(counts):
            rounded = dtype if form == "dequantized_dot" else torch.float64
            weight = _reference_weight(w[expert], scale[expert], block, rounded)
            _assert_within(got[start:start + count], x[start:start + count], weight, None, f"expert {expert}")
            start += count


@pytest.mark.gpu
@runs_triton_kernels
def test_grouped_offsets_past_the_rows_stay_within_them():
    """offsets ending past S (a caller's bad routing) read and write no row beyond x's: the rows there are computed as
    the reference's slices compute them (expert 1's rows 3:5 of 5, its offsets saying 3:9)."""
    _skip_bf16_on_interpreter(torch.float16)
    from hybrid_linear_models.kernels_fp8_triton import fp8_grouped_linear

    block = (32, 32)
    w, scale = _weight(40, 64, block, experts=2, seed=8)
    x = _x(5, 64, torch.float16, seed=9)
    got = fp8_grouped_linear(x, w, scale, torch.tensor([3, 9], device=DEVICE), block, form="scaled_dot",
                             config=(16, 16))
    for expert, (start, end) in enumerate([(0, 3), (3, 5)]):
        weight = _reference_weight(w[expert], scale[expert], block, torch.float64)
        _assert_within(got[start:end], x[start:end], weight, None, f"expert {expert}")


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inp", [129, 200, 256, 300])
@pytest.mark.parametrize("config", [(4, 16), (64, 16)])  # one scale a slice; per-element scales
def test_one_row_over_several_chunks_of_slices(dtype, inp, config):
    """one_row unrolls its K slices in chunks of UNROLLED_SLICES (8): with 16-column slices, K of 129, 200, 256 and
    300 takes the first chunk, then 1 to 2 more, the last of them full or partly (or, at 129, all but one slice)
    past K; dense and routed (each route's gated input) against float64, with the bounds above."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import (
        UNROLLED_SLICES,
        fp8_linear,
        fp8_routed_linear,
    )

    assert inp > UNROLLED_SLICES * config[1]
    block = (32, 32)
    w, scale = _weight(70, inp, block, seed=inp)
    x = _x(1, inp, dtype, seed=inp + 1)
    got = fp8_linear(x, w, scale, block, None, form="one_row", config=config)
    _assert_within(got, x, _reference_weight(w, scale, block, torch.float64), None, f"dense K {inp} {config}")

    experts, scales = _weight(40, inp, block, experts=3, seed=inp + 2)
    gate_up = _x(2, 2 * inp, dtype, seed=inp + 3)
    routes = torch.tensor([2, 0], device=DEVICE)
    route_weights = torch.rand(2, generator=torch.Generator().manual_seed(inp)).to(DEVICE, dtype)
    got = fp8_routed_linear(gate_up, experts, scales, routes, block, config=config[:1] + (16,),
                            gated_by=route_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    gated = (F.silu(gate) * up * route_weights[:, None]).double()
    for route, expert in enumerate(routes.tolist()):
        weight = _reference_weight(experts[expert], scales[expert], block, torch.float64)
        exact = gated[route:route + 1] @ weight.T
        sizes = gated[route:route + 1].abs() @ weight.abs().T
        summed = (inp + 2) * 2 ** -23 * sizes
        bound = summed + UNIT[dtype] * (exact.abs() + summed) + 2 * UNIT[dtype] * sizes
        assert ((got[route:route + 1].double() - exact).abs() <= bound).all(), f"route {route}, K {inp} {config}"


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("inp, config", [(9 * 32, (4, 32)), (9 * 32 + 5, (4, 32)), (17 * 16, (4, 16))])
def test_one_row_reads_no_scale_past_its_tensor(inp, config):
    """K slices past a whole number of chunks (9 slices: a chunk of 8, then 1) read only scale columns that exist:
    the scales sit in a buffer followed by NaN, and the products stay finite and within the float64 bound (dense,
    and routed with gated inputs)."""
    from hybrid_linear_models.kernels_fp8_triton import fp8_linear, fp8_routed_linear

    block = (32, 32)

    def poisoned(scale: torch.Tensor) -> torch.Tensor:
        buffer = torch.full((scale.numel() + 64,), float("nan"), device=scale.device)
        buffer[: scale.numel()] = scale.flatten()
        return buffer[: scale.numel()].view(scale.shape)

    w, scale = _weight(8, inp, block, seed=inp)
    x = _x(1, inp, torch.float32, seed=inp + 1)
    got = fp8_linear(x, w, poisoned(scale), block, None, form="one_row", config=config)
    _assert_within(got, x, _reference_weight(w, scale, block, torch.float64), None, f"K {inp} {config}")
    experts, scales = _weight(8, inp, block, experts=2, seed=inp + 2)
    gate_up = _x(1, 2 * inp, torch.float32, seed=inp + 3)
    routed = fp8_routed_linear(gate_up, experts, poisoned(scales), torch.tensor([1], device=DEVICE), block,
                               config=config, gated_by=torch.ones(1, device=DEVICE))
    assert torch.isfinite(routed).all(), f"routed K {inp} {config}"


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routes_dtype", [torch.int32, torch.int64])
def test_routed_against_float64(dtype, routes_dtype):
    """Each route's row (row r // 3 of x, 3 routes per row) against its expert's real weight in float64 (32 x 16
    blocks, partial last blocks): an expert routed twice, experts routed by no route, and routes to experts of
    another rank (5 = E and -1), whose rows are exactly zero."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import fp8_routed_linear

    block = (32, 16)
    w, scale = _weight(40, 72, block, experts=5, seed=13)
    x = _x(4, 72, dtype, seed=14)
    routes = torch.tensor([3, 0, 3, 5, 1, 4, 2, -1, 0, 4, 4, 1], dtype=routes_dtype, device=DEVICE)
    got = fp8_routed_linear(x, w, scale, routes, block, config=(4, 16))
    assert got.shape == (12, 40)
    for route, expert in enumerate(routes.tolist()):
        if not 0 <= expert < 5:
            assert (got[route] == 0).all(), f"route {route} to expert {expert} of another rank"
            continue
        weight = _reference_weight(w[expert], scale[expert], block, torch.float64)
        _assert_within(got[route:route + 1], x[route // 3:route // 3 + 1], weight, None, f"route {route}")


@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_routed_swiglu_against_float64(dtype):
    """The routed product of gated inputs (each route's [gate | up] row read as silu(gate) * up * its weight, each op
    rounded to the dtype) against its expert's real weight in float64 times that input as torch computes it: the
    routed bound, plus one unit in the dtype's last place of each input (the kernel's exp is triton's, a fast
    approximation on a GPU). Routes to another rank's experts (5 = E and -1) give rows of zeros."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_fp8_triton import fp8_routed_linear

    block = (32, 16)
    w, scale = _weight(40, 36, block, experts=5, seed=21)
    gate_up = _x(6, 72, dtype, seed=22).mul(2)
    routes = torch.tensor([3, 0, 5, 3, 4, -1], device=DEVICE)
    route_weights = torch.rand(6, generator=torch.Generator().manual_seed(23)).to(DEVICE, dtype)
    got = fp8_routed_linear(gate_up, w, scale, routes, block, config=(4, 16), gated_by=route_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    gated = F.silu(gate) * up * route_weights[:, None]
    assert got.shape == (6, 40) and got.dtype == dtype
    for route, expert in enumerate(routes.tolist()):
        if not 0 <= expert < 5:
            assert (got[route] == 0).all(), f"route {route} to expert {expert} of another rank"
            continue
        weight = _reference_weight(w[expert], scale[expert], block, torch.float64)
        inputs = gated[route:route + 1].double()
        exact = inputs @ weight.T
        sizes = inputs.abs() @ weight.abs().T
        summed = (36 + 2) * 2 ** -23 * sizes
        bound = summed + UNIT[dtype] * (exact.abs() + summed) + 2 * UNIT[dtype] * sizes
        assert ((got[route:route + 1].double() - exact).abs() <= bound).all(), f"route {route}"


def test_the_routed_swiglu_reference_is_the_experts_ops():
    """Off the kernels (the CPU), block_fp8_routed_swiglu_linear is silu(gate) * up * weight, then the routed
    reference, exactly; malformed inputs are refused in one line."""
    from hybrid_linear_models.kernels_fp8 import block_fp8_routed_swiglu_linear

    block = (16, 16)
    w, scale = (t.cpu() for t in _weight(24, 32, block, experts=3, seed=24))
    gate_up = torch.randn(4, 64, generator=torch.Generator().manual_seed(25)).to(torch.bfloat16)
    routes, route_weights = torch.tensor([2, 0, 1, 2]), torch.rand(4).to(torch.bfloat16)
    got = block_fp8_routed_swiglu_linear(gate_up, w, scale, routes, route_weights, block)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = block_fp8_routed_linear(F.silu(gate) * up * route_weights[:, None], w, scale, routes, block)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match=r"gate_up \(4, 63\) must be \[routes, 2 \* in\]"):
        block_fp8_routed_swiglu_linear(gate_up[:, :63], w, scale, routes, route_weights, block)
    with pytest.raises(ValueError, match="one weight per route"):
        block_fp8_routed_swiglu_linear(gate_up, w, scale, routes, route_weights[:3], block)
    with pytest.raises(ValueError, match="takes 32 inputs, x has 16"):
        block_fp8_routed_swiglu_linear(gate_up[:, :32], w, scale, routes, route_weights, block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled variants are counted on CUDA")
def test_a_new_class_of_row_counts_compiles_nothing_new():
    """Triton specialises an integer argument on being 1 and on being a multiple of 16 unless told not to, and
    compiles a kernel again for each class met. The kernel's row counts only bound its rows, so after the first call
    of a form and tile, other counts (1, multiples of 16, others) run the variant compiled: a prompt of a new length
    pays no compilation."""
    from model_helpers import compiled_variants

    from hybrid_linear_models.kernels_fp8_triton import (
        _fp8_linear_kernel,
        fp8_grouped_linear,
        fp8_linear,
        fp8_routed_linear,
    )

    block = (128, 128)
    w, scale = _weight(256, 256, block, seed=21)
    experts, experts_scale = _weight(256, 256, block, experts=4, seed=22)
    calls = {  # (rows of x) -> the call; each family's rows share one form and one row tile
        "dense, tile 64": (lambda rows: fp8_linear(_x(rows, 256, torch.bfloat16), w, scale, block, config=(32, 128)),
                           (20, 32, 47, 64)),
        "grouped, tile 16": (lambda rows: fp8_grouped_linear(
            _x(rows, 256, torch.bfloat16), experts, experts_scale, _routing([rows // 2, 0, rows - rows // 2, 0],
                                                                             torch.int32), block, config=(32, 128)),
                             (9, 16, 33, 64)),
        "routed": (lambda rows: fp8_routed_linear(_x(rows, 256, torch.bfloat16), experts, experts_scale,
                                                  torch.arange(rows * 2, device=DEVICE, dtype=torch.int32) % 4, block,
                                                  config=(32, 128)),
                   (1, 3, 8, 16)),
    }
    for family, (call, row_counts) in calls.items():
        call(row_counts[0])
        torch.cuda.synchronize()
        compiled = compiled_variants(_fp8_linear_kernel)
        for rows in row_counts[1:]:
            call(rows)
            torch.cuda.synchronize()
            assert compiled_variants(_fp8_linear_kernel) == compiled, f"{family}: {rows} rows compiled again"


def test_the_routed_reference_is_each_routes_linear():
    """On the CPU (no kernel), block_fp8_routed_linear is F.linear of each route's row on its expert's dequantized
    weight, bit for bit, and a route outside the experts is a row of zeros."""
    block = (32, 32)
    w, scale = _weight(40, 64, block, experts=3, seed=15)
    w, scale = w.cpu(), scale.cpu()
    x = torch.randn(2, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(16))
    routes = torch.tensor([2, 0, 3, 2])
    got = block_fp8_routed_linear(x, w, scale, routes, block)
    for route, expert in enumerate(routes.tolist()):
        expected = (F.linear(x[route // 2], dequantize_block_fp8(w[expert], scale[expert], block, torch.bfloat16))
                    if expert < 3 else torch.zeros(40, dtype=torch.bfloat16))
        assert torch.equal(got[route], expected), route


@pytest.fixture
def on_the_cpu(monkeypatch):
    """The dispatch taking CPU tensors to the kernels (run by triton's interpreter), with its failure record empty."""
    monkeypatch.setattr(kernels_fp8, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_fp8, "SWIGLU_INPUT_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_fp8, "_FAILED", {})


@runs_triton_kernels
def test_the_dispatch_runs_the_kernel_on_any_layout_of_x(on_the_cpu, monkeypatch):
    """1-D, 3-D and non-contiguous x go through the kernel (not the reference) and come back in x's shape."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU dispatch through triton's interpreter")
    block = (32, 32)
    w, scale = _weight(40, 64, block)
    calls = []
    from hybrid_linear_models.kernels_fp8_triton import fp8_linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fp8_linear(*args, **kwargs)

    monkeypatch.setattr(kernels_fp8, "fp8_linear_kernel", lambda: counted)
    wide = _x(3, 128, torch.float16).view(3, 2, 64)
    for x in (_x(1, 64, torch.float16)[0], _x(6, 64, torch.float16).view(2, 3, 64), wide[:, 1, :],
              _x(64, 2, torch.float16).T):
        got = block_fp8_linear(x, w, scale, block)
        assert got.shape == (*x.shape[:-1], 40)
        _assert_within(got.reshape(-1, 40), x.reshape(-1, 64), dequantize_block_fp8(w, scale, block, torch.float64),
                       None, str(tuple(x.shape)))
    assert calls == [(1, 64), (6, 64), (3, 64), (2, 64)]


@runs_triton_kernels
def test_a_dense_swiglu_down_projection_of_one_row_is_the_routed_kernels_one_route(on_the_cpu, monkeypatch):
    """block_fp8_swiglu_linear at one row ([1, 1, 2 in], a decoding step's MLP at batch 1): one launch of the routed
    SwiGLU kernel with the weight as its one expert, within the routed SwiGLU bound of (silu(gate) * up, torch's
    rounding) times the real weight in float64; two rows: SwiGLU apart, then the dense product, as before."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU dispatch through triton's interpreter")
    from hybrid_linear_models.kernels_fp8_triton import fp8_routed_linear

    calls = []

    def counted(*args, **kwargs):
        calls.append((tuple(args[0].shape), tuple(args[1].shape), kwargs["gated_by"].tolist()))
        return fp8_routed_linear(*args, **kwargs)

    monkeypatch.setattr(kernels_fp8, "fp8_routed_linear_kernel", lambda: counted)
    monkeypatch.setattr(kernels_fp8, "_ONE_ROUTE", {})
    block, dtype = (32, 16), torch.float16
    w, scale = _weight(40, 36, block, seed=31)
    gate_up = _x(1, 72, dtype, seed=32).mul(2)
    got = block_fp8_swiglu_linear(gate_up.view(1, 1, 72), w, scale, block)
    assert got.shape == (1, 1, 40) and got.dtype == dtype and calls == [((1, 72), (1, 40, 36), [1.0])]
    gate, up = gate_up.chunk(2, dim=-1)
    inputs = (F.silu(gate) * up).double()
    weight = _reference_weight(w, scale, block, torch.float64)
    exact, sizes = inputs @ weight.T, inputs.abs() @ weight.abs().T
    summed = (36 + 2) * 2 ** -23 * sizes
    bound = summed + UNIT[dtype] * (exact.abs() + summed) + 2 * UNIT[dtype] * sizes
    assert ((got.view(1, 40).double() - exact).abs() <= bound).all()
    two = _x(2, 72, dtype, seed=33)
    gate, up = two.chunk(2, dim=-1)
    assert torch.equal(block_fp8_swiglu_linear(two, w, scale, block),
                       block_fp8_linear(F.silu(gate) * up, w, scale, block)) and len(calls) == 1
    with pytest.raises(ValueError, match="must end in 2"):
        block_fp8_swiglu_linear(_x(1, 71, dtype), w, scale, block)


@runs_triton_kernels
def test_the_dispatch_runs_the_grouped_kernel(on_the_cpu, monkeypatch):
    """block_fp8_grouped_linear on strided rows and int64 offsets goes through the grouped kernel (not the reference's
    loop over experts) and agrees with the reference per expert."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU dispatch through triton's interpreter")
    block = (32, 32)
    w, scale = _weight(40, 64, block, experts=4, seed=6)
    calls = []
    from hybrid_linear_models.kernels_fp8_triton import fp8_grouped_linear

    def counted(*args, **kwargs):
        calls.append(args[0].is_contiguous())
        return fp8_grouped_linear(*args, **kwargs)

    monkeypatch.setattr(kernels_fp8, "fp8_grouped_linear_kernel", lambda: counted)
    rows = _x(7, 128, torch.float16)[:, ::2]  # a stride of 2 along the inputs
    got = block_fp8_grouped_linear(rows, w, scale, torch.tensor([2, 2, 6, 7]), block)
    assert calls == [True]
    for expert, (start, end) in enumerate([(0, 2), (2, 2), (2, 6), (6, 7)]):
        weight = dequantize_block_fp8(w[expert], scale[expert], block, torch.float64)
        _assert_within(got[start:end], rows[start:end], weight, None, f"expert {expert}")


@runs_triton_kernels
def test_decoding_experts_take_the_routed_kernel_and_agree_with_the_sorted_path(on_the_cpu, monkeypatch):
    """Fp8Experts with a decoding step's routes (2 tokens x top-3 of 6 experts, one route to another rank's expert)
    runs the routed kernel twice (gate+up, then down with SwiGLU in its read) and no sort; with ROUTED_MAX_ROUTES
    below its routes it runs the sorted grouped path instead. Both sum float32 products of the same real weights in
    another order (the one_row form against scaled_dot's tiles), so they agree within float32's rounding of those
    sums."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU dispatch through triton's interpreter")
    from hybrid_linear_models import fp8_layers
    from hybrid_linear_models.configuration_hybrid_linear import HybridLinearConfig
    from hybrid_linear_models.kernels_fp8_triton import fp8_routed_linear

    settings = HybridLinearConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    experts = fp8_layers.Fp8Experts(6, 32, 16, F.silu, settings.block_fp8_settings)
    for name in experts._stored:
        param = getattr(experts, name)
        if name.endswith("_scale_inv"):
            param.data.copy_(torch.rand(param.shape, generator=torch.Generator().manual_seed(17)).add(0.5) / 256)
        else:
            param.data.copy_(_weight(*param.shape[1:], (16, 16), experts=6, seed=18)[0].cpu())
    x = _x(2, 32, torch.float32, seed=19).cpu()
    top_k = torch.tensor([[4, 0, 6], [2, 4, 5]])
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(20))
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[3].tolist(), kwargs.get("gated_by") is not None))
        return fp8_routed_linear(*args, **kwargs)

    monkeypatch.setattr(kernels_fp8, "fp8_routed_linear_kernel", lambda: counted)
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(torch, "sort", None)  # (the routed path sorts nothing)
        routed = experts(x, top_k, weights)
    # (gate+up, then down reading silu(gate) * up * weight: block_fp8_routed_swiglu_linear)
    assert calls == [([4, 0, 6, 2, 4, 5], False), ([4, 0, 6, 2, 4, 5], True)]
    monkeypatch.setattr(kernels_fp8, "ROUTED_MAX_ROUTES", 5)
    with torch.no_grad():
        grouped = experts(x, top_k, weights)
    assert len(calls) == 2
    torch.testing.assert_close(routed, grouped, rtol=1e-5, atol=1e-5 * grouped.abs().max().item())


def test_the_cpu_runs_the_reference_exactly():
    block = (32, 32)
    w, scale = _weight(40, 64, block)
    w, scale = w.cpu(), scale.cpu()
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert not triton_applies(x, w, scale, None)
    expected = F.linear(x, dequantize_block_fp8(w, scale, block, torch.bfloat16))
    assert torch.equal(block_fp8_linear(x, w, scale, block), expected)


def test_the_kernel_is_not_taken_where_it_does_not_serve(on_the_cpu, monkeypatch):
    """A gradient wanted for x, a weight in another dtype, float64 x, a bias of another dtype: the reference."""
    monkeypatch.setattr(kernels_fp8, "fp8_linear_kernel", lambda: object())
    block = (32, 32)
    w, scale = _weight(40, 64, block)
    w, scale = w.cpu(), scale.cpu()
    x = torch.randn(2, 64, dtype=torch.float16)
    assert triton_applies(x, w, scale, None)
    assert not triton_applies(x.requires_grad_(), w, scale, None)
    x = x.detach()
    assert not triton_applies(x, w.to(torch.float8_e5m2), scale, None)
    assert not triton_applies(x.double(), w, scale, None)
    assert not triton_applies(x, w, scale, torch.zeros(40))
    assert triton_applies(x, w, scale, torch.zeros(40, dtype=torch.float16))


def test_a_kernel_that_fails_leaves_the_reference_with_one_warning(on_the_cpu, monkeypatch, caplog):
    tries = []

    def failing(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(kernels_fp8, "fp8_linear_kernel", lambda: failing)
    monkeypatch.setattr(kernels_fp8, "_has_e4m3", lambda device: True)
    block = (32, 32)
    w, scale = _weight(40, 64, block)
    w, scale = w.cpu(), scale.cpu()
    x = torch.randn(2, 64, dtype=torch.float16)
    expected = F.linear(x, dequantize_block_fp8(w, scale, block, torch.float16))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(block_fp8_linear(x, w, scale, block), expected)
    assert len(tries) == 1
    assert sum("FP8 Triton kernel failed" in r.message for r in caplog.records) == 1


def test_a_prefill_form_that_names_none_is_refused(on_the_cpu, monkeypatch):
    monkeypatch.setattr(kernels_fp8, "fp8_linear_kernel", lambda: object())
    monkeypatch.setattr(kernels_fp8, "PREFILL_FORM", "fp16_dot")
    w, scale = _weight(40, 64, (32, 32))
    with pytest.raises(ValueError, match="PREFILL_FORM 'fp16_dot': expected one of dequantized_dot, fp8_dot"):
        block_fp8_linear(torch.randn(2, 64, dtype=torch.float16), w.cpu(), scale.cpu(), (32, 32))


@pytest.mark.parametrize("call, message", [
    (lambda w, s, x: block_fp8_linear(x[:, :60], w, s, (32, 32)), "takes 64 inputs, x has 60"),
    (lambda w, s, x: block_fp8_linear(x, w, s[:, :1], (32, 32)), r"expected \(2, 2\), one scale per block"),
    (lambda w, s, x: block_fp8_linear(x, w, s, (32, 0)), "two positive integers"),
    (lambda w, s, x: block_fp8_linear(x, w[None], s[None], (32, 32)), "expected 2 dimensions"),
    (lambda w, s, x: block_fp8_grouped_linear(x, w, s, torch.tensor([2]), (32, 32)), "expected 3 dimensions"),
    (lambda w, s, x: block_fp8_grouped_linear(x, w[None], s[None], torch.tensor([1, 2]), (32, 32)),
     "one int32/int64 end per expert"),
    (lambda w, s, x: block_fp8_grouped_linear(x, w[None], s[None], torch.tensor([2.0]), (32, 32)),
     "one int32/int64 end per expert"),
    (lambda w, s, x: block_fp8_routed_linear(x, w, s, torch.tensor([0, 0]), (32, 32)), "expected 3 dimensions"),
    (lambda w, s, x: block_fp8_routed_linear(x, w[None], s[None], torch.tensor([0, 0, 0]), (32, 32)),
     "the same number of routes per row of x"),
    (lambda w, s, x: block_fp8_routed_linear(x, w[None], s[None], torch.tensor([[0], [0]]), (32, 32)),
     "one int32/int64 expert per route"),
    (lambda w, s, x: block_fp8_routed_linear(x, w[None], s[None], torch.tensor([0.0, 0.0]), (32, 32)),
     "one int32/int64 expert per route"),
])
def test_bad_input_is_refused_in_one_line(call, message):
    w, scale = _weight(40, 64, (32, 32))
    with pytest.raises(ValueError, match=message) as error:
        call(w.cpu(), scale.cpu(), torch.randn(2, 64))
    assert "\n" not in str(error.value)


def _ptxas() -> Path | None:
    """triton's ptxas, where triton (with its NVIDIA backend) is installed; found without importing triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() else None


SHARED_MEMORY_PER_BLOCK = 227 * 1024  # Hopper's most shared memory per block


@pytest.mark.slow
@pytest.mark.skipif(_ptxas() is None, reason="needs triton with its NVIDIA backend (ptxas)")
def test_every_configuration_compiles_for_an_h200_without_spilling():
    """tests/fp8_kernel_compile.py compiles every autotuning configuration of every form for sm_90 with no GPU (its
    own process: not triton's interpreter), the routed down projection's gated input and the decoding forms through a
    row index too: each must compile, spill nothing (no stack frame) and fit Hopper's shared memory, so the autotuner
    on an H200 has every configuration to choose from and none runs from local memory."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "fp8_kernel_compile.py")], env=environment,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert {(r["form"], r["grouped"], r["routed"], r["variant"]) for r in results} == {
        ("one_row", False, False, ""), ("one_row", False, True, ""), ("one_row", False, True, "gated"),
        ("one_row", False, False, "indexed"), ("scaled_dot", False, False, "indexed")} | {
        (form, grouped, False, "")
        for form in ("scaled_dot", "dequantized_dot", "fp8_dot") for grouped in (False, True)}
    assert [r for r in results if r["stack"] or r["shared"] > SHARED_MEMORY_PER_BLOCK] == []


# Qwen3-Next-80B-A3B's products (out, in): hidden 2048; GDN in_proj_qkvz 12288 and in_proj_ba 64 (a partial block),
# out_proj 2048 x 4096; the gated attention's q 8192 and k/v 512; an expert's gate+up 1024 x 2048 and down 2048 x 512
QWEN3_NEXT_SHAPES = [(12288, 2048), (64, 2048), (2048, 4096), (8192, 2048), (512, 2048), (2048, 512)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", QWEN3_NEXT_SHAPES, ids=[f"{o}x{i}" for o, i in QWEN3_NEXT_SHAPES])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_gpu_real_shapes(dtype, shape, rows):
    """block_fp8_linear on CUDA (the autotuned kernel of each row count's form) at Qwen3-Next's shapes with 128 x 128
    blocks, against float64 (the module docstring's bound; dequantized_dot, from 17 rows, against the reference's
    rounded weight)."""
    out, inp = shape
    block = (128, 128)
    w, scale = _weight(out, inp, block, seed=out + inp)
    x = _x(rows, inp, dtype)
    assert triton_applies(x, w, scale, None)
    with torch.no_grad():
        got = block_fp8_linear(x, w, scale, block)
    assert not kernels_fp8._FAILED
    rounded = dtype if rows > 16 else torch.float64
    _assert_within(got, x, _reference_weight(w, scale, block, rounded), None, f"{rows} rows")


def _captured(product) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """product() run once outside a capture (its kernel autotunes there), then captured in a CUDA graph: the graph and
    the output it refills."""
    with torch.no_grad():
        product()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = product()
    return graph, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_gpu_experts_captured_in_a_graph(dtype, tokens):
    """512 experts (an expert's gate+up, 1024 x 2048), top-10 routing of `tokens` tokens: block_fp8_grouped_linear
    captured once in a CUDA graph, then replayed with other routings written into the same offsets and rows (no host
    synchronization: the graph reads them on the device), each replay against float64 per expert."""
    experts, top_k, block = 512, 10, (128, 128)
    w, scale = _weight(1024, 2048, block, experts=experts, seed=11)
    g = torch.Generator().manual_seed(12)

    def routing():
        chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).flatten()
        counts = torch.bincount(chosen, minlength=experts)
        return counts, torch.randn(tokens * top_k, 2048, generator=g).to(dtype)

    counts, rows = routing()
    offsets = counts.cumsum(0).to(DEVICE, torch.int32)
    x = rows.to(DEVICE)
    graph, y = _captured(lambda: block_fp8_grouped_linear(x, w, scale, offsets, block))
    for _ in range(2):
        counts, rows = routing()
        offsets.copy_(counts.cumsum(0))
        x.copy_(rows)
        graph.replay()
        torch.cuda.synchronize()
        rounded = torch.float64 if tokens * top_k <= 16 * experts else dtype
        start = 0
        for expert in counts.nonzero().flatten().tolist():
            count = int(counts[expert])
            weight = _reference_weight(w[expert], scale[expert], block, rounded)
            _assert_within(y[start:start + count], x[start:start + count], weight, None, f"expert {expert}")
            start += count


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 6])
def test_gpu_routed_experts_captured_in_a_graph(tokens):
    """Qwen3-Next's experts (512, an expert's gate+up 1024 x 2048, top-10) for a decoding step's `tokens` tokens:
    block_fp8_routed_linear captured once in a CUDA graph, then replayed with other routes and rows written into the
    same tensors (the graph reads them on the device), each route's row against float64."""
    experts, top_k, block, dtype = 512, 10, (128, 128), torch.bfloat16
    w, scale = _weight(1024, 2048, block, experts=experts, seed=21)
    g = torch.Generator().manual_seed(22)

    def routing():
        chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).flatten()
        return chosen.to(DEVICE), torch.randn(tokens, 2048, generator=g).to(DEVICE, dtype)

    routes, x = routing()
    assert kernels_fp8.routed_applies(x, w, scale, routes.numel())
    graph, y = _captured(lambda: block_fp8_routed_linear(x, w, scale, routes, block))
    assert not kernels_fp8._FAILED
    for _ in range(2):
        new_routes, new_x = routing()
        routes.copy_(new_routes)
        x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        for route, expert in enumerate(routes.tolist()):
            weight = _reference_weight(w[expert], scale[expert], block, torch.float64)
            _assert_within(y[route:route + 1], x[route // top_k:route // top_k + 1], weight, None, f"route {route}")

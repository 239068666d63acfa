"""The Triton GEMV of captured decoding steps (kernels_gemv): which F.linear calls it takes, that a captured step
routes its narrow linear layers to it, and its numbers against float64 (on a GPU; on a CPU through triton's
interpreter when TRITON_INTERPRET=1 and triton are there: `TRITON_INTERPRET=1 pytest tests/test_gemv_decode.py`)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from hybrid_linear_models import kernels_gemv
from hybrid_linear_models.block_ops import silu_and_mul
from hybrid_linear_models.kernels_gemv import DecodeGemvMode, decode_linear, gemv_applies, linear_rows, swiglu_linear
from model_helpers import greedy, replay_graphs_eagerly, tiny_model


@pytest.fixture
def stand_in(monkeypatch) -> list:
    """The kernel stood in on the CPU by F.linear itself (after silu_and_mul for a gated call); returns the (rows of x,
    out, in) of each call it served, with the gathered outputs' count appended for a call given `rows` and "gated"
    for a gated one."""
    calls: list = []

    def kernel(x, weight, bias, rows=None, gated=False):
        calls.append((x.shape[0], *weight.shape) + (() if rows is None else (rows.shape[0],))
                     + (("gated",) if gated else ()))
        out = F.linear(silu_and_mul(*x.chunk(2, dim=-1)) if gated else x, weight, bias)
        return out if rows is None else out[:, rows]

    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: kernel)
    return calls


def test_applies_to_narrow_half_precision_products_of_few_rows(stand_in):
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    x = torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    assert gemv_applies(x, w, None) and gemv_applies(x, w, torch.zeros(64, dtype=torch.bfloat16))
    assert gemv_applies(x.half(), w.half(), None)
    assert not gemv_applies(x.float(), w.float(), None)  # float32 keeps cuBLAS (and its exactness tests)
    assert not gemv_applies(torch.zeros(17, 32, dtype=torch.bfloat16), w, None)  # more than 16 rows
    wide = torch.zeros(kernels_gemv.WIDEST_OUTPUTS["rows"] + 1, 32, dtype=torch.bfloat16)
    assert not gemv_applies(x, wide, None)  # wider than the limit of the form of two rows
    assert gemv_applies(x[:1], wide, None) == (kernels_gemv.WIDEST_OUTPUTS["one_row"] is None)  # one row: any width
    assert gemv_applies(x, wide, None, rows=torch.arange(wide.shape[0]))  # a gather of outputs is always folded in
    assert not gemv_applies(x, w, None, rows=torch.arange(4.0))  # a float index
    assert not gemv_applies(x, w, None, rows=torch.arange(4).view(2, 2))
    assert not gemv_applies(x, torch.zeros(32, 64, dtype=torch.bfloat16).T, None)  # strided along K
    assert not gemv_applies(x, w, torch.zeros(64))  # a float32 bias
    grad_w = w.clone().requires_grad_()
    assert not gemv_applies(x, grad_w, None)
    with torch.no_grad():
        assert gemv_applies(x, grad_w, None)


def test_the_mode_routes_f_linear_and_nothing_else(stand_in):
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    with torch.no_grad(), DecodeGemvMode():
        y = torch.nn.functional.linear(x, w)
        z = x @ w.T  # a matmul is no linear layer
        by_name = torch.nn.functional.linear(input=x, weight=w, bias=None)
    assert stand_in == [(3, 8, 16), (3, 8, 16)] and torch.equal(y, z) and torch.equal(by_name, z)
    assert decode_linear(x.reshape(3, 1, 16), w).shape == (3, 1, 8)


def test_a_kernel_that_fails_is_dropped_for_that_shape_with_one_warning(monkeypatch, caplog):
    tries = []

    def broken(x, weight, bias, rows=None, gated=False):
        tries.append(weight.shape)
        raise RuntimeError("no such instruction on this GPU")

    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: broken)
    monkeypatch.setattr(kernels_gemv, "_FAILED", {})
    x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="hybrid_linear_models.kernels_gemv"):
        for _ in range(3):
            assert torch.equal(decode_linear(x, w), F.linear(x, w))
    assert len(tries) == 1 and "runs through cuBLAS" in caplog.text and caplog.text.count("failed") == 1


def test_linear_rows_is_the_linear_layer_then_a_gather_and_the_mode_folds_the_gather_in(stand_in):
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.bfloat16) for shape in ((2, 1, 16), (10, 16), (10,)))
    index = torch.tensor([7, 0, 0, 9, 3])  # any order, repeats allowed
    expected = F.linear(x, w, b)[..., index]
    assert torch.equal(linear_rows(x, w, b, index), expected) and stand_in == []  # no mode: F.linear, index_select
    with torch.no_grad(), DecodeGemvMode():
        folded = linear_rows(x, w, bias=b, rows=index)
    assert stand_in == [(2, 10, 16, 5)] and torch.equal(folded, expected)


def test_swiglu_linear_is_the_gated_mlps_activation_then_its_down_projection(stand_in):
    g = torch.Generator().manual_seed(4)
    gate_up, w = torch.randn(1, 1, 32, generator=g, dtype=torch.bfloat16), torch.randn(8, 16, generator=g,
                                                                                        dtype=torch.bfloat16)
    expected = F.linear(silu_and_mul(gate_up[..., :16], gate_up[..., 16:]), w)
    assert torch.equal(swiglu_linear(gate_up, w), expected) and stand_in == []  # no mode
    with torch.no_grad(), DecodeGemvMode():
        fused = swiglu_linear(gate_up, w)
    assert stand_in == [(1, 8, 16, "gated")] and torch.equal(fused, expected)
    assert gemv_applies(gate_up, w, None, gated=True) and not gemv_applies(gate_up[..., :24], w, None, gated=True)
    # the tl.dot form of 2 to 16 rows leaves SwiGLU to its own kernel (kernels_gemv.SWIGLU_FORMS)
    assert not gemv_applies(gate_up.expand(2, 1, 32), w, None, gated=True) and gemv_applies(gate_up.expand(2, 1, 32)[
        ..., :16].contiguous(), w, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_captured_step_sends_its_narrow_linear_layers_to_the_kernel(stand_in, monkeypatch, dtype):
    """Every linear layer of the tiny model is narrow (within WIDEST_OUTPUTS): in bf16 each of them, the LM head
    included, runs through the kernel in the captured step (recorded once: the replays run no Python on a GPU), GDN's
    input projection with its outputs gathered in the kernel, the MLPs' down_proj with their SwiGLU; in float32 none
    does; the tokens and logits are those of
    decoding without graphs (the stand-in is F.linear)."""
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention", "mla_attention"],
                       kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8).to(dtype).eval()
    input_ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    captured = replay_graphs_eagerly(monkeypatch)
    graphed = greedy(model, input_ids, cache_implementation="static")
    assert len(captured) == 1
    vocab, hidden = model.lm_head.weight.shape
    if dtype == torch.float32:
        assert stand_in == []
    else:
        assert (1, vocab, hidden) in stand_in  # the LM head
        assert (1, hidden, model.config.intermediate_size, "gated") in stand_in  # the MLPs' SwiGLU and down_proj
        gdn = model.model.layers[0].linear_attn
        stacked = gdn.in_proj_qkvz.out_features + gdn.in_proj_ba.out_features
        assert (1, stacked, hidden, stacked) in stand_in  # in_proj_qkvz and in_proj_ba, regrouped in the kernel
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, cache_implementation="static")
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _runs_the_kernel() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not _runs_the_kernel(), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("shape", [(1, 2048, 4096), (16, 2048, 5632), (3, 576, 2048), (1, 40, 300), (2, 40, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", ["plain", "gathered", "gated"])
def test_kernel_against_float64(shape, dtype, bias, form):
    """float32 accumulation of half-precision products, then one rounding to the output dtype: within the output's
    rounding (unit roundoff u: bf16 2^-8, its 8 significant bits; fp16 2^-11) plus float32 summation error (K * 2^-24,
    at most 3.4e-4 here) of the largest |output|; both forms (one row of x: elementwise products; more: tl.dot), with
    the outputs in order, gathered through an index (reversed, a row repeated, one left out), or of SwiGLU's
    silu(gate) * up (x = [gate | up]: that input is rounded to the dtype first, as fla's SwiGLU kernel rounds its
    output, which adds u * sum_k |input_k w_nk| to the bound), each in two block configurations (fixed: autotuning
    every case would take minutes of a GPU run). (A first GPU run bounded bf16 by 2^-9, half its unit roundoff: its
    bf16 cases failed and the fp16 ones passed.)"""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_gemv_triton import triton_gemv

    rows, out, inp = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, inp * (2 if form == "gated" else 1), generator=g).to(device, dtype)
    w = (torch.randn(out, inp, generator=g) / inp ** 0.5).to(device, dtype)
    b = torch.randn(out, generator=g).to(device, dtype) if bias else None
    index = torch.cat([torch.arange(out - 1, 0, -1), torch.tensor([5])]).to(device) if form == "gathered" else None
    product_input = x.double()
    if form == "gated":
        gate, up = product_input.chunk(2, dim=-1)
        product_input = gate * torch.sigmoid(gate) * up
    expected = product_input @ w.double().T + (b.double() if bias else 0)
    if index is not None:
        expected = expected[:, index]
    unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    bound = (unit + inp * 2 ** -24) * expected.abs().max()
    if form == "gated":
        bound += (unit + inp * 2 ** -24) * (product_input.abs() @ w.double().abs().T).max()
    for blocks in ((16, 128), (4, 512) if rows == 1 else (32, 256)):  # (BLOCK_N, BLOCK_K); tl.dot needs BLOCK_N >= 16
        got = triton_gemv(x, w, b, index, blocks=blocks, gated=form == "gated")
        assert got.dtype == dtype and got.shape == expected.shape
        assert (got.double() - expected).abs().max() <= bound, blocks

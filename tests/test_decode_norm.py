"""The block RMSNorms of a captured decoding step (decode_norm): which calls the Triton kernel takes, that a captured
step routes its norms to it, and its numbers against float64 (on a GPU; on a CPU through triton's interpreter when
TRITON_INTERPRET=1 and triton are there: `TRITON_INTERPRET=1 pytest -m "gpu or not gpu"
tests/test_decode_norm.py`)."""

from __future__ import annotations


import pytest
import torch

from hybrid_linear_models import decode_norm, kernels_gemv
from hybrid_linear_models.block_ops import rms_norm
from hybrid_linear_models.decode_norm import decode_gated_norm_applies, decode_norm_applies, decode_rms_norm
from hybrid_linear_models.ops import gated_rms_norm
from hybrid_linear_models.kernels_gemv import DecodeGemvMode
from model_helpers import assert_same_generation, greedy, replay_graphs_eagerly, runs_triton_kernels, tiny_model


def stand_in_gemv(monkeypatch) -> None:
    """The mode needs the GEMV's kernel: stood in by F.linear and its gather (no epilogues: the convolution's step and
    the SwiGLU pairs keep their own kernels)."""
    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "CONV_STEP_DEVICE_TYPES", ())
    monkeypatch.setattr(kernels_gemv, "_FAILED", {})
    linear = kernels_gemv.torch_linear_rows
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: lambda x, weight, bias, rows=None: linear(
        x, weight, bias, rows))


@pytest.fixture
def stand_in(monkeypatch) -> list:
    """The kernel stood in on the CPU by block_ops.rms_norm itself; returns the (rows, width, residual?) it served."""
    calls: list = []

    def kernel(x, weight, eps, residual=None):
        calls.append((*x.shape, residual is not None))
        return rms_norm(x, weight, eps, residual=residual)

    monkeypatch.setattr(decode_norm, "NORM_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(decode_norm, "triton_rms_norm_kernel", lambda: kernel)
    return calls


def test_applies_to_contiguous_rows_with_a_matching_weight_and_residual(stand_in):
    x, w = torch.zeros(2, 1, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    assert decode_norm_applies(x, w, None) and decode_norm_applies(x, w.float(), x.clone())
    assert decode_norm_applies(x.float(), w, None) and not decode_norm_applies(x.double(), w, None)
    assert not decode_norm_applies(torch.zeros(32, 2, dtype=torch.bfloat16).T, w, None)  # strided rows
    assert not decode_norm_applies(x, torch.ones(16), None) and not decode_norm_applies(x, torch.ones(1, 32), None)
    assert not decode_norm_applies(x, w, x.float()) and not decode_norm_applies(x, w, x[:1])  # residual dtype, shape
    grad_w = w.clone().requires_grad_()
    assert not decode_norm_applies(x, grad_w, None)
    with torch.no_grad():
        assert decode_norm_applies(x, grad_w, None)


def test_the_mode_routes_rms_norm_with_and_without_a_residual(stand_in):
    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(*shape, generator=g) for shape in ((3, 1, 16), (3, 1, 16), (16,)))
    with torch.no_grad(), DecodeGemvMode():
        y = rms_norm(x, w, 1e-6)
        y2, s = rms_norm(x, w, 1e-6, residual=r)
    assert stand_in == [(3, 16, False), (3, 16, True)]  # rows flattened, as the kernel takes them
    assert torch.equal(y, rms_norm(x, w, 1e-6)) and y.shape == x.shape
    expected = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(y2, expected[0]) and torch.equal(s, expected[1]) and s.shape == x.shape


def test_a_kernel_that_fails_is_dropped_for_that_layout_with_one_warning(monkeypatch, caplog):
    tries = []

    def broken(x, weight, eps, residual=None):
        tries.append(x.shape)
        raise RuntimeError("no such instruction on this GPU")

    monkeypatch.setattr(decode_norm, "NORM_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(decode_norm, "triton_rms_norm_kernel", lambda: broken)
    monkeypatch.setattr(decode_norm, "_FAILED", {})
    x, w = torch.randn(2, 16), torch.randn(16)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert torch.equal(decode_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    assert len(tries) == 1 and "runs through fla" in caplog.text and caplog.text.count("failed") == 1


def test_a_captured_step_sends_its_block_norms_to_the_kernel(stand_in, monkeypatch):
    """The tiny model's captured step (replayed eagerly): its input, post-attention and final norms go to the kernel
    (2 a layer + 1: with the residual add but the first layer's input norm and the final one), and the tokens and
    logits are those of decoding without graphs."""
    stand_in_gemv(monkeypatch)
    layers = ["gated_deltanet", "full_attention", "kimi_delta_attention"]
    model = tiny_model(layers)
    input_ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    captured = replay_graphs_eagerly(monkeypatch)
    graphed = greedy(model, input_ids, new_tokens=4, cache_implementation="static")
    assert len(captured) == 1
    width = model.config.hidden_size
    block_norms = [call for call in stand_in if call[1] == width]
    per_step = 2 * len(layers) + 1
    assert len(block_norms) % per_step == 0 and block_norms[:per_step] == [(2, width, False)] + [
        (2, width, True)] * (2 * len(layers))
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, new_tokens=4, cache_implementation="static")
    assert_same_generation(graphed, eager, tolerance=0.0)



@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", [(1, 2048), (16, 4096), (32, 128), (3, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_against_float64(shape, dtype, residual):
    """s = x + r is exact in float32 for half-precision inputs (one rounding for float32 ones), stored rounded once
    (unit roundoff u: bf16 2^-8, fp16 2^-11, fp32 2^-24); y = s / sqrt(mean(s^2) + eps) * w: the float32 sum of squares
    is within D 2^-24 of its value, so rstd within D/2 2^-24 (+ a few roundings: sqrt, division, two products), then y
    rounded once: within (2u + (D/2 + 8) 2^-24) |y| element by element (and half the spacing of subnormals, which an
    fp16 y of a small weight can be); the weight in float32 (a zero-centred norm's 1 + w) or in the dtype."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_norm_triton import triton_rms_norm

    rows, width = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, width, generator=g).to(device, dtype)
    r = (3 * torch.randn(rows, width, generator=g)).to(device, dtype) if residual else None
    unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[dtype]
    for w in ((1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype),
              torch.randn(width, generator=g).to(device)):
        s = x.double() + (r.double() if residual else 0)
        expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        out = triton_rms_norm(x, w, 1e-6, r)
        y = out[0] if residual else out
        assert y.dtype == dtype and y.shape == x.shape
        below_normal = torch.finfo(dtype).smallest_normal * unit  # half the spacing of subnormal results
        bound = (2 * unit + (width / 2 + 8) * 2 ** -24) * expected.abs() + below_normal
        assert ((y.double() - expected).abs() <= bound).all()
        if residual:
            assert out[1].dtype == dtype and ((out[1].double() - s).abs() <= unit * s.abs()).all()



@pytest.fixture
def gated_stand_in(monkeypatch) -> list:
    """The gated norm's kernel stood in on the CPU by ops.gated_rms_norm itself (on the [outer, heads, D] views it is
    given); returns the (outer, heads, D, silu?) it served."""
    calls: list = []

    def kernel(x, gate, weight, eps, silu):
        calls.append((*x.shape, silu))
        return gated_rms_norm(x, gate, weight, eps=eps, activation="silu" if silu else "sigmoid")

    monkeypatch.setattr(decode_norm, "GATED_NORM_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(decode_norm, "triton_gated_rms_norm_kernel", lambda: kernel)
    return calls


def test_the_gated_norm_applies_to_heads_of_one_layout_and_the_mode_routes_it(gated_stand_in):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 1, 4, 16, generator=g), torch.randn(16, generator=g)
    wide = torch.randn(2, 1, 100, generator=g)  # the gate as a slice of a fused projection's output
    gate = wide[..., 20:84].unflatten(-1, (4, 16))
    assert decode_gated_norm_applies(x, gate, w, "silu") and decode_gated_norm_applies(x, gate, w, "sigmoid")
    assert not decode_gated_norm_applies(x, gate, w, "relu")
    assert not decode_gated_norm_applies(x, gate[..., :8], w, "silu")
    assert not decode_gated_norm_applies(x, gate.transpose(-1, -2).contiguous().transpose(-1, -2), w, "silu")
    assert not decode_gated_norm_applies(x.double(), gate.double(), w, "silu")
    assert not decode_gated_norm_applies(x, gate, torch.randn(2, 16)[:, 0], "silu")  # a weight of another width
    with torch.no_grad(), DecodeGemvMode():
        outs = [gated_rms_norm(x, gate, w, eps=1e-5, activation=a) for a in ("silu", "sigmoid")]
    assert gated_stand_in == [(2, 4, 16, True), (2, 4, 16, False)]
    for out, activation in zip(outs, ("silu", "sigmoid")):
        assert torch.equal(out, gated_rms_norm(x, gate, w, eps=1e-5, activation=activation)) and out.shape == x.shape


def test_a_captured_step_sends_its_output_norms_to_the_gated_kernel(gated_stand_in, monkeypatch):
    """The tiny model's captured step (replayed eagerly): each GDN and KDA layer's output norm goes to the kernel, and
    the tokens and logits are those of decoding without graphs."""
    stand_in_gemv(monkeypatch)
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention"])
    input_ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    captured = replay_graphs_eagerly(monkeypatch)
    graphed = greedy(model, input_ids, new_tokens=4, cache_implementation="static")
    assert len(captured) == 1
    gdn, kda = model.model.layers[0].linear_attn, model.model.layers[2].linear_attn
    assert gated_stand_in[:2] == [(2, gdn.num_v_heads, gdn.head_v_dim, True), (2, kda.num_heads, kda.head_dim, False)]
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, new_tokens=4, cache_implementation="static")
    assert_same_generation(graphed, eager, tolerance=0.0)


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", [(1, 32, 128), (16, 16, 128), (3, 5, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_kernel_against_float64(shape, dtype, activation):
    """y = x / sqrt(mean(x^2) + eps) * w * act(g): the float32 sum of squares within D 2^-24 of its value, so rstd
    within D/2 2^-24, a few more float32 roundings (sqrt, division, the products, sigmoid: 12 2^-24 in all), then one
    rounding (unit roundoff u), element by element (and half the spacing of subnormals); the gate read through its
    strides (a slice of a wider row, as the fused projection's output is)."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_norm_triton import triton_gated_rms_norm

    outer, heads, width = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(outer, heads, width, generator=g).to(device, dtype)
    wide = (2 * torch.randn(outer, heads * width + 7, generator=g)).to(device, dtype)
    gate = wide[:, 7:].unflatten(-1, (heads, width))
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype)
    x64, g64 = x.double(), gate.double()
    act = g64 * torch.sigmoid(g64) if activation == "silu" else torch.sigmoid(g64)
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double() * act
    y = triton_gated_rms_norm(x, gate, w, 1e-6, activation == "silu")
    assert y.dtype == dtype and y.shape == x.shape
    unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[dtype]
    bound = (unit + (width / 2 + 12) * 2 ** -24) * expected.abs() + torch.finfo(dtype).smallest_normal * unit
    assert ((y.double() - expected).abs() <= bound).all()

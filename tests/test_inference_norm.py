"""The norms of inference (inference_norm): which calls this package's Triton kernels take (no gradient wanted, CUDA;
checked on the CPU with the kernels and fla stood in), that a captured decoding step's norms reach them, and the
kernels' numbers against float64 and the torch path for any number of rows (on a GPU; on a CPU through triton's
interpreter: `PYTHONPATH=/work/tritonsite TRITON_INTERPRET=1 pytest -m "gpu or not gpu" tests/test_inference_norm.py`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from model_helpers import (
    assert_same_generation,
    greedy,
    replay_graphs_eagerly,
    runs_triton_kernels,
    tiny_model,
)

from hybrid_linear_models import fla_backend, inference_norm, kernels_gemv
from hybrid_linear_models.block_ops import rms_norm
from hybrid_linear_models.inference_norm import (
    gated_rms_norm_applies,
    l2_normalize_applies,
    rms_norm_applies,
)
from hybrid_linear_models.kernels_delta_rule import l2_normalize
from hybrid_linear_models.ops import gated_delta_rule, gated_rms_norm, kimi_delta_rule

UNIT = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}  # unit roundoff


def stand_in_gemv(monkeypatch) -> None:
    """The decoding mode needs the GEMV's kernel: stood in by F.linear and its gather (no epilogues: the convolution's
    step and the SwiGLU pairs keep their own kernels)."""
    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "CONV_STEP_DEVICE_TYPES", ())
    monkeypatch.setattr(kernels_gemv, "_FAILED", {})
    linear = kernels_gemv.torch_linear_rows
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: lambda x, weight, bias, rows=None: linear(
        x, weight, bias, rows))


def _torch_rms_norm(x, weight, eps, residual=None):
    """block_ops.rms_norm's torch path (the CPU's)."""
    if residual is not None:
        x = x + residual
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return normed if residual is None else (normed, x)


def _torch_gated_rms_norm(x, gate, weight, eps, silu):
    act = F.silu if silu else torch.sigmoid
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * act(gate.float())).to(x.dtype)


@pytest.fixture
def kernels(monkeypatch) -> dict:
    """The three kernels stood in on the CPU by torch with their math (taking the [rows, D] or [outer, heads, D]
    views the kernels take), on the CPU as if it were CUDA; returns the calls each served: (kind, shape, flag)."""
    calls: list = []

    def rms(x, weight, eps, residual=None):
        assert x.dim() == 2 and x.stride(-1) == 1
        calls.append(("rms", tuple(x.shape), residual is not None))
        return _torch_rms_norm(x, weight, eps, residual)

    def gated(x, gate, weight, eps, silu):
        assert x.dim() == 3 and x.stride(-1) == 1 and gate.stride(-1) == 1
        calls.append(("gated", tuple(x.shape), silu))
        return _torch_gated_rms_norm(x, gate, weight, eps, silu)

    def l2(x, eps):
        assert x.dim() == 3 and x.stride(-1) == 1 and eps == 1e-6
        calls.append(("l2", tuple(x.shape), None))
        return l2_normalize(x.float()).to(x.dtype)

    for switch in ("NORM_DEVICE_TYPES", "GATED_NORM_DEVICE_TYPES", "L2_NORM_DEVICE_TYPES"):
        monkeypatch.setattr(inference_norm, switch, ("cuda", "cpu"))
    monkeypatch.setattr(inference_norm, "triton_rms_norm_kernel", lambda: rms)
    monkeypatch.setattr(inference_norm, "triton_gated_rms_norm_kernel", lambda: gated)
    monkeypatch.setattr(inference_norm, "triton_l2_normalize_kernel", lambda: l2)
    monkeypatch.setattr(inference_norm, "_FAILED", {})
    return {"calls": calls}


@pytest.fixture
def fla(monkeypatch) -> list:
    """fla's norms and delta rules stood in (recording each call, then running the torch path's math) for every
    tensor, the CPU's too; returns the calls: (name, keyword arguments)."""
    calls: list = []

    def rms_norm_stand_in(x, weight, bias, residual=None, eps=1e-5, prenorm=False):
        calls.append(("rms_norm", {}))
        return _torch_rms_norm(x, weight, eps, residual)

    def rms_norm_gated_stand_in(x, g, weight, bias, activation="swish", eps=1e-6):
        calls.append(("rms_norm_gated", {}))
        return _torch_gated_rms_norm(x, g, weight, eps, activation in ("silu", "swish"))

    def delta_rule(name):
        def run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                **options):
            calls.append((name, {"q": q, "k": k, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}))
            return v.clone(), None
        return run

    fake = SimpleNamespace(rms_norm=rms_norm_stand_in, rms_norm_gated=rms_norm_gated_stand_in,
                           **{name: delta_rule(name) for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                                                  "chunk_kda", "fused_recurrent_kda")})
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: fake)
    return calls


def _norm_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, r, w = torch.randn(2, 7, 3, 16, generator=g), torch.randn(2, 7, 3, 16, generator=g), torch.randn(16, generator=g)
    gate = torch.randn(2, 7, 100, generator=g)[..., 20:68].unflatten(-1, (3, 16))  # a slice of a projection's output
    return x, r, w, gate


def test_no_grad_calls_reach_the_package_kernels_and_grad_calls_reach_fla(kernels, fla):
    x, r, w, gate = _norm_inputs()
    with torch.no_grad():
        y = rms_norm(x, w, 1e-6)
        y2, s = rms_norm(x, w, 1e-6, residual=r)
        yg = gated_rms_norm(x, gate, w, eps=1e-5, activation="sigmoid")
    assert kernels["calls"] == [("rms", (42, 16), False), ("rms", (42, 16), True), ("gated", (14, 3, 16), False)]
    assert fla == []
    assert torch.equal(y, _torch_rms_norm(x, w, 1e-6)) and y.shape == x.shape
    assert torch.equal(y2, _torch_rms_norm(x, w, 1e-6, r)[0]) and torch.equal(s, x + r) and s.shape == x.shape
    assert torch.equal(yg, _torch_gated_rms_norm(x, gate, w, 1e-5, False)) and yg.shape == x.shape
    kernels["calls"].clear()
    leaf = w.clone().requires_grad_()
    rms_norm(x, leaf, 1e-6)
    rms_norm(x, leaf, 1e-6, residual=r)
    gated_rms_norm(x, gate, leaf, eps=1e-5, activation="silu")
    assert kernels["calls"] == [] and [name for name, _ in fla] == ["rms_norm", "rms_norm", "rms_norm_gated"]
    fla.clear()
    rms_norm(x, w, 1e-6)  # grad mode on, but no input that requires a gradient: no gradient wanted
    assert kernels["calls"] == [("rms", (42, 16), False)] and fla == []


def test_cpu_calls_take_the_torch_path(monkeypatch):
    """Without the stand-ins (the CPU as it is): neither the kernels nor fla, and the torch path's numbers."""
    for loader in ("triton_rms_norm_kernel", "triton_gated_rms_norm_kernel", "triton_l2_normalize_kernel"):
        monkeypatch.setattr(inference_norm, loader, lambda: pytest.fail("a kernel was loaded for a CPU tensor"))
    monkeypatch.setattr(fla_backend, "fla_kernels", lambda: pytest.fail("fla was asked for a CPU tensor"))
    x, _, w, gate = _norm_inputs(1)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), _torch_rms_norm(x, w, 1e-6))
        assert torch.equal(gated_rms_norm(x, gate, w, activation="silu"), _torch_gated_rms_norm(x, gate, w, 1e-6, True))
        assert not rms_norm_applies(x, w, None) and not gated_rms_norm_applies(x, gate, w, "silu")
        assert not l2_normalize_applies(x)


def test_what_the_kernels_take(kernels, monkeypatch):
    x, r, w, gate = _norm_inputs(2)
    with torch.no_grad():
        assert rms_norm_applies(x, w, None) and rms_norm_applies(x, w.half(), r)
        assert rms_norm_applies(x.transpose(1, 2), w, None)  # rows of any layout (copied where they must be)
        assert not rms_norm_applies(x.double(), w, None) and not rms_norm_applies(x, w[:8], None)
        assert not rms_norm_applies(x, w.double(), None) and not rms_norm_applies(x, w[None], None)
        assert not rms_norm_applies(x, w, r.half()) and not rms_norm_applies(x, w, r[:1])  # residual dtype, shape
        assert gated_rms_norm_applies(x, gate, w, "silu") and gated_rms_norm_applies(x, gate.half(), w, "sigmoid")
        assert not gated_rms_norm_applies(x, gate, w, "relu") and not gated_rms_norm_applies(x, gate[..., :8], w, "silu")
        assert not gated_rms_norm_applies(x.double(), gate, w, "silu")
        assert l2_normalize_applies(x, gate) and not l2_normalize_applies(x, gate.double())
    with torch.enable_grad():
        assert not rms_norm_applies(x, w.clone().requires_grad_(), None)
        assert not l2_normalize_applies(x.clone().requires_grad_(), gate)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a compiled forward keeps fla's kernels
    with torch.no_grad():
        assert not rms_norm_applies(x, w, None) and not gated_rms_norm_applies(x, gate, w, "silu")
        assert not l2_normalize_applies(x)


def test_rows_of_any_layout_reach_the_kernel_as_rows(kernels):
    """Leading dimensions that do not flatten (a transposed x) are copied into rows."""
    x, r, w, gate = _norm_inputs(3)
    with torch.no_grad():
        y, s = rms_norm(x.transpose(1, 2), w, 1e-6, residual=r.transpose(1, 2))
        z = gated_rms_norm(x[:, ::2], gate[:, ::2], w, activation="silu")
    expected = _torch_rms_norm(x.transpose(1, 2), w, 1e-6, r.transpose(1, 2))
    assert torch.equal(y, expected[0]) and torch.equal(s, expected[1]) and y.shape == s.shape == (2, 3, 7, 16)
    # (float32 sums over a copy and over the strided original may be ordered differently)
    torch.testing.assert_close(z, _torch_gated_rms_norm(x[:, ::2], gate[:, ::2], w, 1e-6, True), rtol=1e-6, atol=0)
    assert z.shape == (2, 4, 3, 16)
    assert [call[0] for call in kernels["calls"]] == ["rms", "gated"]


def test_a_kernel_that_fails_is_dropped_for_that_layout_with_one_warning(monkeypatch, caplog, fla):
    tries = []

    def broken(x, weight, eps, residual=None):
        tries.append(x.shape)
        raise RuntimeError("no such instruction on this GPU")

    monkeypatch.setattr(inference_norm, "NORM_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(inference_norm, "triton_rms_norm_kernel", lambda: broken)
    monkeypatch.setattr(inference_norm, "_FAILED", {})
    x, w = torch.randn(2, 16), torch.randn(16)
    with caplog.at_level("WARNING"), torch.no_grad():
        for _ in range(3):
            assert torch.equal(rms_norm(x, w, 1e-6), _torch_rms_norm(x, w, 1e-6))
    assert len(tries) == 1 and len(fla) == 3 and "runs through fla" in caplog.text and caplog.text.count("failed") == 1


def _delta_rule_inputs(per_channel: bool, tokens: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, tokens, 2, 16, generator=g) for _ in range(2))
    v = torch.randn(1, tokens, 4, 8, generator=g)
    gate = -torch.rand(1, tokens, 4, *((16,) if per_channel else ()), generator=g)
    return q, k, v, gate, torch.rand(1, tokens, 4, generator=g)


@pytest.mark.parametrize("rule, names", [(gated_delta_rule, ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")),
                                         (kimi_delta_rule, ("chunk_kda", "fused_recurrent_kda"))])
def test_a_no_grad_prompt_normalises_q_and_k_with_the_package_kernel(kernels, fla, rule, names):
    """A prompt without gradients: q and k normalised by the package's kernel, fla's chunked kernel called with them
    and its in-kernel norm off; with gradients: fla's norm (its backward); a one-token step: fla's recurrent kernel
    normalises in its registers."""
    q, k, v, g, beta = _delta_rule_inputs(rule is kimi_delta_rule, 20)
    with torch.no_grad():
        rule(q, k, v, g, beta)
    assert [call[0] for call in kernels["calls"]] == ["l2", "l2"] and kernels["calls"][0][1] == (20, 2, 16)
    (name, args), = fla
    assert name == names[0] and args["use_qk_l2norm_in_kernel"] is False
    assert torch.equal(args["q"], l2_normalize(q)) and torch.equal(args["k"], l2_normalize(k))
    kernels["calls"].clear(), fla.clear()
    rule(q.requires_grad_(), k, v, g, beta)
    assert kernels["calls"] == [] and fla[0][0] == names[0] and fla[0][1]["use_qk_l2norm_in_kernel"] is True
    assert fla[0][1]["q"] is q
    fla.clear()
    with torch.no_grad():
        rule(*_delta_rule_inputs(rule is kimi_delta_rule, 1))
    assert kernels["calls"] == [] and fla[0][0] == names[1] and fla[0][1]["use_qk_l2norm_in_kernel"] is True
    fla.clear()
    with torch.no_grad():
        rule(q, k, v, g, beta, use_qk_l2norm=False)
    assert kernels["calls"] == [] and fla[0][1]["q"] is q and fla[0][1]["use_qk_l2norm_in_kernel"] is False


def test_a_captured_step_sends_its_norms_to_the_kernels(kernels, monkeypatch):
    """generate with the tiny model, its decoding step captured (replayed eagerly): the prompt's and each step's
    input, post-attention and final norms (2 a layer + 1: with the residual add but the first layer's input norm and
    the final one) and each GDN and KDA layer's output norm go to the kernels, and the tokens and logits are those of
    decoding without graphs."""
    stand_in_gemv(monkeypatch)
    layers = ["gated_deltanet", "full_attention", "kimi_delta_attention"]
    model = tiny_model(layers)
    input_ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    captured = replay_graphs_eagerly(monkeypatch)
    graphed = greedy(model, input_ids, new_tokens=4, cache_implementation="static")
    assert len(captured) == 1
    width, batch = model.config.hidden_size, input_ids.shape[0]
    gdn, kda = model.model.layers[0].linear_attn, model.model.layers[2].linear_attn
    per_step = 2 * len(layers) + 1
    steps = [call for call in kernels["calls"] if call[0] == "rms" and call[1] == (batch, width)]  # one token a row
    assert len(steps) % per_step == 0 and steps[:per_step] == [("rms", (batch, width), False)] + [
        ("rms", (batch, width), True)] * (2 * len(layers))
    gated = [call for call in kernels["calls"] if call[0] == "gated" and call[1][0] == batch]
    assert gated[:2] == [("gated", (batch, gdn.num_v_heads, gdn.head_v_dim), True),
                         ("gated", (batch, kda.num_heads, kda.head_dim), False)]
    prompt = [call for call in kernels["calls"] if call[1][0] == input_ids.numel()]  # the prompt's norms too
    assert [call[0] for call in prompt].count("rms") == per_step and [call[0] for call in prompt].count("gated") == 2
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, new_tokens=4, cache_implementation="static")
    assert_same_generation(graphed, eager, tolerance=0.0)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _skip_interpreted_bf16(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")


# (rows, width): no rows, one row, a wide row, a width that is not a power of two, many narrow rows (16 a program) in a
# count that is not a multiple of the program's block, a block's worth exactly
RMS_SHAPES = [(0, 128), (1, 2048), (16, 4096), (3, 300), (1000, 128), (4000, 16), (64, 256), (37, 100)]


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_kernel_against_float64_and_the_torch_path(shape, dtype, residual):
    """s = x + r is exact in float32 for half-precision inputs (one rounding for float32 ones), stored rounded once
    (unit roundoff u: bf16 2^-8, fp16 2^-11, fp32 2^-24); y = s / sqrt(mean(s^2) + eps) * w: the float32 sum of squares
    is within D 2^-24 of its value, so rstd within D/2 2^-24 (+ a few roundings: sqrt, division, two products), then y
    rounded once: within (2u + (D/2 + 8) 2^-24) |y| element by element (and half the spacing of subnormals, which an
    fp16 y of a small weight can be); the weight in float32 (a zero-centred norm's 1 + w) or in the dtype. The torch
    path (float32 too, its sums in another order) is within the same bound, so the two differ by at most twice it.
    x's rows are read at a row stride wider than D (a slice of a wider tensor)."""
    _skip_interpreted_bf16(dtype)
    from hybrid_linear_models.kernels_norm_triton import triton_rms_norm

    rows, width = shape
    device = _device()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, width + 5, generator=g).to(device, dtype)[:, 3:3 + width]
    r = (3 * torch.randn(rows, width, generator=g)).to(device, dtype) if residual else None
    unit = UNIT[dtype]
    for w in ((1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype),
              torch.randn(width, generator=g).to(device)):
        s = x.double() + (r.double() if residual else 0)
        expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        out = triton_rms_norm(x, w, 1e-6, r)
        y = out[0] if residual else out
        assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
        below_normal = torch.finfo(dtype).smallest_normal * unit  # half the spacing of subnormal results
        bound = (2 * unit + (width / 2 + 8) * 2 ** -24) * expected.abs() + below_normal
        assert ((y.double() - expected).abs() <= bound).all()
        torch_path = rms_norm(x.cpu(), w.cpu(), 1e-6, residual=r.cpu() if residual else None)
        torch_y = (torch_path[0] if residual else torch_path).to(device)
        assert ((y.double() - torch_y.double()).abs() <= 2 * bound).all()
        if residual:
            assert out[1].dtype == dtype and ((out[1].double() - s).abs() <= unit * s.abs()).all()


# (outer, heads, width): no rows, a decoding step's heads (one program), a batch of steps, odd sizes, a prompt's many
# rows (32 a program) in a count that is not a multiple of the program's block
GATED_SHAPES = [(0, 4, 128), (1, 32, 128), (16, 16, 128), (3, 5, 100), (301, 3, 64), (150, 4, 128)]


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_kernel_against_float64_and_the_torch_path(shape, dtype, activation):
    """y = x / sqrt(mean(x^2) + eps) * w * act(g): the float32 sum of squares within D 2^-24 of its value, so rstd
    within D/2 2^-24, a few more float32 roundings (sqrt, division, the products, sigmoid: 12 2^-24 in all), then one
    rounding (unit roundoff u), element by element (and half the spacing of subnormals); the torch path within twice
    that; the gate read through its strides (a slice of a wider row, as the fused projection's output is)."""
    _skip_interpreted_bf16(dtype)
    from hybrid_linear_models.kernels_norm_triton import triton_gated_rms_norm

    outer, heads, width = shape
    device = _device()
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
    unit = UNIT[dtype]
    bound = (unit + (width / 2 + 12) * 2 ** -24) * expected.abs() + torch.finfo(dtype).smallest_normal * unit
    assert ((y.double() - expected).abs() <= bound).all()
    torch_path = gated_rms_norm(x.cpu(), gate.cpu(), w.cpu(), eps=1e-6, activation=activation).to(device)
    assert ((y.double() - torch_path.double()).abs() <= 2 * bound).all()


# (outer, heads, width): no rows, one token's heads, a prompt's q (rows in a count that is not a multiple of the
# program's block of 32), odd sizes, wide heads
L2_SHAPES = [(0, 2, 128), (1, 16, 128), (257, 3, 128), (7, 5, 100), (5, 2, 1024)]


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", L2_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_l2_kernel_against_float64_and_the_torch_path(shape, dtype):
    """y = x / sqrt(sum(x^2) + eps): the float32 sum of squares within D 2^-24 of its value, so the reciprocal root
    within D/2 2^-24, plus sqrt, division and the product (4 2^-24), then one rounding (u), element by element;
    the torch path (`kernels_delta_rule.l2_normalize` in float32) within twice that. x is read through its strides (q
    as a slice of the convolution's [q | k | v] output)."""
    _skip_interpreted_bf16(dtype)
    from hybrid_linear_models.kernels_norm_triton import triton_l2_normalize

    outer, heads, width = shape
    device = _device()
    g = torch.Generator(device="cpu").manual_seed(5)
    qkv = torch.randn(outer, 3 * heads * width, generator=g).to(device, dtype)
    x = qkv[:, heads * width:2 * heads * width].unflatten(-1, (heads, width))
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)
    y = triton_l2_normalize(x, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    unit = UNIT[dtype]
    bound = (unit + (width / 2 + 4) * 2 ** -24) * expected.abs() + torch.finfo(dtype).smallest_normal * unit
    assert ((y.double() - expected).abs() <= bound).all()
    torch_path = l2_normalize(x.cpu().float()).to(device, dtype)
    assert ((y.double() - torch_path.double()).abs() <= 2 * bound).all()


def _binder(kernel):
    """The function that binds a launch's arguments and returns triton's specialisation of them (the key a compiled
    kernel is filed under): on a GPU the kernel's own, under the interpreter the one `JITFunction` makes of the
    kernel's source and decorator options for a CUDA target (as tests/test_attention_step_compiles.py does)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        kernel.device_caches[torch.cuda.current_device()]  # (created on first use)
        return kernel.device_caches[torch.cuda.current_device()][-1]
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))


@pytest.mark.gpu
@runs_triton_kernels
def test_one_compiled_kernel_key_for_every_row_count(monkeypatch):
    """Each kernel is launched under one specialisation key (its constexprs, the integers' value 1 and divisibility by
    16, the pointers' alignment) for every row count: one row, odd counts, multiples of 16, a prompt's many rows."""
    from hybrid_linear_models import kernels_norm_triton as kernels

    names = ("_rms_norm_kernel", "_gated_rms_norm_kernel", "_l2_normalize_kernel")
    keys: dict = {name: set() for name in names}
    for name in names:
        binder = _binder(getattr(kernels, name))

        def recorded(*args, grid, warmup, name=name, binder=binder, **kwargs):
            _, specialisation, options = binder(*args, **kwargs)
            keys[name].add((tuple(specialisation), str(options)))

        monkeypatch.setattr(getattr(kernels, name), "run", recorded)  # launches recorded, not run
    device = _device()
    w = torch.ones(128, device=device, dtype=torch.float16)
    for tokens in (1, 2, 15, 16, 17, 1000, 4097, 70000):
        x = torch.randn(tokens, 4, 128, device=device, dtype=torch.float16)
        # (the gate a slice of a wider row, its stride a multiple of 16 as the models' are)
        gate = torch.randn(tokens, 4 * 128 + 16, device=device, dtype=torch.float16)[:, 16:].unflatten(-1, (4, 128))
        kernels.triton_rms_norm(x.view(-1, 128), w, 1e-6, x.view(-1, 128))
        kernels.triton_gated_rms_norm(x, gate, w, 1e-6, True)
        kernels.triton_l2_normalize(gate, 1e-6)
    for name in names:
        assert len(keys[name]) == 1, (name, [set(k) for k in zip(*(key[0] for key in keys[name])) if len(set(k)) > 1])

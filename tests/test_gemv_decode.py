"""The Triton GEMV of captured decoding steps (kernels_gemv): which F.linear calls it takes, that a captured step
routes its narrow linear layers to it, and its numbers against float64 (on a GPU; on a CPU through triton's
interpreter when TRITON_INTERPRET=1 and triton are there: `TRITON_INTERPRET=1 pytest tests/test_gemv_decode.py`;
triton 3.6's interpreter needs numpy < 2.3, whose size-1 arrays still convert to a loop bound)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from hybrid_linear_models import kernels_gemv
from hybrid_linear_models.block_ops import silu_and_mul
from hybrid_linear_models.ops import causal_conv1d_step
from hybrid_linear_models.kernels_gemv import (DecodeGemvMode, conv_step_applies, decode_linear, gemv_applies,
                                               linear_conv_step, linear_rows, linear_swiglu, linear_widened,
                                               swiglu_pair_rows, torch_linear_conv_step)
from model_helpers import assert_same_generation, greedy, replay_graphs_eagerly, runs_triton_kernels, tiny_model
from offline_compile import ptxas_present, run_compile_script


@pytest.fixture
def stand_in(monkeypatch) -> list:
    """The kernel stood in on the CPU by F.linear itself (then silu_and_mul of the pairs for a paired call, the
    convolution's step on the first columns for a call with one); returns the (rows of x, out, in) of each call it
    served, with the gathered outputs' count appended for a call given `rows`, "pairs" for a paired one and "conv" for
    one with a convolution, "widened" for one with an output dtype of its own (`linear_widened`)."""
    calls: list = []

    def kernel(x, weight, bias, rows=None, swiglu_pairs=False, convolution=None, out_dtype=None):
        calls.append((x.shape[0], *weight.shape) + (() if rows is None else (rows.shape[0],))
                     + (("pairs",) if swiglu_pairs else ()) + (("conv",) if convolution is not None else ())
                     + (("widened",) if out_dtype is not None else ()))
        out = F.linear(x if out_dtype is None else x.to(out_dtype), weight, bias)
        out = out if rows is None else out[:, rows]
        if convolution is not None:
            taps, window = convolution
            channels = taps.shape[0]
            convolved = causal_conv1d_step(out[:, None, :channels], taps, window, activation="silu")[:, 0]
            return torch.cat([convolved, out[:, channels:]], dim=-1)
        return silu_and_mul(out[:, 0::2].contiguous(), out[:, 1::2].contiguous()) if swiglu_pairs else out

    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: kernel)
    monkeypatch.setattr(kernels_gemv, "_FAILED", {})
    return calls


def test_applies_to_narrow_half_precision_products_of_few_rows(stand_in):
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    x = torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    assert gemv_applies(x, w, None) and gemv_applies(x, w, torch.zeros(64, dtype=torch.bfloat16))
    assert gemv_applies(x.half(), w.half(), None)
    assert not gemv_applies(x.float(), w.float(), None)  # float32 keeps cuBLAS (and its exactness tests)
    assert not gemv_applies(torch.zeros(17, 32, dtype=torch.bfloat16), w, None)  # more than 16 rows
    wide = torch.zeros(kernels_gemv.WIDEST_OUTPUTS["rows"] + 1, 32, dtype=torch.bfloat16)
    many = torch.zeros(kernels_gemv.FEW_ROWS + 1, 32, dtype=torch.bfloat16)
    assert not gemv_applies(many, wide, None)  # wider than the limit of the tl.dot form (9 to 16 rows)
    assert gemv_applies(x[:1], wide, None) == (kernels_gemv.WIDEST_OUTPUTS["one_row"] is None)  # one row: any width
    for rows in (2, kernels_gemv.FEW_ROWS):  # 2 to 8 rows: the elementwise form up to its widest, then tl.dot's
        few = torch.zeros(rows, 32, dtype=torch.bfloat16)
        assert gemv_applies(few, w, None) and not gemv_applies(few, wide, None)
    every = torch.arange(wide.shape[0])
    for rows in (1, 2, kernels_gemv.FEW_ROWS, kernels_gemv.FEW_ROWS + 1, 16):  # a gather of outputs is always folded in
        assert gemv_applies(torch.zeros(rows, 32, dtype=torch.bfloat16), wide, None, rows=every)
    stacked = torch.zeros(2 * wide.shape[0], 32, dtype=torch.bfloat16)  # [W_gate; W_up], wider than every limit
    pairs = swiglu_pair_rows(wide.shape[0], x.device)
    for rows in (1, kernels_gemv.FEW_ROWS + 1, 16):  # SwiGLU's pairs too, except for 2 to 8 rows (cuBLAS, then
        # SwiGLU's kernel: faster than the tl.dot form there)
        assert gemv_applies(torch.zeros(rows, 32, dtype=torch.bfloat16), stacked, None, rows=pairs, paired=True)
    for rows in (2, kernels_gemv.FEW_ROWS):
        assert not gemv_applies(torch.zeros(rows, 32, dtype=torch.bfloat16), stacked, None, rows=pairs, paired=True)
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

    def broken(x, weight, bias, rows=None, swiglu_pairs=False):
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


def test_linear_swiglu_is_the_gated_mlps_activation_and_the_mode_reads_the_rows_in_pairs(stand_in):
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.bfloat16) for shape in ((2, 1, 16), (12, 16), (12,)))
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    expected = silu_and_mul(gate, up)
    assert torch.equal(linear_swiglu(x, w, b), expected) and stand_in == []  # no mode
    with torch.no_grad(), DecodeGemvMode():
        paired = linear_swiglu(x, w, bias=b)
    assert stand_in == [(2, 12, 16, 12, "pairs")] and torch.equal(paired, expected)
    assert swiglu_pair_rows(3, torch.device("cpu")).tolist() == [0, 3, 1, 4, 2, 5]
    assert gemv_applies(x, w, None, swiglu_pair_rows(6, x.device), paired=True)
    assert not gemv_applies(x, w, None, None, paired=True)  # pairs need their row order


def test_linear_widened_is_the_cast_then_the_product_and_the_mode_reads_the_narrow_input(stand_in):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1, 16, generator=g, dtype=torch.bfloat16)
    w, b = torch.randn(10, 16, generator=g), torch.randn(10, generator=g)  # float32, as Kimi-Linear's router
    expected = F.linear(x.float(), w, b)
    assert torch.equal(linear_widened(x, w, b), expected) and stand_in == []  # no mode: the cast, then F.linear
    with torch.no_grad(), DecodeGemvMode():
        widened = linear_widened(x, w, bias=b)
    assert stand_in == [(2, 10, 16, "widened")] and widened.dtype == torch.float32 and torch.equal(widened, expected)
    assert gemv_applies(x, w, b, widened=True) and gemv_applies(x.half(), w, None, widened=True)
    assert not gemv_applies(x, w, None)  # a plain product wants one dtype
    assert not gemv_applies(x, w.bfloat16(), None, widened=True)  # widened: a float32 weight
    assert not gemv_applies(x, w, b.bfloat16(), widened=True)  # and a float32 bias
    assert not gemv_applies(x.float(), w, None, widened=True)  # a float32 input is no narrower
    assert not gemv_applies(x, w, None, rows=torch.arange(3), widened=True)
    many = torch.zeros(kernels_gemv.FEW_ROWS + 1, 16, dtype=torch.bfloat16)  # the tl.dot form takes one dtype
    assert gemv_applies(many[:-1], w, None, widened=True) and not gemv_applies(many, w, None, widened=True)
    with torch.no_grad(), DecodeGemvMode():
        assert torch.equal(linear_widened(many, w), F.linear(many.float(), w))  # the cast and F.linear
    assert len(stand_in) == 1


def test_a_captured_kimi_moe_step_reads_its_router_in_float32_through_the_kernel(stand_in, monkeypatch):
    """Kimi-Linear's router (float32 weight, bf16 hidden states) runs as one widened GEMV in the captured step, one a
    MoE layer a step, and the tokens and logits are those of decoding without graphs."""
    from test_kimi_moe import kimi_moe_model

    model = kimi_moe_model(dtype=torch.bfloat16, n_group=1, topk_group=1)
    input_ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(6))
    replay_graphs_eagerly(monkeypatch)
    graphed = greedy(model, input_ids, cache_implementation="static")
    layers = model.config.mlp_types.count("kimi_moe")
    experts, hidden = model.config.num_experts, model.config.hidden_size
    widened = [call for call in stand_in if call[-1] == "widened"]  # (each replay here runs the step's Python)
    assert widened and set(widened) == {(1, experts, hidden, "widened")} and len(widened) % layers == 0
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, cache_implementation="static")
    assert_same_generation(graphed, eager, tolerance=0.0)


def test_a_captured_sparse_moe_step_reads_its_router_and_shared_gate_as_one_product(stand_in, monkeypatch):
    """Qwen3-Next's MoE layer: the router's E rows and the shared expert gate's one row as one GEMV of E + 1 outputs
    in the captured step, one a MoE layer a step (mlp_sparse_moe), and the tokens and logits those of decoding
    without graphs."""
    model = tiny_model(["gated_deltanet", "full_attention"], mlp_types=["sparse_moe", "sparse_moe"], num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24).to(torch.bfloat16).eval()
    input_ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    replay_graphs_eagerly(monkeypatch)
    graphed = greedy(model, input_ids, cache_implementation="static")
    hidden = model.config.hidden_size
    stacked = [call for call in stand_in if call[1:] == (9, hidden)]  # (each replay here runs the step's Python)
    assert stacked and len(stacked) % 2 == 0 and (1, 8, hidden) not in stand_in and (1, 1, hidden) not in stand_in
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, cache_implementation="static")
    assert_same_generation(graphed, eager, tolerance=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_captured_step_sends_its_narrow_linear_layers_to_the_kernel(stand_in, monkeypatch, dtype):
    """Every linear layer of the tiny model is narrow (within WIDEST_OUTPUTS): in bf16 each of them, the LM head
    included, runs through the kernel in the captured step (recorded once: the replays run no Python on a GPU), GDN's
    input projection with its outputs gathered in the kernel and its convolution's step in the epilogue, KDA's input
    projection with its convolution's step, the MLPs' gate and up projections with their SwiGLU; in float32 none does;
    the tokens and logits are those of decoding without graphs (the stand-in is F.linear, then the torch steps)."""
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
        width = model.config.intermediate_size  # the MLPs' gate and up projections with their SwiGLU, then down_proj
        assert (1, 2 * width, hidden, 2 * width, "pairs") in stand_in and (1, hidden, width) in stand_in
        gdn = model.model.layers[0].linear_attn
        stacked = gdn.in_proj_qkvz.out_features + gdn.in_proj_ba.out_features
        # in_proj_qkvz and in_proj_ba, regrouped and convolved in the kernel; KDA's six projections, convolved
        assert (1, stacked, hidden, stacked, "conv") in stand_in
        kda = model.model.layers[2].linear_attn
        six = sum(m.out_features for m in (kda.q_proj, kda.k_proj, kda.v_proj, kda.f_a_proj, kda.g_a_proj, kda.b_proj))
        assert (1, six, hidden, "conv") in stand_in
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, cache_implementation="static")
    assert_same_generation(graphed, eager, tolerance=0.0)



def _inputs(rows: int, out: int, inp: int, dtype: torch.dtype, bias: bool, seed: int):
    """x [rows, inp], a weight [out, inp] of unit-variance outputs and a bias [out] (or None), on the GPU if any."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).to(device, dtype)
    w = (torch.randn(out, inp, generator=g) / inp ** 0.5).to(device, dtype)
    return x, w, torch.randn(out, generator=g).to(device, dtype) if bias else None


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", [(1, 2048, 4096), (16, 2048, 5632), (3, 576, 2048), (1, 40, 300), (2, 40, 300),
                                   (4, 40, 300), (8, 40, 300), (9, 40, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", ["plain", "gathered"])
def test_kernel_against_float64(shape, dtype, bias, form):
    """float32 accumulation of half-precision products, then one rounding to the output dtype: within the output's
    rounding (unit roundoff u: bf16 2^-8, its 8 significant bits; fp16 2^-11) plus float32 summation error (K * 2^-24,
    at most 3.4e-4 here) of the largest |output|; both forms (one row of x: elementwise products; more: tl.dot), with
    the outputs in order or gathered through an index (reversed, a row repeated, one left out), each in two block
    configurations (fixed: autotuning every case would take minutes of a GPU run). (A first GPU run bounded bf16 by
    2^-9, half its unit roundoff: its bf16 cases failed and the fp16 ones passed.) The forms: elementwise products
    for one row and for 2 to FEW_ROWS rows (padded to 2, 4 or 8) up to their widest outputs, tl.dot otherwise
    (`kernels_gemv.form`)."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_gemv_triton import triton_gemv

    rows, out, inp = shape
    x, w, b = _inputs(rows, out, inp, dtype, bias, seed=0)
    index = torch.cat([torch.arange(out - 1, 0, -1), torch.tensor([5])]).to(x.device) if form == "gathered" else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    if index is not None:
        expected = expected[:, index]
    unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    bound = (unit + inp * 2 ** -24) * expected.abs().max()
    dot = kernels_gemv.form(rows, out) == "rows"
    for blocks in ((16, 128), (32, 256) if dot else (4, 512)):  # (BLOCK_N, BLOCK_K); tl.dot needs BLOCK_N >= 16
        got = triton_gemv(x, w, b, index, blocks=blocks)
        assert got.dtype == dtype and got.shape == expected.shape
        assert (got.double() - expected).abs().max() <= bound, blocks


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", [(1, 256, 2304), (4, 256, 2304), (1, 40, 300), (8, 40, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_kernel_against_float64(shape, dtype, bias):
    """`linear_widened`'s product (x in bf16/fp16, weight and bias in float32, a float32 output; one row and 2 to
    FEW_ROWS rows: the elementwise forms): every product x_k w_k of float32's, summed in float32, so each output is
    within (K + 1) 2^-24 sum_k |x_k w_k| of the exact value (float32's rounding of each product and each of the K
    sums; the bias adds one more term to the sum and the bound), in two block configurations."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_gemv_triton import triton_gemv

    rows, out, inp = shape
    x, w, b = _inputs(rows, out, inp, torch.float32, bias, seed=1)
    x = x.to(dtype)
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    bound = (inp + 2) * 2 ** -24 * (x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0))
    for blocks in ((16, 128), (4, 512)):
        got = triton_gemv(x, w, b, blocks=blocks, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert ((got.double() - expected).abs() <= bound).all(), blocks


WIDENED_COMPILE = """
import json
from offline_compile import stack_bytes
from hybrid_linear_models import kernels_gemv_triton as k

for rows, configs in ((1, k._ONE_ROW_CONFIGS), (2, k._FEW_ROWS_CONFIGS), (8, k._FEW_ROWS_CONFIGS)):
    for config in configs:
        stack = stack_bytes(k._gemv_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "b_ptr": "*fp32", "index_ptr": "*i64",
                                             "y_ptr": "*fp32", "conv_w_ptr": "*fp32", "window_ptr": "*fp32"},
                            {"HAS_BIAS": True, "HAS_INDEX": False, "SWIGLU_PAIRS": False, "ROWS": rows, "KW": 0,
                             "BLOCK_KW": 1, "PDL": True, "FEW_ROWS": k.FEW_ROWS, **config.kwargs},
                            config.num_warps, config.num_stages, aligned=("x_ptr", "w_ptr", "y_ptr", "stride_wn"))
        print(json.dumps({"rows": rows, "config": str(config), "stack": stack}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not ptxas_present(), reason="needs triton with its NVIDIA backend (ptxas)")
def test_the_widened_product_compiles_for_an_h200_without_spilling():
    """`linear_widened`'s kernel (bf16 rows, float32 weight, bias and output) in every configuration of the forms it
    takes (one row; 2 and 8 rows), with dependent launch, compiles for sm_90 with no stack frame (nothing spilled)."""
    from hybrid_linear_models import kernels_gemv_triton

    results = run_compile_script(WIDENED_COMPILE)
    assert len(results) == len(kernels_gemv_triton._ONE_ROW_CONFIGS) + 2 * len(kernels_gemv_triton._FEW_ROWS_CONFIGS)
    assert [r for r in results if r["stack"]] == [], results


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", [(1, 2048, 2048), (16, 1024, 2048), (3, 40, 300), (1, 40, 300), (9, 40, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_epilogue_against_float64(shape, dtype, bias):
    """`linear_swiglu`'s kernel (rows of [W_gate; W_up] read in (gate_j, up_j) pairs, silu(gate) * up stored):
    against silu(g) * u of the exact products g, u (float64). Each product is a float32 sum (error at most
    K 2^-24 sum_k |x_k w_k|) rounded to the dtype (unit roundoff u), so |g~ - g| <= dg = u|g| + K 2^-24 S_g (and du
    likewise); silu's slope is at most 1.0998, so the output is within 1.0998 dg (|u| + du) + |silu(g)| du, plus its
    own rounding u |out| and float32's evaluation of silu(g) * u (4 * 2^-24 |out|), element by element; both forms
    (one row: elementwise products; more: tl.dot), two block configurations each."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_gemv_triton import triton_gemv

    rows, width, inp = shape
    x, w, b = _inputs(rows, 2 * width, inp, dtype, bias, seed=1)
    products = x.double() @ w.double().T + (b.double() if bias else 0)
    sizes = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    gate, up = products.chunk(2, dim=-1)
    d_gate, d_up = (unit * p.abs() + inp * 2 ** -24 * s for p, s in zip((gate, up), sizes.chunk(2, dim=-1)))
    expected = gate * torch.sigmoid(gate) * up
    bound = 1.0998 * d_gate * (up.abs() + d_up) + (gate * torch.sigmoid(gate)).abs() * d_up
    bound += (unit + 4 * 2 ** -24) * (expected.abs() + bound)
    dot = kernels_gemv.form(rows, 2 * width) == "rows"
    for blocks in ((16, 128), (32, 256) if dot else (2, 1024)):
        got = triton_gemv(x, w, b, swiglu_pair_rows(width, x.device), blocks=blocks, swiglu_pairs=True)
        assert got.dtype == dtype and got.shape == expected.shape
        assert ((got.double() - expected).abs() <= bound).all(), blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled variants are counted on CUDA")
def test_a_batch_of_another_size_compiles_nothing_new():
    """Batches of 9 to ROWS rows share one row tile (5 to 8 rows another), and the batch size only bounds the rows:
    after the first, a batch of another size in its class (a multiple of 16 or not) runs the variant compiled (triton
    would otherwise compile again per class of the integer: 1, multiples of 16, others)."""
    from model_helpers import compiled_variants

    from hybrid_linear_models.kernels_gemv_triton import _gemv_kernel, triton_gemv

    x, w, _ = _inputs(16, 256, 512, torch.bfloat16, False, seed=3)
    triton_gemv(x[:9], w, None, blocks=(16, 128))
    torch.cuda.synchronize()
    compiled = compiled_variants(_gemv_kernel)
    for rows in (16, 13):
        triton_gemv(x[:rows], w, None, blocks=(16, 128))
        torch.cuda.synchronize()
        assert compiled_variants(_gemv_kernel) == compiled, f"a batch of {rows} rows compiled again"
    triton_gemv(x[:5], w, None, blocks=(16, 128))
    torch.cuda.synchronize()
    compiled = compiled_variants(_gemv_kernel)
    triton_gemv(x[:7], w, None, blocks=(16, 128))
    torch.cuda.synchronize()
    assert compiled_variants(_gemv_kernel) == compiled, "a batch of 7 rows compiled again after one of 5"


def test_linear_conv_step_is_the_projection_then_the_convolution_step(stand_in):
    """`linear_conv_step` outside the mode is linear_rows, then causal_conv1d_step on the first C outputs (the window
    stepped in place), the rest as they are; inside the mode, the stand-in kernel (the same math) takes it, and
    refuses what the epilogue does not serve (a strided window, one of other rows, more channels than outputs)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 1, 16, generator=g, dtype=torch.bfloat16), torch.randn(12, 16, generator=g).bfloat16()
    rows, taps = torch.tensor([3, 1, 0, 2, 11, 10, 4, 5]), torch.randn(6, 1, 4, generator=g).bfloat16()
    window = torch.randn(2, 6, 4, generator=g).bfloat16()
    expected_window = window.clone()
    projected = linear_rows(x, w, None, rows)
    expected = causal_conv1d_step(projected[..., :6], taps, expected_window, activation="silu"), projected[..., 6:]
    got_window = window.clone()
    got = linear_conv_step(x, w, None, rows, taps, got_window)
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(got_window, expected_window)
    assert not torch.equal(got_window, window)
    for strided in (False, True):
        stand_in.clear()
        moved = window.clone() if not strided else window.transpose(1, 2).contiguous().transpose(1, 2)
        with torch.no_grad(), DecodeGemvMode():
            out = linear_conv_step(x, w, None, rows, taps, moved)
        assert (stand_in == [(2, 12, 16, 8, "conv")]) != strided
        assert all(torch.equal(a, b) for a, b in zip(out, expected)) and torch.equal(moved, expected_window)
    stand_in.clear()
    with torch.no_grad(), DecodeGemvMode(), pytest.raises(ValueError, match="weight must be"):
        linear_conv_step(x, w, None, rows[:5], taps, window.clone())  # fewer outputs than channels: the step's error
    assert stand_in == [(2, 12, 16, 5)]  # the projection alone (no epilogue), then the step's own check
    assert not conv_step_applies(x, taps.view(6, 4), window[:1], 8)  # (another batch's window)
    wide = torch.zeros(6, kernels_gemv.MAX_CONV_TAPS + 1, dtype=torch.bfloat16)
    assert not conv_step_applies(x, wide, torch.zeros(2, *wide.shape, dtype=torch.bfloat16), 8)  # too many taps


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("shape", [(1, 136, 64, 96, 4, True), (3, 300, 40, 200, 3, False), (1, 1040, 256, 768, 4, True),
                                   (16, 520, 128, 384, 4, False), (2, 64, 32, 64, 2, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_convolution_epilogue_against_float64(shape, dtype):
    """The convolution's step in the GEMV's epilogue (`linear_conv_step`'s kernel): the products are those of the
    kernel without it (the same configuration: the same sums, bit for bit); the window's first KW - 1 taps become its
    last KW - 1 and the product its last (exact: stored in the dtype); the outputs past C are the products. Below C,
    against silu(sum_k tap_k s_k) in float64 of those stored values: each tap_k s_k is exact in float32 (two
    half-precision significands), their float32 sum within (KW - 1) 2^-24 sum_k |tap_k s_k|, silu's slope at most
    1.0998, float32's sigmoid and product within 4 2^-24 of the result, then one rounding (unit roundoff u), plus half
    the spacing of subnormals; one row (elementwise products) and several (tl.dot), outputs in order or gathered."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")
    from hybrid_linear_models.kernels_gemv_triton import triton_gemv

    rows, out, inp, channels, width, gathered = shape
    x, w, _ = _inputs(rows, out, inp, dtype, False, seed=5)
    g = torch.Generator(device="cpu").manual_seed(6)
    index = torch.randperm(out, generator=g).to(x.device) if gathered else None
    taps = (torch.randn(channels, width, generator=g) / width ** 0.5).to(x.device, dtype)
    window = torch.randn(rows, channels, width, generator=g).to(x.device, dtype)
    unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    for blocks in ((16, 128), (2, 256) if rows == 1 else (32, 256)):
        products = triton_gemv(x, w, None, index, blocks=blocks)
        stepped = window.clone()
        got = triton_gemv(x, w, None, index, blocks=blocks, convolution=(taps, stepped))
        assert got.dtype == dtype and got.shape == products.shape
        assert torch.equal(got[:, channels:], products[:, channels:])
        assert torch.equal(stepped[..., :-1], window[..., 1:]) and torch.equal(stepped[..., -1], products[:, :channels])
        terms = stepped.double() * taps.double()
        conv = terms.sum(-1)
        expected = conv * torch.sigmoid(conv)
        summed = 1.0998 * (width - 1) * 2 ** -24 * terms.abs().sum(-1)
        bound = summed + (unit + 4 * 2 ** -24) * (expected.abs() + summed) + torch.finfo(dtype).smallest_normal * unit
        assert ((got[:, :channels].double() - expected).abs() <= bound).all(), blocks


def test_a_convolution_epilogue_that_fails_leaves_the_gemv_and_the_step_with_one_warning(monkeypatch, caplog):
    tries = []

    def kernel(x, weight, bias, rows=None, convolution=None):
        tries.append(convolution is not None)
        if convolution is not None:
            raise RuntimeError("no such instruction on this GPU")
        return F.linear(x, weight, bias) if rows is None else F.linear(x, weight, bias)[:, rows]

    monkeypatch.setattr(kernels_gemv, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels_gemv, "triton_gemv_kernel", lambda: kernel)
    monkeypatch.setattr(kernels_gemv, "_FAILED", {})
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(1, 1, 16, generator=g).bfloat16(), torch.randn(10, 16, generator=g).bfloat16()
    taps, window = torch.randn(6, 1, 4, generator=g).bfloat16(), torch.randn(1, 6, 4, generator=g).bfloat16()
    expected_window = window.clone()
    expected = torch_linear_conv_step(x, w, None, None, taps, expected_window)
    with caplog.at_level("WARNING", logger="hybrid_linear_models.kernels_gemv"), torch.no_grad(), DecodeGemvMode():
        for step in range(2):
            got = linear_conv_step(x, w, None, None, taps, window)
            if step == 0:
                assert all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(window, expected_window)
    assert tries == [True, False, False] and caplog.text.count("failed") == 1 and "step's own kernel" in caplog.text

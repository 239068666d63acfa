"""A decoding step's bf16/fp16/fp32 experts as one GEMV launch per projection (`experts_routed`): the kernel against
float64 (triton's interpreter on a CPU, or a GPU), the MoE blocks' decoding steps through it against the experts'
grouped path (Qwen3-Next's sparse MoE and Kimi-Linear's), where it does not apply (gradients, hooks, expert
parallelism), its compilation for an H200, and the errors of a malformed call.

Bounds: an output is a float32 sum of K exact products (bf16 and fp16 products are exact in float32; fp32's round
once), at most (K + 2) 2^-23 S off the float64 sum with S = sum_k |x_k w_k|, then rounded once to the dtype (u its
unit roundoff): |y - exact| <= (K + 2) 2^-23 S + u (|exact| + that). The gated input's ops are torch's, each rounded
to the dtype, the kernel's exp triton's (a fast approximation on a GPU): one more unit of the dtype per input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import runs_triton_kernels, tiny_model
from offline_compile import ptxas_present, run_compile_script

from hybrid_linear_models import HybridLinearForCausalLM, experts_routed
from hybrid_linear_models.experts_routed import routed_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT = {torch.float32: 2 ** -24, torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}
# three tokens of three routes: an expert routed twice by one token, experts of another rank (5 = E and -1)
ROUTES = [3, 0, 3, 5, 1, 4, 2, -1, 0]


def _weights(experts: int, out: int, inp: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, out, inp, generator=g) / inp ** 0.5).to(DEVICE, dtype)


def _assert_within(got: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, extra_units: int = 0) -> None:
    exact = rows.double() @ weight.double().T
    sizes = rows.double().abs() @ weight.double().abs().T
    summed = (rows.shape[-1] + 2) * 2 ** -23 * sizes
    unit = UNIT[got.dtype]
    bound = summed + unit * (exact.abs() + summed) + extra_units * unit * sizes
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"off by {excess.max().item():.3g} beyond the bound"


def _skip_bf16_on_interpreter(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")


@runs_triton_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_the_kernel_against_float64(dtype):
    """Each route's row (row r // 3 of x) against its expert's weight in float64 (widths not multiples of the tile);
    routes to another rank's experts give rows of exactly zero."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_routed_experts_triton import triton_routed_experts

    weight = _weights(5, 24, 40, dtype, seed=1)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    routes = torch.tensor(ROUTES, device=DEVICE)
    got = triton_routed_experts(x, weight, routes, blocks=(4, 16))
    assert got.shape == (9, 24) and got.dtype == dtype
    for route, expert in enumerate(ROUTES):
        if not 0 <= expert < 5:
            assert (got[route] == 0).all(), f"route {route} to expert {expert} of another rank"
            continue
        _assert_within(got[route:route + 1], x[route // 3:route // 3 + 1], weight[expert])


@runs_triton_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("float32_weights", [False, True], ids=["weights in the dtype", "float32 weights"])
def test_the_gated_kernel_against_float64(dtype, float32_weights):
    """The down projection's input read as silu(gate) * up * the route's weight (each op rounded to the dtype, as the
    experts' torch ops; a float32 router's weights rounded to the dtype first, as their cast), against the float64
    product of that input as torch computes it."""
    _skip_bf16_on_interpreter(dtype)
    from hybrid_linear_models.kernels_routed_experts_triton import triton_routed_experts

    weight = _weights(5, 24, 20, dtype, seed=3)
    gate_up = torch.randn(9, 40, generator=torch.Generator().manual_seed(4)).mul(2).to(DEVICE, dtype)
    route_weights = torch.rand(9, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    if not float32_weights:
        route_weights = route_weights.to(dtype)
    routes = torch.tensor(ROUTES, device=DEVICE)
    got = triton_routed_experts(gate_up, weight, routes, gated_by=route_weights, blocks=(4, 16))
    gate, up = gate_up.chunk(2, dim=-1)
    gated = F.silu(gate) * up * route_weights.to(dtype)[:, None]
    for route, expert in enumerate(ROUTES):
        if not 0 <= expert < 5:
            assert (got[route] == 0).all(), f"route {route} to expert {expert} of another rank"
            continue
        _assert_within(got[route:route + 1], gated[route:route + 1], weight[expert], extra_units=2)


def test_the_reference_is_each_routes_product():
    """Off the kernel, routed_linear is each route's row times its expert's weight (F.linear), bit for bit, zeros for
    another rank's experts; the gated form multiplies torch's silu(gate) * up * weight."""
    weight = torch.randn(5, 24, 40, dtype=torch.float64)
    x = torch.randn(3, 40, dtype=torch.float64)
    routes = torch.tensor(ROUTES)
    got = routed_linear(x, weight, routes)
    for route, expert in enumerate(ROUTES):
        expected = F.linear(x[route // 3], weight[expert]) if 0 <= expert < 5 else torch.zeros(24, dtype=torch.float64)
        torch.testing.assert_close(got[route], expected, rtol=1e-15, atol=0)
    gate_up, route_weights = torch.randn(9, 80, dtype=torch.float64), torch.rand(9, dtype=torch.float64)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = routed_linear(F.silu(gate) * up * route_weights[:, None], weight, routes)
    assert torch.equal(routed_linear(gate_up, weight, routes, gated_by=route_weights), expected)


@pytest.mark.parametrize("call, message", [
    (lambda w, x: routed_linear(x, w[0], torch.tensor([0, 1, 2])), "must be \\[T, 40\\]"),
    (lambda w, x: routed_linear(x[:, :8], w, torch.tensor([0, 1, 2])), "must be \\[T, 40\\]"),
    (lambda w, x: routed_linear(x, w, torch.tensor([0, 1])), "the same number for each row"),
    (lambda w, x: routed_linear(x, w, torch.tensor([0.0, 1.0, 2.0])), "one integer expert per route"),
    (lambda w, x: routed_linear(torch.zeros(3, 80), w, torch.tensor([0, 1, 2]), gated_by=torch.ones(2)),
     "one routing weight per route"),
    (lambda w, x: routed_linear(torch.zeros(1, 80), w, torch.tensor([0, 1, 2]), gated_by=torch.ones(3)),
     "must be \\[T, 80\\] \\(a \\[gate | up\\] row per route\\)|x one row per route"),
])
def test_a_malformed_call_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(5, 24, 40), torch.zeros(3, 40))


def _moe_model(kind: str) -> HybridLinearForCausalLM:
    """A tiny float32 model with MoE MLPs: Qwen3-Next's sparse MoE (softmax router, gated shared expert; two layers)
    or Kimi-Linear's (sigmoid router with its bias, plain shared experts; three MoE layers)."""
    if kind == "sparse_moe":
        return tiny_model(["linear_attention", "full_attention"], mlp_types=["sparse_moe"] * 2, num_experts=8,
                          num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    from test_kimi_moe import kimi_moe_model

    return kimi_moe_model(dtype=torch.float32, n_group=1, topk_group=1).eval()


def _decode(model: HybridLinearForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a prompt of 6 tokens and of one-token steps through the rest (a dynamic cache)."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :6], use_cache=True)
        logits, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(6, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            cache = out.past_key_values
    return torch.stack(logits)


@pytest.mark.parametrize("kind", ["sparse_moe", "kimi_moe"])
def test_decoding_steps_through_the_routed_gemv_match_the_grouped_experts(kind, monkeypatch):
    """The decoding steps of a float32 model whose MoE layers take the routed GEMV (the CPU stands in for CUDA: the
    kernel under triton's interpreter where it runs, else the reference) against the same model's grouped experts:
    only the float32 sums' order differs, so within 2^-16 of the logits' size. The routed rows are taken in every
    MoE layer of every step (and not for the prompt, whose routes are past ROUTED_MAX_ROUTES, lowered here)."""
    model = _moe_model(kind)
    model.set_cuda_graph_decoding(False)
    layers = sum(t in ("sparse_moe", "kimi_moe") for t in model.config.mlp_types)
    k = model.config.per_layer_config[model.config.mlp_types.index(kind)].num_experts_per_tok
    ids = torch.randint(2, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    grouped = _decode(model, ids)
    taken = []
    real = experts_routed.routed_linear
    monkeypatch.setattr(experts_routed, "routed_linear", lambda *a, **k: taken.append(1) or real(*a, **k))
    monkeypatch.setattr(experts_routed, "ROUTED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(experts_routed, "ROUTED_MAX_ROUTES", 2 * k)  # (2 rows x k routes: steps, not the prompt)
    routed = _decode(model, ids)
    assert len(taken) == 2 * layers * (ids.shape[1] - 6)  # (two projections a MoE layer, each step)
    assert (routed - grouped).abs().max() <= 2 ** -16 * grouped.abs().max()


def test_the_grouped_path_runs_where_the_routed_gemv_must_not(monkeypatch):
    """Gradients wanted (training keeps the grouped path's autograd), a hook on the experts (a wrapper's forward the
    routed rows would skip) or expert parallelism: the experts' own forward runs."""
    monkeypatch.setattr(experts_routed, "ROUTED_DEVICE_TYPES", ("cuda", "cpu"))
    model = _moe_model("sparse_moe")
    block = model.model.layers[0].mlp
    hidden = model.config.hidden_size
    x, routes, weights = torch.randn(1, 1, hidden), torch.tensor([[0, 1, 2]]), torch.ones(1, 3)
    with torch.no_grad():
        assert block.experts.route_rows(x.view(1, hidden), routes, weights) is not None
    assert block.experts.route_rows(x.view(1, hidden), routes, weights) is None  # (a gradient wanted)
    calls = []
    handle = block.experts.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        block(x)
    handle.remove()
    assert calls == [1]
    block.experts._is_expert_parallel = True
    with torch.no_grad():
        assert block.experts.route_rows(x.view(1, hidden), routes, weights) is None


COMPILE = """
import json
from offline_compile import stack_bytes
from hybrid_linear_models import kernels_routed_experts_triton as k

for config in k._CONFIGS:
    for gated in (False, True):
        for pdl in (False, True):
            stack = stack_bytes(k._routed_experts_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "routes_ptr": "*i64",
                                                           "rw_ptr": "*bf16", "y_ptr": "*bf16"},
                                {"K": 2304 if not gated else 1024, "GATED": gated, "PDL": pdl, **config.kwargs},
                                config.num_warps, config.num_stages, aligned=("x_ptr", "w_ptr", "y_ptr", "stride_xm",
                                                                              "stride_we", "stride_wn", "stride_ym"))
            print(json.dumps({"config": str(config), "gated": gated, "pdl": pdl, "stack": stack}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not ptxas_present(), reason="needs triton with its NVIDIA backend (ptxas)")
def test_the_kernel_compiles_for_an_h200_without_spilling():
    """Every configuration, plain and gated, with and without dependent launch, at Kimi-Linear-48B-A3B's widths (K of
    2,304 and 1,024), compiles for sm_90 with no stack frame (nothing spilled)."""
    from hybrid_linear_models import kernels_routed_experts_triton

    results = run_compile_script(COMPILE)
    assert len(results) == 4 * len(kernels_routed_experts_triton._CONFIGS)
    assert [r for r in results if r["stack"]] == [], results

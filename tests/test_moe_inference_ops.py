"""The sparse MoE block's routing (softmax top-k) and gated shared-expert sum as one Triton kernel each
(moe_inference_ops, kernels_moe_triton), against torch's ops, the reference: on a GPU, or on a CPU through triton's
interpreter (`TRITON_INTERPRET=1` with triton on the path; no bf16 there). The kernels' exp is triton's (a fast
approximation on a GPU), so a value may differ from torch's by one unit in the last place of its dtype; the experts
chosen are torch's, and among equal probabilities at the k-th place the lowest indices."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from model_helpers import runs_triton_kernels, tiny_model
from offline_compile import ptxas_present, run_compile_script

from hybrid_linear_models import moe_inference_ops
from hybrid_linear_models.moe_inference_ops import add_gated, route_top_k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}  # one unit in the last place
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def kernels_on(monkeypatch):
    """The dispatch taking this machine's tensors to the kernels (the CPU's through triton's interpreter), counting the
    calls; the failure record empty."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(moe_inference_ops, "MOE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(moe_inference_ops, "_FAILED", {})
    calls = []
    for name in ("triton_route_top_k_kernel", "triton_add_gated_kernel"):
        kernel = getattr(moe_inference_ops, name)()
        assert kernel is not None

        def counted(*args, kernel=kernel, name=name, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(moe_inference_ops, name, lambda counted=counted: counted)
    return calls


def _skip_bf16_on_interpreter(dtype):
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter has no bfloat16 arithmetic")


def _logits(rows: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Each row a permutation of evenly spaced values in [-16, 16) rounded to the dtype (with many experts, runs of
    equal values: ties, at the k-th place too)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.arange(experts, dtype=torch.float32) * (32 / experts) - 16
    return torch.stack([values[torch.randperm(experts, generator=g)] for _ in range(rows)]).to(DEVICE, dtype)


def _reference(logits: torch.Tensor, k: int, normalize: bool):
    """The router's torch ops, top-k as a stable sort (equal probabilities in index order: the kernel's rule, and
    torch.topk's where no two of the k largest are equal)."""
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = (part[:, :k] for part in torch.sort(p, dim=-1, descending=True, stable=True))
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


@runs_triton_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, experts, k", [(1, 512, 10), (3, 64, 8), (5, 6, 6), (2, 100, 1), (1, 8192, 10)])
@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_routing_against_torch(kernels_on, dtype, rows, experts, k, normalize):
    """The experts are torch's (equal probabilities in index order); the weights within one unit of a half dtype's
    last place (float32's exp and sums in another order, then rounded), and float32's within the bound below."""
    _skip_bf16_on_interpreter(dtype)
    if experts == 8192 and not torch.cuda.is_available():
        pytest.skip("a long row is slow under the interpreter")
    logits = _logits(rows, experts, dtype)
    weights, chosen = route_top_k(logits, k, normalize=normalize)
    assert kernels_on == ["triton_route_top_k_kernel"]
    expected_weights, expected = _reference(logits, k, normalize)
    assert chosen.dtype == torch.int64 and torch.equal(chosen, expected)
    assert weights.dtype == dtype and weights.shape == (rows, k)
    # float32: the exp's few units, and softmax's sum of E terms in another order on each side (trees of log2 E
    # roundings); a half dtype: one unit of its last place after that
    rtol = 2 ** -23 * (4 + math.log2(experts)) if dtype == torch.float32 else UNIT[dtype]
    torch.testing.assert_close(weights, expected_weights, rtol=rtol, atol=0)


@runs_triton_kernels
def test_ties_at_the_kth_place_go_to_the_lowest_experts(kernels_on):
    """Experts 1, 3, 4 and 6 share the 2nd largest logit: top-3 takes expert 0 (the largest), then 1 and 3."""
    logits = torch.tensor([[3.0, 1.0, 0.0, 1.0, 1.0, -2.0, 1.0, 0.5]], device=DEVICE)
    weights, chosen = route_top_k(logits, 3, normalize=True)
    assert chosen.tolist() == [[0, 1, 3]]
    assert weights[0, 1] == weights[0, 2]
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0, device=DEVICE))


@runs_triton_kernels
def test_a_row_of_nan_logits_routes_within_the_experts(kernels_on):
    """NaN logits (a model that overflowed) give NaN weights and experts 0..k-1, as torch's top-k ranks NaN first:
    never an index past the experts, which an experts kernel would read out of bounds."""
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[1] = float("nan")
    weights, chosen = route_top_k(logits, 4, normalize=True)
    assert chosen[1].tolist() == [0, 1, 2, 3] and weights[1].isnan().all()
    assert torch.equal(chosen[0], _reference(logits[:1], 4, True)[1][0]) and not weights[0].isnan().any()


@runs_triton_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 2048), (4, 100), (3, 3000)])
def test_add_gated_against_torch(kernels_on, dtype, rows, width):
    """routed + sigmoid(gate) * shared, each op rounded to the dtype as torch's: within the bound below (the
    sigmoid's exp is another's)."""
    _skip_bf16_on_interpreter(dtype)
    g = torch.Generator().manual_seed(1)
    routed, shared = (torch.randn(rows, width, generator=g).to(DEVICE, dtype) for _ in range(2))
    gate = torch.randn(rows, 1, generator=g).mul(3).to(DEVICE, dtype)
    got = add_gated(routed, gate, shared)
    assert kernels_on == ["triton_add_gated_kernel"]
    expected = routed + torch.sigmoid(gate) * shared
    assert got.dtype == dtype and got.shape == expected.shape
    size = (routed.abs() + shared.abs()).float()
    # a gate rounded one unit apart carries into the product and the sum: 2 units of the dtype, plus the float32 exp's
    # few units where the dtype is float32
    assert ((got.float() - expected.float()).abs() <= (2 * UNIT[dtype] + 2 ** -20) * size).all()


@runs_triton_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_gated_sums_unsummed_routes_first(kernels_on, dtype):
    """Routed rows [T, k, H] are summed (float32, rounded once) before the gated sum: torch's routed.sum(1), then the
    same bound as the summed rows."""
    _skip_bf16_on_interpreter(dtype)
    g = torch.Generator().manual_seed(12)
    routes = torch.randn(3, 10, 200, generator=g).to(DEVICE, dtype)
    shared = torch.randn(3, 200, generator=g).to(DEVICE, dtype)
    gate = torch.randn(3, 1, generator=g).to(DEVICE, dtype)
    got = add_gated(routes, gate, shared)
    assert kernels_on == ["triton_add_gated_kernel"] and got.shape == (3, 200) and got.dtype == dtype
    summed = routes.sum(1)
    expected = summed + torch.sigmoid(gate) * shared
    size = (summed.abs() + shared.abs()).float() + routes.abs().float().sum(1) * 2 ** -23 * 10
    assert ((got.float() - expected.float()).abs() <= (2 * UNIT[dtype] + 2 ** -20) * size).all()


@runs_triton_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routes", [0, 8], ids=["summed rows", "8 routes a row"])
def test_add_without_a_gate_sums_as_torch(kernels_on, dtype, routes):
    """Without a gate (Kimi-Linear's shared experts), routed + shared, the routes summed first (float32, rounded
    once): against torch's routed.sum(1) + shared, the two float32 sums of k terms each within k 2^-24 of the terms'
    absolute sum of the exact one, and each side's two roundings half a unit of the dtype: the bound below. Summed
    rows: the same one rounding of one sum, the same bits."""
    _skip_bf16_on_interpreter(dtype)
    g = torch.Generator().manual_seed(13)
    routed = torch.randn(3, *((routes,) if routes else ()), 300, generator=g).to(DEVICE, dtype)
    shared = torch.randn(3, 300, generator=g).to(DEVICE, dtype)
    got = add_gated(routed, None, shared)
    assert kernels_on == ["triton_add_gated_kernel"] and got.shape == (3, 300) and got.dtype == dtype
    summed = routed.sum(1) if routes else routed
    expected = summed + shared
    summing = 2 * routes * 2 ** -24 * routed.abs().float().sum(1) if routes else 0
    bound = UNIT[dtype] * (summed.abs() + shared.abs()).float() * 2 + summing
    assert ((got.float() - expected.float()).abs() <= bound).all()
    if not routes:  # (one rounding of one sum: the same bits)
        assert torch.equal(got, expected)


@runs_triton_kernels
def test_kernels_are_not_taken_where_a_gradient_is_wanted(kernels_on):
    """Training keeps torch's ops, whose gradients flow to the router and the shared expert's gate."""
    logits = _logits(2, 16, torch.float32).requires_grad_()
    weights, _ = route_top_k(logits, 4, normalize=True)
    gate = torch.zeros(2, 1, device=DEVICE, requires_grad=True)
    out = add_gated(torch.ones(2, 8, device=DEVICE), gate, torch.ones(2, 8, device=DEVICE))
    (weights.sum() + out.sum()).backward()
    assert kernels_on == []
    assert logits.grad is not None and gate.grad is not None and gate.grad.abs().sum() > 0


def test_the_reference_runs_off_the_kernels_devices():
    """Where the kernels do not apply (here: the CPU without the interpreter's stand-in), torch's ops, exactly."""
    if DEVICE != "cpu":
        pytest.skip("the CPU's path")
    logits = _logits(3, 32, torch.bfloat16)
    weights, chosen = route_top_k(logits, 4, normalize=True)
    expected_weights, expected = _reference(logits, 4, True)
    assert torch.equal(chosen, expected) and torch.equal(weights, expected_weights)


@runs_triton_kernels
def test_a_sparse_moe_model_takes_the_kernels_and_keeps_its_logits(kernels_on):
    """A tiny Qwen3-Next-style model (softmax top-k router, sigmoid-gated shared expert) in float32 without
    gradients: every MoE layer routes and adds its shared expert through the kernels, and the logits agree with the
    torch path's within float32's rounding."""
    model = tiny_model(["linear_attention", "full_attention"], mlp_types=["sparse_moe"] * 2, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24).to(DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        fused = model(ids).logits
        assert kernels_on.count("triton_route_top_k_kernel") == 2
        assert kernels_on.count("triton_add_gated_kernel") == 2
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe_inference_ops, "MOE_DEVICE_TYPES", ())
            reference = model(ids).logits
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def _kimi_reference(logits, k, bias, eps, scale, normalize=True):
    """Kimi-Linear's router after its logits (every group kept): sigmoid scores, the choice steered by the bias, the
    weights the chosen scores, renormalised with eps, scaled."""
    scores = logits.sigmoid()
    experts = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * scale, experts


@runs_triton_kernels
@pytest.mark.parametrize("experts, k", [(256, 8), (64, 6), (10, 10)])
@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_routing_with_a_correction_bias_against_torch(kernels_on, experts, k, normalize):
    """Kimi-Linear's routing (float32 logits, as its router computes them): the experts of the largest score plus
    bias (the bias changes the choice: checked against the choice without it), the weights the unbiased scores."""
    g = torch.Generator().manual_seed(6)
    logits = _logits(3, experts, torch.float32, seed=7)
    bias = (torch.randn(experts, generator=g) * 0.5).to(DEVICE)
    weights, chosen = route_top_k(logits, k, sigmoid=True, normalize=normalize, bias=bias, eps=1e-20, scale=2.5)
    assert kernels_on == ["triton_route_top_k_kernel"]
    expected_weights, expected = _kimi_reference(logits, k, bias, 1e-20, 2.5, normalize)
    assert torch.equal(chosen, expected)
    torch.testing.assert_close(weights, expected_weights, rtol=2 ** -23 * (4 + math.log2(experts)), atol=0)
    if k < experts:
        assert not torch.equal(chosen, _kimi_reference(logits, k, torch.zeros_like(bias), 1e-20, 2.5)[1])


def test_the_kimi_router_takes_route_top_k_where_every_group_is_kept(monkeypatch):
    """Kimi-Linear's router calls route_top_k (its reference off the GPU: the same ops as before, bit for bit) where
    every group is kept, and keeps its grouped choice otherwise."""
    from hybrid_linear_models import mlp_kimi_moe
    from hybrid_linear_models.mlp_kimi_moe import HybridLinearKimiMoeRouter

    calls = []
    real = mlp_kimi_moe.route_top_k
    monkeypatch.setattr(mlp_kimi_moe, "route_top_k", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    for groups, kept in ((1, 1), (4, 2)):
        settings = SimpleNamespace(num_experts_per_tok=4, num_experts=16, norm_topk_prob=True, hidden_size=8,
                                   n_group=groups, topk_group=kept, routed_scaling_factor=2.0)
        router = HybridLinearKimiMoeRouter(settings)
        with torch.no_grad():
            router.weight.copy_(torch.randn(16, 8, generator=torch.Generator().manual_seed(8)))
            router.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(9)))
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10))
        logits, weights, experts = router(x)
        if groups == 1:
            expected_weights, expected = _kimi_reference(logits.cpu(), 4, router.e_score_correction_bias, 1e-20, 2.0)
            assert torch.equal(experts, expected) and torch.equal(weights, expected_weights)
    assert len(calls) == 1 and calls[0]["sigmoid"] and calls[0]["scale"] == 2.0


@runs_triton_kernels
def test_a_kimi_moe_model_takes_the_routing_kernel_and_keeps_its_logits(kernels_on):
    """A tiny Kimi-Linear-style model (sigmoid router with a correction bias, every group kept as in
    Kimi-Linear-48B-A3B) in float32 without gradients: each Kimi MoE layer routes through the kernel, and the logits
    agree with the torch path's within float32's rounding."""
    from test_kimi_moe import kimi_moe_model

    model = kimi_moe_model(dtype=torch.float32, n_group=1, topk_group=1).to(DEVICE)
    ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    with torch.no_grad():
        fused = model(ids).logits
        assert kernels_on.count("triton_route_top_k_kernel") == 3  # (the three Kimi MoE layers)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe_inference_ops, "MOE_DEVICE_TYPES", ())
            reference = model(ids).logits
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


# compiles the MoE kernels for an H200 (sm_90) with triton's NVIDIA backend, no GPU needed, and prints each one's
# stack frame (spilled registers)
COMPILE = """
import json
from offline_compile import stack_bytes as compiled
from hybrid_linear_models import kernels_moe_triton as k

for experts in (512, 4096, 8192):
    for pdl in (False, True):
        for sigmoid in (False, True):  # (Qwen3-Next's softmax; Kimi-Linear's sigmoid with its correction bias)
            stack = compiled(k._route_top_k_kernel, {"logits_ptr": "*bf16", "bias_ptr": "*fp32",
                                                     "weights_ptr": "*bf16", "experts_ptr": "*i64", "eps": "fp32",
                                                     "scale": "fp32"},
                             {"K": 10, "BLOCK_E": experts, "BLOCK_K": 16, "SIGMOID": sigmoid, "HAS_BIAS": sigmoid,
                              "NORMALIZE": True, "PDL": pdl}, k.routing_warps(experts))
            print(json.dumps({"kernel": "route_top_k", "experts": experts, "sigmoid": sigmoid, "pdl": pdl,
                              "stack": stack}))
for routes in (0, 10):  # (summed rows; Qwen3-Next's 10 routes a token, summed in the kernel)
    for pdl in (False, True):
        for gated in (True, False):  # (Qwen3-Next's gated shared expert; Kimi-Linear's plain shared experts)
            stack = compiled(k._add_gated_kernel, {"routed_ptr": "*bf16", "gate_ptr": "*bf16", "shared_ptr": "*bf16",
                                                   "out_ptr": "*bf16"},
                             {"BLOCK_H": 1024, "ROUTES": routes, "PDL": pdl, "GATED": gated}, 4)
            print(json.dumps({"kernel": "add_gated", "routes": routes, "pdl": pdl, "gated": gated, "stack": stack}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not ptxas_present(), reason="needs triton with its NVIDIA backend (ptxas)")
def test_the_kernels_compile_for_an_h200_without_spilling():
    """Both kernels, with and without dependent launch, the routing one softmax (Qwen3-Next) and sigmoid with a bias
    (Kimi-Linear) for 512 experts, 4,096 and the widest row the dispatch gives it (8,192), with the warps it launches,
    the sum with and without a gate, compile for sm_90 with no stack frame (nothing spilled)."""
    results = run_compile_script(COMPILE)
    assert len(results) == 20 and all(r["stack"] == 0 for r in results), results

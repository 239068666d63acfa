"""The sparse MoE MLP alone against transformers' Qwen3NextSparseMoeBlock with the same weights, for every experts
implementation offered (the reference always runs its own eager loop, the plainest statement of the math)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from hybrid_linear_models.experts_grouped_gather import grouped_mm_gather_experts_forward
from hybrid_linear_models.mlp_sparse_moe import (
    EXPERTS_IMPLEMENTATIONS,
    HybridLinearSparseMoeBlock,
    graph_safe_experts_implementation,
)
from tests.numerics import assert_close
from model_helpers import forward_backward


def _config(implementation: str, **overrides) -> Qwen3NextConfig:
    fields = dict(hidden_size=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, norm_topk_prob=True, hidden_act="silu")
    fields.update(overrides)
    config = Qwen3NextConfig(**fields)
    config._experts_implementation = implementation
    return config


def _pair(implementation: str, dtype=torch.float64, **overrides):
    """(ours with `implementation`, transformers' eager block), same weights."""
    torch.manual_seed(0)
    reference = Qwen3NextSparseMoeBlock(_config("eager", **overrides)).to(dtype)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3)  # router logits of order 1: the top-k choice is not a tie
    ours = HybridLinearSparseMoeBlock(_config(implementation, **overrides)).to(dtype)
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours, reference


@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_equals_qwen3_next(implementation, norm_topk_prob):
    # float32 (torch's grouped_mm has no float64 kernel): the router is the same F.linear + softmax + topk in both, so
    # the routing is identical; the rest differs only by summation order inside the GEMMs and over the k experts,
    # a few float32 ulps (~1e-7 relative); 1e-5 leaves room and still catches any wrong weight, routing or scaling
    # (those are O(1e-1) errors)
    ours, reference = _pair(implementation, dtype=torch.float32, norm_topk_prob=norm_topk_prob)
    x = torch.randn(3, 7, 32)
    got, ref = forward_backward(ours, x), forward_backward(reference, x)
    assert_close(got[0], ref[0], 1e-5, f"{implementation}: output")
    assert_close(got[1], ref[1], 1e-5, f"{implementation}: input gradient")
    for name, grad in ref[2].items():
        assert_close(got[2][name], grad, 1e-5, f"{implementation}: gradient of {name}")


@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
def test_float32_and_unused_experts(implementation):
    # 2 tokens, top-2 of 8 experts: most experts get no token (empty groups in the grouped GEMMs, skipped ones in the
    # eager loop), and their weight gradients must be exactly zero. float32: GEMM summation orders differ, ~1e-7
    # relative; 1e-5 bounds that with a margin
    ours, reference = _pair(implementation, dtype=torch.float32, num_experts_per_tok=2)
    x = torch.randn(1, 2, 32)
    got, ref = forward_backward(ours, x), forward_backward(reference, x)
    assert_close(got[0], ref[0], 1e-5, f"{implementation}: output")
    used = torch.zeros(8, dtype=torch.bool)
    used[reference.gate(x.view(-1, 32))[2].flatten()] = True
    assert (got[2]["experts.gate_up_proj"][~used] == 0).all()
    assert_close(got[2]["experts.down_proj"], ref[2]["experts.down_proj"], 1e-5, f"{implementation}: down_proj grad")


def test_no_shared_expert():
    # shared_expert_intermediate_size 0: no shared expert and no gate; the output is the routed experts' alone,
    # checked against the reference with its shared expert's down projection zeroed (sigmoid(.) * 0 = 0)
    torch.manual_seed(0)
    ours = HybridLinearSparseMoeBlock(_config("eager", shared_expert_intermediate_size=0))
    assert ours.shared_expert is None and ours.shared_expert_gate is None
    assert not any("shared" in name for name, _ in ours.named_parameters())
    reference = Qwen3NextSparseMoeBlock(_config("eager", shared_expert_intermediate_size=4))
    for name, p in ours.named_parameters():
        torch.nn.init.normal_(p, std=0.3)
        reference.get_parameter(name).data.copy_(p.data)
    torch.nn.init.zeros_(reference.shared_expert.down_proj.weight)
    x = torch.randn(2, 5, 32)
    # the same ops in the same order (eager both sides): equal up to the added zero, 1e-6 is generous
    assert_close(ours(x), reference(x), 1e-6, "no shared expert")


def test_router_outputs():
    # the router: logits in the hidden dtype, softmax in float32 then top-k, renormalised by norm_topk_prob
    ours, reference = _pair("eager", dtype=torch.bfloat16)
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    logits, weights, experts = ours.gate(x)
    ref_logits, ref_weights, ref_experts = reference.gate(x)
    assert logits.dtype == weights.dtype == torch.bfloat16
    assert torch.equal(logits, ref_logits) and torch.equal(weights, ref_weights) and torch.equal(experts, ref_experts)
    probabilities = torch.softmax(logits.float(), -1)
    top = probabilities.gather(1, experts)
    assert torch.equal(weights, (top / top.sum(-1, keepdim=True)).to(torch.bfloat16))


def test_gather_permutation_backward_has_no_scatter():
    # the reason grouped_mm_gather exists: its backward gathers (index_select) where transformers' grouped_mm
    # scatters (index_put with accumulation)
    ours, _ = _pair("grouped_mm_gather", dtype=torch.float32)
    x = torch.randn(16, 32, requires_grad=True)
    logits, weights, experts = ours.gate(x)
    out = grouped_mm_gather_experts_forward(ours.experts, x, experts, weights).sum()
    with torch.profiler.profile() as profile:
        out.backward()
    names = {event.key for event in profile.key_averages()}
    assert "aten::index_select" in names and not any("index_put" in name for name in names)


def test_graph_safe_implementation():
    assert graph_safe_experts_implementation("eager") == "grouped_mm_gather"
    for name in ("grouped_mm", "batched_mm", "grouped_mm_gather"):
        assert graph_safe_experts_implementation(name) == name
        assert graph_safe_experts_implementation(name, torch.bfloat16, "cuda") == name
        # torch's CUDA grouped GEMM reads its offsets on the host for other dtypes (a capture on an H200 failed so)
        assert graph_safe_experts_implementation(name, torch.float32, "cuda") == "batched_mm"
    assert graph_safe_experts_implementation("eager", torch.bfloat16, "cuda") == "grouped_mm_gather"


def test_grouped_mm_gather_runs_float64():
    # float64 (the model tests' exact comparisons): torch's grouped_mm refuses it, grouped_mm_gather falls back to
    # transformers' per-expert GEMMs; the math is the same ops in another order, ~1e-16 relative, so 1e-12
    ours, reference = _pair("grouped_mm_gather", dtype=torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    got, ref = forward_backward(ours, x), forward_backward(reference, x)
    for a, b, what in ((got[0], ref[0], "output"), (got[1], ref[1], "input gradient"),
                       (got[2]["experts.gate_up_proj"], ref[2]["experts.gate_up_proj"], "gate_up_proj gradient"),
                       (got[2]["gate.weight"], ref[2]["gate.weight"], "router gradient")):
        assert_close(a, b, 1e-12, what)


def test_gather_rows_cpu_backward_sums_each_rows_copies():
    # on the CPU the gradient of x through the expert gather (each token's k copies summed) is one index_add; against
    # torch's own advanced-indexing backward (an accumulating index_put) in float64: the same k-term sums in another
    # order, ~1e-16 relative; 1e-12 catches a lost or misplaced copy
    from hybrid_linear_models.experts_grouped_gather import _GatherRows

    generator = torch.Generator().manual_seed(2)
    tokens, k = 13, 3
    order = torch.randperm(tokens * k, generator=generator)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    x = torch.randn(tokens, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(tokens * k, 5, dtype=torch.float64)
    _GatherRows.apply(x, order // k, inverse, k).backward(grad)
    reference = x.detach().clone().requires_grad_()
    reference[order // k].backward(grad)
    torch.testing.assert_close(x.grad, reference.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,switched", [(torch.float32, True), (torch.bfloat16, False)])
def test_grouped_mm_gather_under_compile_avoids_the_host_synced_grouped_gemm(monkeypatch, dtype, switched):
    """Under torch.compile (generate compiles static-cache steps with CUDA graphs) CUDA's grouped GEMM reads its offsets
    on the host outside bfloat16 (an H200 run failed so): grouped_mm_gather runs transformers' batched_mm there, and
    keeps its own grouped path for bfloat16. The CPU stands in for CUDA here (its devices patched into the switch)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from hybrid_linear_models import experts_grouped_gather

    batched = ALL_EXPERTS_FUNCTIONS["batched_mm"]
    calls = []
    monkeypatch.setitem(type(ALL_EXPERTS_FUNCTIONS)._global_mapping, "batched_mm",
                        lambda *args: calls.append(1) or batched(*args))
    monkeypatch.setattr(experts_grouped_gather, "HOST_SYNCED_DEVICE_TYPES", ("cuda", "cpu"))
    ours, _ = _pair("grouped_mm_gather", dtype=dtype)
    x = torch.randn(2, 9, 32, dtype=dtype)
    with torch.no_grad():
        eager = ours(x)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        compiled = ours(x)
    assert len(calls) == (1 if switched else 0)
    # batched_mm against the grouped path: the same products summed in another order (float32 ~1e-7 relative); the
    # bfloat16 path is the same code both times
    assert_close(compiled, eager, 1e-5 if switched else 0.0, "output under compile")


def test_a_decoding_step_computes_the_router_and_the_shared_gate_as_one_product():
    """A decoding step (x [B, 1, H], no gradient): the router's logits and the shared expert gate's come from one
    product of their stacked weights, the router weight a view of the stack (no copy); the output equals transformers'
    block on the same weights (float64: the same dot products, apart or stacked, agree to a few ulps), and the router
    module still runs with the logits a hook records."""
    ours, reference = _pair("grouped_mm_gather")
    x = torch.randn(3, 1, 32, dtype=torch.float64)
    seen = []
    ours.gate.register_forward_hook(lambda module, args, output: seen.append(output[0]))
    with torch.no_grad():
        got = ours(x)
        expected = reference(x)
    stack = ours._router_and_gate.value
    assert stack is not None and stack.shape == (9, 32)
    assert ours.gate.weight.data_ptr() == stack.data_ptr()  # the router's weight: the stack's first rows
    assert ours.shared_expert_gate.weight.data_ptr() == stack[8:].data_ptr()
    assert_close(got, expected[0] if isinstance(expected, tuple) else expected, 1e-12, "stacked router and gate")
    assert len(seen) == 1
    assert_close(seen[0], x.reshape(3, 32) @ ours.gate.weight.T, 1e-12, "recorded router logits")


def test_the_router_and_the_shared_gate_stay_apart_where_stacking_does_not_apply():
    ours, _ = _pair("grouped_mm_gather")
    step, prompt = torch.randn(2, 1, 32, dtype=torch.float64), torch.randn(1, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        assert ours._router_and_gate_logits(step) is not None
        assert ours._router_and_gate_logits(prompt) is None  # a prompt: the layers' own products
    assert ours._router_and_gate_logits(step) is None  # gradients (training)
    with torch.no_grad():
        handle = ours.gate.register_forward_pre_hook(lambda module, args: None)  # it may change the router's input
        assert ours._router_and_gate_logits(step) is None
        handle.remove()
        handle = ours.shared_expert_gate.register_forward_hook(lambda module, args, output: output)
        assert ours._router_and_gate_logits(step) is None
        handle.remove()
        ours.shared_expert_gate.float()  # weights of two dtypes
        assert ours._router_and_gate_logits(step) is None
    without = HybridLinearSparseMoeBlock(_config("grouped_mm_gather", shared_expert_intermediate_size=0)).double()
    with torch.no_grad():
        assert without._router_and_gate_logits(step) is None

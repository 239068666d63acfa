"""GPU tests: `hybrid_linear_models.ops` on CUDA tensors (fla's Triton kernels) against this package's torch path
(`kernels_delta_rule.chunk_delta_rule`, float32) on the same CUDA tensors.

Skipped unless CUDA is available and fla is installed (`pip install .[gpu]`). fla is looked up with `find_spec`, never
imported here, so collecting this file on a CPU-only machine with fla installed does not start triton.

Tolerances: fla computes its dot products in TF32 (10 bits of mantissa, ~5e-4 relative per product, accumulated in
float32), so float32 inputs agree with the float32 torch path to ~1e-3 of the largest magnitude; `F32_TOL` = 2e-3.
bfloat16 inputs: fla keeps bf16 intermediates in places and returns bf16 outputs and gradients, `BF16_TOL` = 2e-2;
the torch path runs on the same bf16 tensors (it upcasts to float32 internally).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from hybrid_linear_models import kernels_delta_rule, ops
from numerics import assert_close

F32_TOL = 2e-3
BF16_TOL = 2e-2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (fla)"),
]

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(*, kda, B, T, Hk, Hv, d, n_states, dtype, seed=0):
    """Realistic gates: beta = sigmoid(randn); g = -softplus(randn + 1) * 0.5 (about [-2.5, -0.01])."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    g_shape = (B, T, Hv, d) if kda else (B, T, Hv)
    inputs = {
        "q": randn(B, T, Hk, d).to(dtype),
        "k": randn(B, T, Hk, d).to(dtype),
        "v": randn(B, T, Hv, d).to(dtype),
        "g": (-F.softplus(randn(*g_shape) + 1.0) * 0.5).to(dtype),
        "beta": torch.sigmoid(randn(B, T, Hv)).to(dtype),
        "initial_state": randn(n_states, Hv, d, d) * 0.5,  # float32, the state's contract
    }
    return inputs


def run(fn, inputs, weights, **kwargs):
    leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items()}
    o, S = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
              initial_state=leaves["initial_state"], output_final_state=True, **kwargs)
    ((o.float() * weights[0]).sum() + (S.float() * weights[1]).sum()).backward()
    return o.detach(), S.detach(), {n: x.grad for n, x in leaves.items()}


def torch_path(q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None):
    return kernels_delta_rule.chunk_delta_rule(q, k, v, g, beta, q.shape[-1] ** -0.5, initial_state,
                                               output_final_state, cu_seqlens)


def check(kind, dtype, cu_seqlens=None, B=2, T=1000):
    kda = kind == "kda"
    Hk, Hv, d = (4, 4, 64) if kda else (4, 8, 64)
    if cu_seqlens is not None:
        B, T = 1, int(cu_seqlens[-1])
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    inputs = make_inputs(kda=kda, B=B, T=T, Hk=Hk, Hv=Hv, d=d, n_states=N, dtype=dtype)
    assert ops.fla_available_for(inputs["q"]), "fla is installed but ops does not use it"
    gen = torch.Generator(device="cuda").manual_seed(1)
    weights = (torch.randn(B, T, Hv, d, generator=gen, device="cuda"),
               torch.randn(N, Hv, d, d, generator=gen, device="cuda"))
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    o, S, grads = run(fn, inputs, weights, cu_seqlens=cu_seqlens)
    o_ref, S_ref, grads_ref = run(torch_path, inputs, weights, cu_seqlens=cu_seqlens)
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    assert o.dtype == dtype and S.dtype == torch.float32
    assert_close(o, o_ref, tol, f"{kind} output")
    assert_close(S, S_ref, tol, f"{kind} final state")
    for n in NAMES:
        assert grads[n] is not None, f"{kind}: no gradient for {n}"
        assert_close(grads[n], grads_ref[n], tol, f"{kind} d{n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fla_matches_torch_path(kind, dtype):
    check(kind, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fla_matches_torch_path_packed(kind, dtype):
    lengths = [1, 63, 64, 130, 742]  # 1000 tokens
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    check(kind, dtype, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_path_matches_torch(kind):
    """T = 1 without grad goes to fla's fused_recurrent kernels: eight decoding steps, each from the previous step's
    state, equal the torch path over the eight tokens at once (outputs and final state)."""
    kda = kind == "kda"
    Hk, Hv, d, B, steps = (4, 4, 64, 3, 8) if kda else (4, 8, 64, 3, 8)
    inputs = make_inputs(kda=kda, B=B, T=steps, Hk=Hk, Hv=Hv, d=d, n_states=B, dtype=torch.float32, seed=2)
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    state, outputs = inputs["initial_state"], []
    with torch.no_grad():
        for t in range(steps):
            step = (inputs[n][:, t : t + 1] for n in NAMES[:5])
            o, state = fn(*step, initial_state=state, output_final_state=True)
            assert o.shape == (B, 1, Hv, d) and state.dtype == torch.float32
            outputs.append(o)
        o_ref, S_ref = torch_path(*(inputs[n] for n in NAMES[:5]), initial_state=inputs["initial_state"],
                                  output_final_state=True)
    assert_close(torch.cat(outputs, dim=1), o_ref, F32_TOL, f"{kind} decode outputs")
    assert_close(state, S_ref, F32_TOL, f"{kind} decode final state")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("decoding", [False, True], ids=["chunk", "recurrent"])
def test_fused_gate_matches_torch_path(kind, decoding):
    """g as the gate's raw input with A_log and dt_bias (fla computes -exp(A_log) * softplus(g + dt_bias) inside its
    chunk and recurrent kernels) against the log decay computed beforehand by `ops.gate_log_decay`: outputs, final
    states and the raw gate's gradient against the torch path; (chunked) the gradients of A_log and dt_bias against
    fla's own kernels given that log decay, with autograd through `gate_log_decay`.

    A_log's and dt_bias's gradients are sums over every token of dg_t * dg_t/dparam: against the torch path, dg's TF32
    error (F32_TOL of its largest value, `test_fla_matches_torch_path`) does not hold relative to the largest sum
    where the terms cancel (an H200 run: two GDN heads of d(A_log) 1-3% off, the others 1e-4). Against fla unfused,
    both sides run the same chunk kernels on the same inputs, so what differs is the fusion of the gate."""
    kda = kind == "kda"
    Hk, Hv, d = (4, 4, 64) if kda else (4, 8, 64)
    B, T = (3, 1) if decoding else (2, 500)
    inputs = make_inputs(kda=kda, B=B, T=T, Hk=Hk, Hv=Hv, d=d, n_states=B, dtype=torch.float32, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    raw = torch.randn(inputs["g"].shape, generator=gen, device="cuda")
    A_log = torch.rand(Hv, generator=gen, device="cuda") * 2  # A in [1, e^2]
    dt_bias = torch.randn(Hv * d if kda else Hv, generator=gen, device="cuda") - 2
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    others = [inputs[n] for n in ("q", "k", "v")]
    runs = {}
    for path in ("fused", "fla", "torch"):
        leaves = [x.clone().requires_grad_(not decoding) for x in (raw, A_log, dt_bias)]
        with torch.set_grad_enabled(not decoding):
            if path == "fused":
                o, S = fn(*others, leaves[0], inputs["beta"], initial_state=inputs["initial_state"],
                          output_final_state=True, A_log=leaves[1], dt_bias=leaves[2])
            else:
                o, S = (fn if path == "fla" else torch_path)(
                    *others, ops.gate_log_decay(*leaves), inputs["beta"], initial_state=inputs["initial_state"],
                    output_final_state=True)
            if not decoding:
                (o.sum() + S.sum()).backward()
        runs[path] = (o.detach(), S.detach(), [x.grad for x in leaves])
    (o, S, grads), (o_ref, S_ref, grads_ref) = runs["fused"], runs["torch"]
    assert_close(o, o_ref, F32_TOL, f"{kind} fused-gate output")
    assert_close(S, S_ref, F32_TOL, f"{kind} fused-gate final state")
    if not decoding:
        assert_close(grads[0], grads_ref[0], F32_TOL, f"{kind} d(raw gate)")
        for name, got, ref in zip(("A_log", "dt_bias"), grads[1:], runs["fla"][2][1:]):
            assert_close(got, ref, F32_TOL, f"{kind} d({name}) against fla given the log decay")

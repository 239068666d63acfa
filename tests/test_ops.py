"""CPU tests of `hybrid_linear_models.ops` against plain references written here, in float64.

The references below are deliberately naive (one token at a time, one formula per line of DESIGN.md) and share no
code with the package: if the package and a reference disagree, the package is wrong.

Tolerances:
- float32 inputs: errors are measured relative to the largest magnitude of the reference tensor (outputs, states and
  every gradient alike) and must stay below `F32_TOL` = 1e-5. The chunked kernels compute in float32 (unit roundoff
  6e-8); inside a 64-token chunk every value is a sum of up to 64 dk-long dot products pushed through a 64x64
  triangular solve, and the state is carried through a few chunks. That accumulates to ~1e-6 of the largest magnitude
  in practice (the worst case measured over this file is 2e-6), so 1e-5 leaves headroom for other BLAS builds while
  still catching any real mistake (a wrong index, a dropped decay or a missing gradient term shows as >= 1e-3).
- bfloat16 inputs: the reference runs on the bf16-rounded inputs, upcast, so only the kernels' own rounding counts.
  Outputs and gradients come back in bfloat16 (8 bits of mantissa: 4e-3 relative rounding, plus the incoming
  gradient rounded to bf16), hence `BF16_TOL` = 2e-2. The final state is float32, computed in float32 from exactly
  representable inputs, so it keeps the float32 tolerance.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybrid_linear_models import fla_backend, kernels_delta_rule, ops
from distributed_helpers import SUBPROCESS_TIMEOUT
from numerics import assert_close

F32_TOL = 1e-5
BF16_TOL = 2e-2
L2_EPS = 1e-6

DOC_LENGTHS = [1, 63, 64, 130]  # a single token, one short of a chunk, exactly a chunk, several chunks


# ------------------------------------------------------------------------------------------------------ references


def reference_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True):
    """Token-by-token delta rule, one sequence batch [B, T, ...], in the inputs' dtype (float64 here).

    Per token t and value head j (key head j // (Hv / Hk)):
        S <- exp(g) S  (per key channel when g has a dk axis);  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
    """
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    key_head = torch.arange(Hv) // (Hv // Hk)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q * (dk**-0.5 if scale is None else scale)
    q, k = q[:, :, key_head], k[:, :, key_head]  # [B, T, Hv, dk]
    per_channel = g.dim() == 4
    S = initial_state if initial_state is not None else q.new_zeros(B, Hv, dk, dv)
    outputs = []
    for t in range(T):
        decay = g[:, t].exp()
        S = S * (decay[..., :, None] if per_channel else decay[..., None, None])
        prediction = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u = beta[:, t, :, None] * (v[:, t] - prediction)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, Hv, dv)
    return o, S


def reference_packed_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None, **kwargs):
    """Each document of the packed row [1, T, ...] run alone through `reference_delta_rule`."""
    bounds = cu_seqlens.tolist()
    outputs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc = [x[:, start:end] for x in (q, k, v, g, beta)]
        h0 = initial_state[i : i + 1] if initial_state is not None else None
        o, S = reference_delta_rule(*doc, initial_state=h0, **kwargs)
        outputs.append(o)
        finals.append(S)
    return torch.cat(outputs, dim=1), torch.cat(finals, dim=0)


def reference_conv(x, weight, activation, initial_state):
    """Explicit loop: out_t = act(sum_i w[:, i] * ext[t + i]) over ext = [state (K-1 inputs, oldest first) | x]."""
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    B, T, C = x.shape
    K = weight.shape[1]
    state = initial_state if initial_state is not None else x.new_zeros(B, C, K - 1)
    ext = torch.cat([state.transpose(1, 2), x], dim=1)  # [B, K-1+T, C]
    out = [sum(weight[:, i] * ext[:, t + i] for i in range(K)) for t in range(T)]
    out = torch.stack(out, dim=1) if out else x.new_zeros(B, 0, C)
    if activation in ("silu", "swish"):
        out = out * torch.sigmoid(out)
    return out, ext[:, T:].transpose(1, 2)


def reference_conv_with_conv1d(x, weight, activation):
    """The same convolution through F.conv1d with K-1 zeros of left padding (no state)."""
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    K = weight.shape[1]
    out = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), weight.unsqueeze(1), groups=x.shape[2]).transpose(1, 2)
    return F.silu(out) if activation else out


# --------------------------------------------------------------------------------------------------------- helpers


def make_delta_inputs(*, kda, B, T, Hk, Hv, dk, dv, with_state, n_states=None, g_sampler=None, seed=0):
    """float64 inputs with realistic gates: beta = sigmoid(randn), g = -softplus(randn + 1) * 0.5, about
    [-2.5, -0.01], median -0.65 (the range of GDN's -exp(A_log) softplus(a + dt_bias))."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g_shape = (B, T, Hv, dk) if kda else (B, T, Hv)
    inputs = {
        "q": randn(B, T, Hk, dk),
        "k": randn(B, T, Hk, dk),
        "v": randn(B, T, Hv, dv),
        "g": g_sampler(g_shape, gen) if g_sampler else -F.softplus(randn(*g_shape) + 1.0) * 0.5,
        "beta": torch.sigmoid(randn(B, T, Hv)),
    }
    if with_state:
        inputs["initial_state"] = randn(n_states or B, Hv, dk, dv) * 0.5
    return inputs


def loss_weights(o_shape, state_shape, seed=1):
    """A random linear functional of the output and of the final state."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*o_shape, generator=gen, dtype=torch.float64),
            torch.randn(*state_shape, generator=gen, dtype=torch.float64))


def run_with_grads(fn, inputs, weights, **kwargs):
    """Calls fn(q, k, v, g, beta, initial_state=..., output_final_state=True, **kwargs) on leaf copies of `inputs`,
    backpropagates sum(o * Wo) + sum(S * Ws) and returns (o, S, {name: grad})."""
    leaves = {name: x.detach().clone().requires_grad_() for name, x in inputs.items()}
    o, S = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
              initial_state=leaves.get("initial_state"), output_final_state=True, **kwargs)
    w_o, w_s = weights
    ((o.double() * w_o).sum() + (S.double() * w_s).sum()).backward()
    return o.detach(), S.detach(), {name: x.grad for name, x in leaves.items()}


def reference_with_grads(inputs, weights, cu_seqlens=None, **kwargs):
    def fn(q, k, v, g, beta, initial_state=None, output_final_state=True, **kw):
        if cu_seqlens is None:
            return reference_delta_rule(q, k, v, g, beta, initial_state=initial_state, **kw)
        return reference_packed_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=initial_state, **kw)

    return run_with_grads(fn, {n: x.double() for n, x in inputs.items()}, weights, **kwargs)


def compare(got, ref, tol, label, state_tol=None):
    o, S, grads = got
    o_ref, S_ref, grads_ref = ref
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert S.dtype == torch.float32, f"{label}: the final state must be float32, got {S.dtype}"
    assert_close(o, o_ref, tol, f"{label}: output")
    assert_close(S, S_ref, state_tol or tol, f"{label}: final state")
    for name, grad_ref in grads_ref.items():
        assert grads[name] is not None, f"{label}: no gradient for {name}"
        assert_close(grads[name], grad_ref, tol, f"{label}: d{name}")


def cast_inputs(inputs, dtype):
    """The delta-rule inputs in `dtype`; the state stays float32 (its contract)."""
    return {n: x.to(torch.float32 if n == "initial_state" else dtype) for n, x in inputs.items()}


# --------------------------------------------------------------------------------------- delta rule vs reference

DELTA_CASES = (
    [("gdn", T, r, s) for T in (1, 63, 64, 65, 200) for r in (1, 4) for s in (False, True)]
    + [("kda", T, 1, s) for T in (1, 63, 64, 65, 200) for s in (False, True)]
    + [("kda", 65, 2, True)]  # KDA with grouped value heads: the layout allows it
)


@pytest.mark.parametrize("kind,T,ratio,with_state", DELTA_CASES,
                         ids=[f"{k}-T{T}-r{r}-{'h0' if s else 'zero'}" for k, T, r, s in DELTA_CASES])
def test_delta_rule_float32_matches_reference(kind, T, ratio, with_state):
    kda = kind == "kda"
    Hk = 2
    inputs = make_delta_inputs(kda=kda, B=2, T=T, Hk=Hk, Hv=Hk * ratio, dk=32, dv=16, with_state=with_state)
    weights = loss_weights(inputs["v"].shape, (2, Hk * ratio, 32, 16))
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    got = run_with_grads(fn, cast_inputs(inputs, torch.float32), weights)
    assert got[0].dtype == torch.float32
    compare(got, reference_with_grads(cast_inputs(inputs, torch.float32), weights), F32_TOL, f"{kind} T={T}")


BF16_CASES = [("gdn", 1, 4), ("gdn", 65, 4), ("gdn", 200, 1), ("kda", 16, 1), ("kda", 130, 1)]


@pytest.mark.parametrize("kind,T,ratio", BF16_CASES, ids=[f"{k}-T{T}-r{r}" for k, T, r in BF16_CASES])
def test_delta_rule_bfloat16_matches_reference(kind, T, ratio):
    kda = kind == "kda"
    inputs = make_delta_inputs(kda=kda, B=2, T=T, Hk=2, Hv=2 * ratio, dk=32, dv=32, with_state=True, seed=3)
    bf16 = cast_inputs(inputs, torch.bfloat16)
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    got = run_with_grads(fn, bf16, weights)
    assert got[0].dtype == torch.bfloat16
    assert all(got[2][n].dtype == bf16[n].dtype for n in bf16)
    ref = reference_with_grads(bf16, weights)  # on the bf16-rounded values, upcast
    compare(got, ref, BF16_TOL, f"{kind} bf16 T={T}", state_tol=F32_TOL)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T", [9, 100])
def test_delta_rule_scale_and_no_l2norm(kind, T):
    """use_qk_l2norm=False and an explicit scale. Keys of norm ~0.7 keep the un-normalised recurrence contracting."""
    kda = kind == "kda"
    inputs = make_delta_inputs(kda=kda, B=1, T=T, Hk=2, Hv=4 if not kda else 2, dk=16, dv=16, with_state=True,
                               seed=5)
    inputs["k"] = inputs["k"] * 0.18
    inputs["q"] = inputs["q"] * 0.3
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    f32 = cast_inputs(inputs, torch.float32)
    got = run_with_grads(fn, f32, weights, scale=0.7, use_qk_l2norm=False)
    ref = reference_with_grads(f32, weights, scale=0.7, use_qk_l2norm=False)
    compare(got, ref, F32_TOL, f"{kind} no-l2norm T={T}")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_delta_rule_l2norm_epsilon(kind):
    """q and k with squared norms ~3e-5, where the 1e-6 inside the L2 norm changes the result by ~2%."""
    kda = kind == "kda"
    inputs = make_delta_inputs(kda=kda, B=1, T=70, Hk=2, Hv=2, dk=32, dv=16, with_state=True, seed=6)
    inputs["q"] = inputs["q"] * 1e-3
    inputs["k"] = inputs["k"] * 1e-3
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    f32 = cast_inputs(inputs, torch.float32)
    compare(run_with_grads(fn, f32, weights), reference_with_grads(f32, weights), F32_TOL, f"{kind} small q, k")


def test_delta_rule_without_final_state_returns_none():
    inputs = cast_inputs(make_delta_inputs(kda=False, B=1, T=70, Hk=2, Hv=2, dk=16, dv=16, with_state=False),
                         torch.float32)
    o, S = ops.gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    assert S is None and o.shape == inputs["v"].shape
    o_ref, _ = reference_delta_rule(*(inputs[n].double() for n in ("q", "k", "v", "g", "beta")))
    assert_close(o, o_ref, F32_TOL, "output")


# -------------------------------------------------------------------------------------------- packed sequences


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_packed_equals_separate_documents(kind, index_dtype):
    """Documents packed with cu_seqlens, each with its own initial state, give what each gives run alone: outputs,
    final states and gradients. Checked both against ops run per document and against the float64 reference."""
    kda = kind == "kda"
    Hk, Hv, dk, dv = 2, (2 if kda else 4), 16, 32
    T = sum(DOC_LENGTHS)
    cu_seqlens = torch.tensor([0] + torch.tensor(DOC_LENGTHS).cumsum(0).tolist(), dtype=index_dtype)
    N = len(DOC_LENGTHS)
    inputs = cast_inputs(
        make_delta_inputs(kda=kda, B=1, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, with_state=True, n_states=N, seed=7),
        torch.float32)
    weights = loss_weights(inputs["v"].shape, (N, Hv, dk, dv))
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    packed = run_with_grads(fn, inputs, weights, cu_seqlens=cu_seqlens)

    # the same documents run alone, then laid back side by side
    bounds = cu_seqlens.tolist()
    alone = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc = {n: (x[i : i + 1] if n == "initial_state" else x[:, start:end]) for n, x in inputs.items()}
        doc_weights = (weights[0][:, start:end], weights[1][i : i + 1])
        alone.append(run_with_grads(fn, doc, doc_weights))
    separate = (
        torch.cat([a[0] for a in alone], dim=1),
        torch.cat([a[1] for a in alone], dim=0),
        {n: torch.cat([a[2][n] for a in alone], dim=0 if n == "initial_state" else 1) for n in inputs},
    )
    compare(packed, separate, F32_TOL, f"{kind} packed vs alone")
    compare(packed, reference_with_grads(inputs, weights, cu_seqlens=cu_seqlens.long()), F32_TOL,
            f"{kind} packed vs reference")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_packed_without_initial_state_and_empty_document(kind):
    """Zero initial states, and an empty document (cu_seqlens may repeat a boundary): its final state is its initial
    state (here zero), and it disturbs no neighbour."""
    kda = kind == "kda"
    lengths = [5, 0, 70]
    cu_seqlens = torch.tensor([0, 5, 5, 75])
    inputs = cast_inputs(make_delta_inputs(kda=kda, B=1, T=75, Hk=2, Hv=2, dk=16, dv=16, with_state=False, seed=8),
                         torch.float32)
    weights = loss_weights(inputs["v"].shape, (len(lengths), 2, 16, 16))
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    got = run_with_grads(fn, inputs, weights, cu_seqlens=cu_seqlens)
    compare(got, reference_with_grads(inputs, weights, cu_seqlens=cu_seqlens), F32_TOL, f"{kind} empty document")
    assert torch.equal(got[1][1], torch.zeros_like(got[1][1]))


# ------------------------------------------------------------------------------------------------ decay regimes


def _uniform(low, high):
    return lambda shape, gen: -(torch.rand(*shape, generator=gen, dtype=torch.float64) * (high - low) + low)


def _strong_channels(shape, gen):
    """Half of the key channels decay by exp(-50..-200) per token, the other half barely decay (-0.1..0)."""
    g = _uniform(0.0, 0.1)(shape, gen)
    g[..., ::2] = _uniform(50.0, 200.0)(g[..., ::2].shape, gen)
    return g


DECAY_REGIMES = {
    "strong": (_uniform(50.0, 200.0), False),  # every block range exceeds the factorisation limit: exact path
    "strong-channels": (_strong_channels, False),
    "medium": (_uniform(1.0, 8.0), None),  # some blocks factorised, at various block sizes
    "moderate": (_uniform(0.0, 0.1), True),  # the whole 64-token chunk factorised at once
}


@pytest.mark.parametrize("regime", list(DECAY_REGIMES))
def test_kda_decay_regimes(regime, monkeypatch):
    sampler, factorised = DECAY_REGIMES[regime]
    seen = []
    original = kernels_delta_rule._diagonal_block_size

    def spy(G):
        size, fits = original(G)
        seen.append(fits)
        return size, fits

    monkeypatch.setattr(kernels_delta_rule, "_diagonal_block_size", spy)
    inputs = cast_inputs(make_delta_inputs(kda=True, B=1, T=150, Hk=2, Hv=2, dk=16, dv=16, with_state=True,
                                           g_sampler=sampler, seed=11), torch.float32)
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    o, S, grads = run_with_grads(ops.kimi_delta_rule, inputs, weights)
    assert seen, "the chunked per-channel kernel did not run"
    if factorised is not None:  # the regime drives the path it is meant to exercise
        assert all(fits == factorised for fits in seen), seen
    for name, x in [("o", o), ("S", S), *grads.items()]:
        assert torch.isfinite(x).all(), f"{regime}: non-finite {name}"
    o_ref, S_ref, grads_ref = reference_with_grads(inputs, weights)
    assert_close(o, o_ref, F32_TOL, f"{regime}: output")
    assert_close(S, S_ref, F32_TOL, f"{regime}: final state")
    for name in ("q", "k", "v", "beta", "initial_state"):
        assert_close(grads[name], grads_ref[name], F32_TOL, f"{regime}: d{name}")
    if regime == "strong":
        # Every decay factor is below exp(-50), so the true dL/dg is ~1e-22 while the terms that cancel in it are
        # O(1): float32 cannot resolve it relative to itself. It must still be negligible on the scale of the
        # other gradients (the loss's sensitivity to g is nil).
        scale = max(grads_ref[n].abs().max().item() for n in ("q", "k", "v", "beta"))
        err = (grads["g"].double() - grads_ref["g"]).abs().max().item()
        assert err <= F32_TOL * scale, f"dg error {err:.3e} vs gradient scale {scale:.3e}"
    else:
        assert_close(grads["g"], grads_ref["g"], F32_TOL, f"{regime}: dg")


def test_kda_strong_decay_bursts_in_time():
    """Moderate decays interrupted every 7th token by a decay of exp(-50..-200) on all channels.

    The chunked form works with log-decays accumulated over the chunk (here down to ~-1000), and differences of such
    float32 sums keep only ~ulp(1000) = 6e-5 of absolute precision, which becomes the relative error of the decay
    factors of the moderate tokens. The measured error is ~4e-5 of the largest magnitude (the same algorithm in
    float64 matches to 1e-15, and the token-by-token float32 form to 2e-7): a known limit of chunked float32
    kernels (fla's accumulate the same way), pinned here at 2e-4 so any regression beyond it shows.
    """

    def bursts(shape, gen):
        g = _uniform(0.0, 0.1)(shape, gen)
        g[:, ::7] = _uniform(50.0, 200.0)(g[:, ::7].shape, gen)
        return g

    inputs = cast_inputs(make_delta_inputs(kda=True, B=1, T=130, Hk=2, Hv=2, dk=32, dv=16, with_state=True,
                                           g_sampler=bursts, seed=0), torch.float32)
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    got = run_with_grads(ops.kimi_delta_rule, inputs, weights)
    compare(got, reference_with_grads(inputs, weights), 2e-4, "decay bursts")


def test_gdn_strong_decay_stays_finite_and_matches():
    inputs = cast_inputs(make_delta_inputs(kda=False, B=1, T=130, Hk=2, Hv=4, dk=16, dv=16, with_state=True,
                                           g_sampler=_uniform(50.0, 200.0), seed=12), torch.float32)
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    o, S, grads = run_with_grads(ops.gated_delta_rule, inputs, weights)
    o_ref, S_ref, grads_ref = reference_with_grads(inputs, weights)
    assert_close(o, o_ref, F32_TOL, "output")
    assert_close(S, S_ref, F32_TOL, "final state")
    for name in ("q", "k", "v", "beta", "initial_state"):
        assert_close(grads[name], grads_ref[name], F32_TOL, f"d{name}")
    assert torch.isfinite(grads["g"]).all()  # true dg ~1e-24: see test_kda_decay_regimes


# ------------------------------------------------------------------------------------ recurrent vs chunked path


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_recurrent_path_agrees_with_chunked_path(kind, monkeypatch):
    """ops sends T <= RECURRENT_MAX_TOKENS (16) unpacked tokens to the token-by-token kernel; the chunked kernel on
    the same inputs must agree, outputs, states and gradients."""
    calls = []
    recurrent = ops.recurrent_delta_rule
    monkeypatch.setattr(ops, "recurrent_delta_rule", lambda *a, **kw: calls.append(1) or recurrent(*a, **kw))
    kda = kind == "kda"
    T = ops.RECURRENT_MAX_TOKENS
    assert T == 16
    inputs = cast_inputs(make_delta_inputs(kda=kda, B=2, T=T, Hk=2, Hv=2 if kda else 4, dk=32, dv=16,
                                           with_state=True, seed=13), torch.float32)
    weights = loss_weights(inputs["v"].shape, inputs["initial_state"].shape)
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    via_ops = run_with_grads(fn, inputs, weights)
    assert calls, "ops did not take the recurrent path for 16 tokens"

    def chunked(q, k, v, g, beta, initial_state=None, output_final_state=True):
        return kernels_delta_rule.chunk_delta_rule(q, k, v, g, beta, q.shape[-1] ** -0.5, initial_state,
                                                   output_final_state)

    compare(via_ops, run_with_grads(chunked, inputs, weights), F32_TOL, f"{kind} recurrent vs chunked")
    compare(via_ops, reference_with_grads(inputs, weights), F32_TOL, f"{kind} recurrent vs reference")


# ---------------------------------------------------------------------------------------------- causal conv1d


def _conv_leaves(x, weight, h0):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, h0)]


def _conv_loss(out, final, seed=21):
    gen = torch.Generator().manual_seed(seed)
    w_o = torch.randn(*out.shape, generator=gen, dtype=torch.float64)
    w_s = torch.randn(*final.shape, generator=gen, dtype=torch.float64)
    return (out.double() * w_o).sum() + (final.double() * w_s).sum()


CONV_CASES = [(T, K, act, wdim, s) for T, K in ((1, 4), (5, 4), (37, 4), (37, 2))
              for act in ("silu", None) for wdim in (2, 3) for s in (False, True)]


@pytest.mark.parametrize("T,K,activation,weight_dims,with_state", CONV_CASES)
def test_conv_matches_reference(T, K, activation, weight_dims, with_state):
    gen = torch.Generator().manual_seed(T * 10 + K)
    B, C = 2, 6
    x = torch.randn(B, T, C, generator=gen)
    weight = torch.randn(C, 1, K, generator=gen) if weight_dims == 3 else torch.randn(C, K, generator=gen)
    h0 = torch.randn(B, C, K - 1, generator=gen) if with_state else None

    xs, ws, hs = _conv_leaves(x, weight, h0)
    out, final = ops.causal_conv1d(xs, ws, activation=activation, initial_state=hs, output_final_state=True)
    _conv_loss(out, final).backward()
    xr, wr, hr = _conv_leaves(x.double(), weight.double(), h0.double() if with_state else None)
    out_ref, final_ref = reference_conv(xr, wr, activation, hr)
    _conv_loss(out_ref, final_ref).backward()

    assert out.shape == (B, T, C) and final.shape == (B, C, K - 1)
    assert_close(out, out_ref, F32_TOL, "conv output")
    assert torch.equal(final.double(), final_ref.detach()), "the final state is a copy of the last K-1 inputs"
    assert_close(xs.grad, xr.grad, F32_TOL, "conv dx")
    assert_close(ws.grad, wr.grad, F32_TOL, "conv dweight")
    assert ws.grad.shape == weight.shape
    if with_state:
        assert_close(hs.grad, hr.grad, F32_TOL, "conv dinitial_state")
    else:  # the independent F.conv1d form agrees too
        assert_close(out, reference_conv_with_conv1d(x.double(), weight.double(), activation), F32_TOL, "conv1d")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_packed_equals_separate(index_dtype, with_state):
    gen = torch.Generator().manual_seed(31)
    C, K = 8, 4
    lengths = DOC_LENGTHS + [2]  # a document shorter than K-1 too
    T, N = sum(lengths), len(lengths)
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=index_dtype)
    x = torch.randn(1, T, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    h0 = torch.randn(N, C, K - 1, generator=gen) if with_state else None

    xs, ws, hs = _conv_leaves(x, weight, h0)
    out, final = ops.causal_conv1d(xs, ws, initial_state=hs, output_final_state=True, cu_seqlens=cu_seqlens)
    _conv_loss(out, final).backward()

    # the documents one by one, through ops and through the reference, with the same loss weights
    xa, wa, ha = _conv_leaves(x, weight, h0)
    xr, wr, hr = _conv_leaves(x.double(), weight.double(), h0.double() if with_state else None)
    bounds = cu_seqlens.tolist()
    pieces, ref_pieces = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = ha[i : i + 1] if with_state else None
        pieces.append(ops.causal_conv1d(xa[:, start:end], wa, initial_state=state, output_final_state=True))
        ref_state = hr[i : i + 1] if with_state else None
        ref_pieces.append(reference_conv(xr[:, start:end], wr, "silu", ref_state))
    out_a, final_a = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 0)
    out_r, final_r = torch.cat([p[0] for p in ref_pieces], 1), torch.cat([p[1] for p in ref_pieces], 0)
    _conv_loss(out_a, final_a).backward()
    _conv_loss(out_r, final_r).backward()

    for label, (o2, f2, x2, w2, h2), tol in (("alone", (out_a, final_a, xa, wa, ha), F32_TOL),
                                             ("reference", (out_r, final_r, xr, wr, hr), F32_TOL)):
        assert_close(out, o2, tol, f"packed conv vs {label}: output")
        assert_close(final, f2, tol, f"packed conv vs {label}: final state")
        assert_close(xs.grad, x2.grad, tol, f"packed conv vs {label}: dx")
        assert_close(ws.grad, w2.grad, tol, f"packed conv vs {label}: dweight")
        if with_state:
            assert_close(hs.grad, h2.grad, tol, f"packed conv vs {label}: dinitial_state")


@pytest.mark.parametrize("first", [1, 2, 3, 40])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_state_continuation(first, with_state):
    """T1 tokens, then T2 more from the first call's final state, equal one call over T1 + T2 (also T1 < K-1)."""
    gen = torch.Generator().manual_seed(41 + first)
    B, T, C, K = 2, 50, 5, 4
    x = torch.randn(B, T, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    h0 = torch.randn(B, C, K - 1, generator=gen) if with_state else None
    whole, whole_final = ops.causal_conv1d(x, weight, initial_state=h0, output_final_state=True)
    part1, state = ops.causal_conv1d(x[:, :first], weight, initial_state=h0, output_final_state=True)
    part2, final = ops.causal_conv1d(x[:, first:], weight, initial_state=state, output_final_state=True)
    assert_close(torch.cat([part1, part2], 1), whole, 1e-6, "continued output")
    assert torch.equal(final, whole_final)
    ref, ref_final = reference_conv(x.double(), weight.double(), "silu", h0.double() if with_state else None)
    assert_close(whole, ref, F32_TOL, "output vs reference")
    assert torch.equal(whole_final.double(), ref_final)


def test_conv_without_final_state_returns_none():
    x, weight = torch.randn(1, 9, 3), torch.randn(3, 4)
    out, final = ops.causal_conv1d(x, weight)
    assert final is None
    assert_close(out, reference_conv_with_conv1d(x.double(), weight.double(), "silu"), F32_TOL, "output")


# ---------------------------------------------------------------------------------------------- gated RMSNorm


@pytest.mark.parametrize("activation", ["silu", "swish", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(activation, dtype):
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(3, 7, 32, generator=gen).to(dtype)
    gate = torch.randn(3, 7, 32, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    eps = 1e-5
    out = ops.gated_rms_norm(x, gate, weight, eps=eps, activation=activation)
    assert out.dtype == dtype and out.shape == x.shape
    xd, gd, wd = x.double(), gate.double(), weight.double()
    act = gd * torch.sigmoid(gd) if activation in ("silu", "swish") else torch.sigmoid(gd)
    expected = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * wd * act
    assert_close(out, expected, F32_TOL if dtype == torch.float32 else 8e-3, f"gated_rms_norm {activation}")


def test_gated_rms_norm_eps_matters():
    x = torch.full((1, 4), 1e-3)
    gate, weight = torch.full((1, 4), 10.0), torch.ones(4)
    out = ops.gated_rms_norm(x, gate, weight, eps=1e-6, activation="sigmoid")
    expected = 1e-3 / (1e-6 + 1e-6) ** 0.5 * torch.sigmoid(torch.tensor(10.0)).item()
    assert_close(out, torch.full((1, 4), expected, dtype=torch.float64), 1e-6, "eps")


# ------------------------------------------------------------------------------------------------- bad inputs


def _good(kda=False, B=1, T=8, Hk=2, Hv=4, dk=8, dv=8):
    q, k = torch.randn(B, T, Hk, dk), torch.randn(B, T, Hk, dk)
    v = torch.randn(B, T, Hv, dv)
    g = -torch.rand(B, T, Hv, dk) if kda else -torch.rand(B, T, Hv)
    return dict(q=q, k=k, v=v, g=g, beta=torch.rand(B, T, Hv))


def _gdn(**changes):
    args = _good()
    kwargs = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return lambda: ops.gated_delta_rule(*args.values(), **kwargs)


def _kda(**changes):
    args = _good(kda=True)
    kwargs = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return lambda: ops.kimi_delta_rule(*args.values(), **kwargs)


def _conv(**changes):
    args = dict(x=torch.randn(1, 8, 6), weight=torch.randn(6, 4))
    kwargs = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return lambda: ops.causal_conv1d(*args.values(), **kwargs)


BAD_INPUTS = {
    "q 3 dims": (_gdn(q=torch.randn(1, 8, 16)), r"\bq must have 4 dims"),
    "k 3 dims": (_gdn(k=torch.randn(1, 8, 16)), r"\bk must have 4 dims"),
    "k shape": (_gdn(k=torch.randn(1, 8, 2, 4)), r"\bk must have the shape of q"),
    "v batch": (_gdn(v=torch.randn(2, 8, 4, 8)), r"\bv must be \[B, T, Hv, dv\]"),
    "Hv not multiple": (_gdn(v=torch.randn(1, 8, 3, 8), g=-torch.rand(1, 8, 3), beta=torch.rand(1, 8, 3)),
                        r"value heads \(v\.shape\[2\] = 3\).*key heads \(q\.shape\[2\] = 2\)"),
    "gdn per-channel g": (_gdn(g=-torch.rand(1, 8, 4, 8)), r"gated_delta_rule: g must be \[B, T, Hv\]"),
    "kda per-head g": (_kda(g=-torch.rand(1, 8, 4)), r"kimi_delta_rule: g must be \[B, T, Hv, dk\]"),
    "g heads": (_gdn(g=-torch.rand(1, 8, 2)), r"\bg must be"),
    "beta shape": (_gdn(beta=torch.rand(1, 8, 2)), r"\bbeta must be \[B, T, Hv\]"),
    "beta per channel": (_kda(beta=torch.rand(1, 8, 4, 8)), r"\bbeta must be"),
    "cu_seqlens batch": (lambda: ops.gated_delta_rule(*_good(B=2).values(), cu_seqlens=torch.tensor([0, 8])),
                         r"cu_seqlens.*batch size must be 1"),
    "cu_seqlens end": (_gdn(cu_seqlens=torch.tensor([0, 3, 7])), r"cu_seqlens must start at 0.*end at T=8"),
    "cu_seqlens start": (_gdn(cu_seqlens=torch.tensor([1, 3, 8])), r"cu_seqlens must start at 0"),
    "cu_seqlens decreasing": (_gdn(cu_seqlens=torch.tensor([0, 5, 3, 8])), r"cu_seqlens .*never decrease"),
    "cu_seqlens float": (_gdn(cu_seqlens=torch.tensor([0.0, 8.0])), r"cu_seqlens must be a 1-D int32/int64"),
    "cu_seqlens 2-D": (_gdn(cu_seqlens=torch.tensor([[0, 8]])), r"cu_seqlens must be a 1-D"),
    "initial_state shape": (_gdn(initial_state=torch.zeros(1, 2, 8, 8)), r"initial_state must be \[N, Hv, dk, dv\]"),
    "initial_state docs": (_gdn(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 4, 8, 8)),
                           r"initial_state must be \[N, Hv, dk, dv\] = \(2, 4, 8, 8\)"),
    "kda initial_state": (_kda(initial_state=torch.zeros(1, 4, 8, 7)), r"initial_state must be"),
    "A_log shape": (_gdn(A_log=torch.zeros(2)), r"A_log must be \[Hv\] = \(4,\)"),
    "gdn dt_bias shape": (_gdn(A_log=torch.zeros(4), dt_bias=torch.zeros(32)), r"dt_bias must be \[Hv\]"),
    "kda dt_bias shape": (_kda(A_log=torch.zeros(4), dt_bias=torch.zeros(4)), r"dt_bias must be \[Hv \* dk\]"),
    "dt_bias without A_log": (_gdn(dt_bias=torch.zeros(4)), r"dt_bias is only used with A_log"),
    "conv x dims": (_conv(x=torch.randn(8, 6)), r"\bx must be \[B, T, C\]"),
    "conv weight channels": (_conv(weight=torch.randn(5, 4)), r"\bweight must be \[C, K\] or \[C, 1, K\]"),
    "conv weight 3-D": (_conv(weight=torch.randn(6, 2, 4)), r"\bweight must be"),
    "conv initial_state": (_conv(initial_state=torch.zeros(1, 6, 4)), r"initial_state must be \[N, C, K-1\]"),
    "conv initial_state docs": (_conv(cu_seqlens=torch.tensor([0, 2, 8]), initial_state=torch.zeros(1, 6, 3)),
                                r"initial_state must be \[N, C, K-1\] = \(2, 6, 3\)"),
    "conv activation": (_conv(activation="relu"), r"activation must be 'silu', 'swish' or None, got 'relu'"),
    "conv cu_seqlens end": (_conv(cu_seqlens=torch.tensor([0, 7])), r"cu_seqlens must start at 0"),
    "conv cu_seqlens float": (_conv(cu_seqlens=torch.tensor([0.0, 8.0])), r"cu_seqlens must be a 1-D"),
    "norm activation": (lambda: ops.gated_rms_norm(torch.randn(2, 4), torch.randn(2, 4), torch.ones(4),
                                                   activation="relu"), r"activation must be one of"),
    "norm gate shape": (lambda: ops.gated_rms_norm(torch.randn(2, 4), torch.randn(2, 3), torch.ones(4)),
                        r"gate must have the shape of x"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_argument(case):
    call, pattern = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=pattern):
        call()


def test_good_inputs_pass_validation():
    """The baselines the bad inputs are derived from are valid (so each failure above is the named argument's)."""
    _gdn()()
    _kda()()
    _gdn(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32), initial_state=torch.zeros(2, 4, 8, 8))()
    _conv()()
    _conv(weight=torch.randn(6, 1, 4), activation=None, cu_seqlens=torch.tensor([0, 2, 8]),
          initial_state=torch.zeros(2, 6, 3))()


# ------------------------------------------------------------------------------------------ import and logging


@pytest.mark.slow  # a fresh interpreter importing the package
def test_import_does_not_import_triton_or_fla():
    code = ("import sys, hybrid_linear_models.ops; "
            "bad = [m for m in ('triton', 'fla') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr


def test_torch_path_is_announced_once(caplog, monkeypatch):
    monkeypatch.setattr(fla_backend, "_announced", set())  # as if no call had run yet in this process
    args = _good()
    with caplog.at_level(logging.INFO, logger="hybrid_linear_models.fla_backend"):
        ops.gated_delta_rule(*args.values())
        ops.gated_delta_rule(*args.values())
        ops.kimi_delta_rule(*_good(kda=True).values())
    records = [r for r in caplog.records if r.name == "hybrid_linear_models.fla_backend"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert "pure-PyTorch" in message and "cpu" in message


def test_empty_sequences_pass_the_state_through():
    from hybrid_linear_models import ops

    q = torch.zeros(2, 0, 2, 8)
    v = torch.zeros(2, 0, 4, 8)
    state = torch.randn(2, 4, 8, 8)
    o, final = ops.gated_delta_rule(q, q, v, torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), initial_state=state,
                                    output_final_state=True)
    assert o.shape == v.shape and torch.equal(final, state)
    o, final = ops.kimi_delta_rule(q, q, v[:, :, :2], torch.zeros(2, 0, 2, 8), torch.zeros(2, 0, 2),
                                   output_final_state=True)
    assert o.shape == (2, 0, 2, 8) and torch.equal(final, torch.zeros(2, 2, 8, 8))
    conv_state = torch.randn(2, 6, 3)
    out, final = ops.causal_conv1d(torch.zeros(2, 0, 6), torch.randn(6, 4), initial_state=conv_state,
                                   output_final_state=True)
    assert out.shape == (2, 0, 6) and torch.equal(final, conv_state)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("T", [5, 70])  # the token-by-token and the chunked form
def test_gate_from_raw_input_equals_precomputed_log_decay(kda, T):
    """g as the gate's raw input with A_log and dt_bias (what fla fuses into its kernels) gives exactly the result of
    the log decay -exp(A_log) * softplus(g + dt_bias) computed beforehand, gradients included."""
    torch.manual_seed(0)
    args = _good(kda=kda, T=T)
    raw = torch.randn_like(args["g"]) * 2
    A_log = torch.rand(4) * 2 - 1
    dt_bias = torch.randn(4 * 8 if kda else 4)
    fn = ops.kimi_delta_rule if kda else ops.gated_delta_rule
    runs = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_() for x in (raw, A_log, dt_bias)]
        g = leaves[0] if fused else ops.gate_log_decay(*leaves)
        gate = {"A_log": leaves[1], "dt_bias": leaves[2]} if fused else {}
        out, final = fn(args["q"], args["k"], args["v"], g, args["beta"], output_final_state=True, **gate)
        (out.sum() + final.sum()).backward()
        runs.append([out, final] + [x.grad for x in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    if kda:
        expected = -A_log.exp()[:, None] * F.softplus(raw + dt_bias.view(4, 8))
    else:
        expected = -A_log.exp() * F.softplus(raw + dt_bias)
    assert torch.equal(ops.gate_log_decay(raw, A_log, dt_bias), expected)



@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_step_updates_its_window_like_a_continued_convolution(activation):
    torch.manual_seed(0)
    x, weight = torch.randn(2, 5, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    expected, _ = ops.causal_conv1d(x, weight, activation=activation)
    window = torch.full((2, 6, 4), float("nan"), dtype=torch.float64)  # the first column is never read
    window[..., 1:] = 0
    steps = [ops.causal_conv1d_step(x[:, t : t + 1], weight, window, activation=activation) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(window[..., 1:], x[:, -3:].transpose(1, 2), rtol=0, atol=0)


def test_conv_step_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"one token per row, \[B, 1, C\]"):
        ops.causal_conv1d_step(torch.zeros(2, 3, 6), torch.zeros(6, 4), torch.zeros(2, 6, 4))
    with pytest.raises(ValueError, match=r"window \[B, C, K\]"):
        ops.causal_conv1d_step(torch.zeros(2, 1, 6), torch.zeros(6, 4), torch.zeros(2, 6, 3))

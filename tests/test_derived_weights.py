"""Tensors derived from parameters and kept between no-grad steps (the zero-centred norms' 1 + w, KDA's conv
kernels): reused while the parameter is unchanged, rebuilt after any change, never kept under autograd."""

from __future__ import annotations

import torch

from hybrid_linear_models.block_ops import rms_norm
from hybrid_linear_models.derived_weights import DerivedWeight, derived_weights
from hybrid_linear_models.norms import HybridLinearRMSNorm
from model_helpers import tiny_model


def test_kept_until_the_source_changes():
    w = torch.nn.Parameter(torch.randn(4))
    kept = DerivedWeight()
    builds = []

    def build():
        builds.append(1)
        return w + 1

    with torch.no_grad():
        first = kept.get([w], build)
        assert kept.get([w], build) is first and len(builds) == 1 and not kept.stale()
        w.add_(1.0)  # in place: an optimiser step, load_state_dict
        assert kept.stale()
        torch.testing.assert_close(kept.get([w], build), w + 1)
        w.data = torch.randn(4, dtype=torch.float64)  # new data, as module.to does (no version bump)
        assert kept.stale()
        torch.testing.assert_close(kept.get([w], build), w + 1)
        other = torch.nn.Parameter(w.detach().clone())  # another tensor in its place
        torch.testing.assert_close(kept.get([other], build), other + 1)
    assert len(builds) == 4


def test_built_fresh_under_autograd():
    w = torch.nn.Parameter(torch.randn(4))
    kept = DerivedWeight()
    value = kept.get([w], lambda: w * 2)
    assert value.requires_grad and value.grad_fn is not None
    value.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((4,), 2.0))
    with torch.inference_mode():  # kept under inference mode, usable afterwards in autograd with a frozen weight
        inference_value = kept.get([w.detach()], lambda: w.detach() * 2)
    x = torch.randn(4, requires_grad=True)
    (x * inference_value).sum().backward()


def test_zero_centred_norm_keeps_one_plus_w_and_follows_updates():
    torch.manual_seed(0)
    norm = HybridLinearRMSNorm(8, 1e-6, zero_centered=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm.weight.normal_()
        out = norm(x)
        assert norm.scale(x) is norm.scale(x)
        torch.testing.assert_close(out, rms_norm(x, 1 + norm.weight, 1e-6), rtol=0, atol=0)
        norm.weight.mul_(3)
        torch.testing.assert_close(norm(x), rms_norm(x, 1 + norm.weight, 1e-6), rtol=0, atol=0)


def test_residual_norm_equals_add_then_norm():
    torch.manual_seed(0)
    norm = HybridLinearRMSNorm(8, 1e-6, zero_centered=False)
    x, residual = torch.randn(2, 3, 8, dtype=torch.bfloat16), torch.randn(2, 3, 8, dtype=torch.bfloat16)
    normed, summed = norm(x, residual=residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, norm(x + residual))


def test_model_lists_its_kept_tensors():
    model = tiny_model()
    assert derived_weights(model), "the zero-centred norms and KDA conv kernels should be found"


def test_change_watch_sees_every_change_a_captured_graph_must_follow():
    """ChangeWatch (what CudaGraphDecoder asks before each replay) against each kept tensor's own answer: quiet while
    nothing changes; an in-place update of a derived value's source is a change at every step; new data for a
    stacked weight is one where a run of steps starts (`addresses=True`), as is a value built anew at any time; an
    in-place update of a stacked weight (its rows are views of the shared tensor, which the graph reads) is not, and
    the watch is quiet again after it."""
    from hybrid_linear_models.derived_weights import ChangeWatch, SharedRows

    w, a, b = (torch.nn.Parameter(torch.randn(n, 4)) for n in (1, 2, 3))
    derived, shared = DerivedWeight(), SharedRows()
    with torch.no_grad():
        derived.get([w], lambda: w + 1)
        shared.get([a, b])
        watch = ChangeWatch([derived, shared])
        assert not watch.changed() and not watch.changed(addresses=True)
        b.add_(1.0)  # an optimiser step on a stacked weight: in the shared tensor already
        assert not shared.stale() and not watch.changed() and not watch.changed(addresses=True)
        w.mul_(2.0)  # the derived value's source changed in place
        assert derived.stale() and watch.changed()
        derived.get([w], lambda: w + 1)  # rebuilt in place: the graph's tensor holds the new value
        watch = ChangeWatch([derived, shared])
        a.data = a.detach().clone()  # new data (module.to): no longer the shared rows
        assert watch.changed(addresses=True)
        shared.get([a, b])  # joined again, into a new tensor
        watch = ChangeWatch([derived, shared])
        derived.get([w], lambda: w.double() + 1, tag="float64")  # a new value under another tag
        assert derived.stale() is False and watch.changed()
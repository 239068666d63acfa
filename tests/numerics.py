"""How the tests compare tensors: the largest error relative to the reference's largest magnitude."""

from __future__ import annotations

import torch


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|; a reference that is exactly zero must be matched to 1e-12 absolute."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    return err / max(scale, 1e-12)


def assert_close(got, ref, tol, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = max_rel_err(got, ref)
    assert err <= tol, f"{what}: max error {err:.3e} relative to max |ref| exceeds {tol:.0e}"

"""RMSNorms of the model family: the block norms (plain x_hat * w or zero-centred x_hat * (1 + w)) and the gated
output norm of the GDN/KDA mixers (x_hat * w * act(gate))."""

from __future__ import annotations

import torch
from torch import nn

from .block_ops import rms_norm
from .derived_weights import DerivedWeight
from .kernels_delta_rule import compute_dtype
from .ops import gated_rms_norm


class HybridLinearRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, or * (1 + w) when zero-centred (w then starts at 0), computed in float32.
    Called with `residual`, normalises x + residual and returns (normed, x + residual)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self._scale = DerivedWeight()

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """The multiplier of the normalised x: w, or 1 + w in float32 at least, kept between steps that need no
        gradient."""
        weight = self.weight
        if not self.zero_centered:
            return weight
        dtype = compute_dtype(x)
        return self._scale.get([weight], lambda: weight.to(dtype) + 1, tag=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.scale(x), self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """Per-head output norm of GDN/KDA: x_hat * w * act(gate) with act silu or sigmoid; w starts at 1."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, eps=self.eps, activation=self.activation)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, activation={self.activation}"

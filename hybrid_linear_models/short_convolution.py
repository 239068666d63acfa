"""Depthwise causal short convolution module (weight [C, 1, K] like nn.Conv1d's, no bias)."""

from __future__ import annotations

import math

import torch
from torch import nn


class ShortConvolution(nn.Module):
    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.kernel_size)  # nn.Conv1d's default for a depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel_size={self.kernel_size}"

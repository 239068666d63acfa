"""A speculative verify round's GDN or KDA layer in two Triton kernels (`kernels_verify_delta_rule_triton`): one from
the input projection's output to the delta rule's output, one for the restore to each row's kept prefix.

The torch path of such a round (`mixer_linear.convolve_and_recur` over fla's kernels, then
`RollbackWindow.restore_rows`) is their reference. On a GPU it runs some eighteen kernels a layer, most of them a few
microseconds of launch and ramp each: the convolution over its padded window, its input's concatenation, copies of q,
k, v, g and beta (fla's kernels take contiguous inputs), beta's sigmoid, the recurrent kernel; then in the restore
the masks, the recurrent kernel again and the window's gather and copy. The kernels do the same math with the same
roundings (the convolution's output rounded to the activations' dtype; everything after it in float32) in one
program per (row, value head, block of value channels), the state's tile in registers. GDN's decay is one value per
head and token, KDA's one per key channel (the gate's raw input [B, T, H, dk]): the same kernels, told by the gate's
shape.

What the round kernel keeps for the restore, a `KernelRoundWindow`: the projection's output (the convolution's
inputs, a view of it: the window before the round is the cache's, untouched until the restore) and, per token, k
normalised, v convolved, g and beta in float32. The restore runs row b's first kept[b] tokens of those from the state,
which the round left as it was (a verify cache's forward: `restores_every_window`), and shifts the window.

Taken when all hold (checked per forward, in Python: a captured round replays the kernels alone): a verify cache's
layer (its kept window restored in the same round, `restores_every_window`, the window plan "new"), 2 to
MAX_ROUND_TOKENS tokens, no padding and no packed documents, no gradient, all heads (no tensor-parallel shard), CUDA
bf16/fp16 activations, head widths a power of two (dk from 2 to 256, dv from 8), a contiguous window and float32
state, triton importable. A kernel that fails to compile is not tried again for that layout (one warning); the round
then runs the torch path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .triton_loading import kernel_result, triton_kernel

ROUND_DEVICE_TYPES = ("cuda",)  # tests add "cpu", running the kernels under triton's interpreter
ROUND_DTYPES = (torch.bfloat16, torch.float16)  # tests add float32 (the interpreter has no bf16 arithmetic)
MAX_ROUND_TOKENS = 16  # a program loops over the tokens: past a few, fla's chunked kernels (the torch path) win
_FAILED: dict = {}  # layouts whose kernels failed -> the error (the torch path from then on)


@triton_kernel
def round_kernels():
    """`kernels_verify_delta_rule_triton`'s (round_forward, restore), or None where triton cannot be imported."""
    from .kernels_verify_delta_rule_triton import restore, round_forward

    return round_forward, restore


@dataclass
class KernelRoundWindow:
    """What `restore_into` reads (module docstring): x [B, T, C] the convolution's inputs, kept the round kernel's
    float32 values, num_k_heads Hk, per_channel whether the decay is KDA's."""

    x: torch.Tensor
    kept: torch.Tensor
    num_k_heads: int
    per_channel: bool

    def restore_into(self, count: torch.Tensor, state: torch.Tensor, conv_window: torch.Tensor, shared: dict) -> None:
        """Row b's recurrent `state` and `conv_window` (the round's, in place) after its first count[b] tokens."""
        round_kernels()[1](self.x, conv_window, self.kept, count, state, self.num_k_heads, self.per_channel)


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _layout_problem(x, weight, q, v, beta, a, A_log, dt_bias, window, state) -> bool:
    """True when the tensors are not what the kernels take (see the module docstring)."""
    B, T, C = x.shape
    NK, DK, HV, DV = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    per_channel = a.dim() == 4
    return (x.device.type not in ROUND_DEVICE_TYPES or x.dtype not in ROUND_DTYPES
            or not 2 <= T <= MAX_ROUND_TOKENS or x.stride(-1) != 1
            or not _power_of_two(DK) or not 2 <= DK <= 256 or not _power_of_two(DV) or DV < 8 or HV % NK
            or C != 2 * NK * DK + HV * DV or weight.shape[0] != C or beta.shape != (B, T, HV)
            or a.shape != ((B, T, HV, DK) if per_channel else (B, T, HV))
            or A_log.shape != (HV,) or dt_bias is None or dt_bias.shape != ((HV * DK,) if per_channel else (HV,))
            or not A_log.is_contiguous() or not dt_bias.is_contiguous()
            or window is None or window.shape != (B, C, weight.shape[1]) or not window.is_contiguous()
            or window.dtype != x.dtype or state is None or state.shape != (B, HV, DK, DV)
            or state.dtype != torch.float32 or not state.is_contiguous())


def delta_rule_round(x: torch.Tensor, conv_weight: torch.Tensor, split: Callable, a: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor | None, beta: torch.Tensor, beta_logits: bool,
                     cache) -> tuple[torch.Tensor, KernelRoundWindow] | None:
    """A verify round's GDN or KDA layer from its convolution's input x [B, T, C] (`mixer_linear.convolve_and_recur`'s
    arguments: `split` of x gives q, k, v; a the gate's raw input, [B, T, HV] or per key channel [B, T, HV, dk]; beta
    [B, T, HV], logits with `beta_logits`): the delta rule's output [B, T, HV, dv] and the window that restores
    `cache` (whose states it reads and leaves as they are); None where the kernels do not apply (see the module
    docstring), for the torch path."""
    if torch.is_grad_enabled() or round_kernels() is None:
        return None
    weight = conv_weight.reshape(conv_weight.shape[0], -1)
    q, _, v = split(x)
    window, state = cache.conv_window, cache.recurrent_state
    if _layout_problem(x, weight, q, v, beta, a, A_log, dt_bias, window, state):
        return None
    key = (q.shape[2:], v.shape[2:], a.dim(), weight.shape[1], x.dtype, x.device)
    result = kernel_result(
        _FAILED, key, x, "the verify round's GDN/KDA kernels failed; verify rounds run the torch path",
        lambda: round_kernels()[0](x, window, weight.contiguous(), beta, a, A_log, dt_bias, state, q.shape[2],
                                   beta_logits))
    if result is None:
        return None
    out, kept = result
    return out, KernelRoundWindow(x, kept, q.shape[2], a.dim() == 4)


__all__ = ["MAX_ROUND_TOKENS", "KernelRoundWindow", "delta_rule_round"]

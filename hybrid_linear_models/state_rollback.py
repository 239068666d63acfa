"""Restoring a GDN/KDA layer to an earlier token: what a forward keeps so that a cache `crop` is exact.

Speculative (assisted) decoding runs k drafted tokens through the model at once, then keeps the accepted prefix:
transformers' `_assisted_decoding` calls `cache.crop(-rejected)` after every verify forward (and the assistant
model's cache is cropped the same way, after several one-token steps). An attention layer drops the rejected keys. A
GDN/KDA layer's conv window and recurrent state S after the forward hold every token of it and cannot be cut back,
only restored.

What is kept, a `RollbackWindow`: the recurrent state at the window's start (the base), the K-1 convolution inputs
before it, and per token of the window the convolution's input and the delta rule's inputs (q, k, v, the raw gate,
beta). Restoring to m tokens into the window runs the delta rule over its first m tokens from the base (the same
function, hence the same kernels, a forward of those tokens runs) and takes the last K-1 convolution inputs up to
there. Exact: the restored state is the state a forward of the kept prefix computes, to the summation order of the
kernel (tests/test_speculative_rollback.py).

Why not each position's state, written by the verify forward: that writes T states for T tokens (T x S, S = Hv x dk x dv
float32, 2 MiB per row for 32 heads of 128 x 128), where the window writes at most one (the base, a copy of the state
before the forward; a verify cache's forward leaves the state itself as the base, `restores_every_window`) plus the
inputs, about 2C values a token (C the q | k | v channels: for 8K channels 32 KiB a token in bf16, S / 64); a crop then
reads the base and runs at most T steps of the recurrence with the state held in registers, and a fully accepted draft
(`crop(0)`) recomputes nothing. The verify forward keeps its own kernels (fla's chunked and recurrent kernels return
only the final state).

When a forward keeps a window (`keeps_window`, `LinearStateLayer.window_plan`): no gradient, not traced or captured,
no packed documents, and either the cache records its past (`cache.activate_past_recording()`, which transformers
calls before assisted decoding: every forward then, the prefill included, since the first verify forward is the
prompt plus the first draft), or the forward continues a non-empty cache by 2 to MAX_ROLLBACK_TOKENS tokens (a verify
step run by hand). A forward longer than MAX_ROLLBACK_TOKENS keeps its last ones: its delta rule runs in two calls,
the state between them the window's base. A one-token decoding step of a cache that does not record keeps nothing,
nor does a prompt: plain decoding pays nothing. A forward
appends to the window when it continues it, so a crop can reach back over several forwards (the assistant's steps);
after a crop, the next forward starts a new window from the state it finds (transformers never crops below an
earlier crop).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The tokens a GDN/KDA layer can always be cut back by (a window holds up to twice as many: past that, its oldest
# tokens are folded into its base, their recurrence run once more). transformers' drafters propose 10 tokens
# (prompt_lookup_num_tokens' usual value), 20 (num_assistant_tokens' default), or a draft its heuristic schedule
# lengthens by 2 a round; 64 covers them, while a window's inputs stay within two recurrent states per layer and row
# (128 tokens x about 2C values: 4 MiB for C = 8K channels in bf16, against a state's 2 MiB in float32). A crop past
# what was kept is refused with a clear error.
MAX_ROLLBACK_TOKENS = 64


@dataclass
class RollbackWindow:
    """The last tokens of a GDN/KDA layer, kept so its state can be restored to any of them.

    base: the recurrent state before the window's first token ([B, Hv, dk, dv]; None: zeros, an empty cache);
    conv_inputs: [B, C, K-1+n], the K-1 convolution inputs before the window then the n tokens' own; q, k, v, g, beta:
    the delta rule's inputs of the n tokens ([B, n, ...]; g raw, taken with `gate_args`; beta a probability);
    start: the layer's token count at the window's start."""

    rule: Callable
    gate_args: dict
    base: torch.Tensor | None
    conv_inputs: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    start: int
    restart: bool = field(default=False)  # set by a crop: the next forward starts a new window

    @property
    def tokens(self) -> int:
        return self.q.shape[1]

    @property
    def end(self) -> int:
        return self.start + self.tokens

    def state_after(self, m: int) -> torch.Tensor | None:
        """The recurrent state after the window's first m tokens (None: zeros)."""
        if m == 0:
            return self.base
        _, state = self.rule(self.q[:, :m], self.k[:, :m], self.v[:, :m], self.g[:, :m], self.beta[:, :m],
                             initial_state=self.base, output_final_state=True, use_qk_l2norm=True, **self.gate_args)
        return state

    def conv_state_after(self, m: int) -> torch.Tensor:
        """The last K-1 convolution inputs after the window's first m tokens, [B, C, K-1]."""
        keep = self.conv_inputs.shape[-1] - self.tokens
        return self.conv_inputs[..., m: m + keep]

    def restore_rows(self, kept: torch.Tensor, dropped: torch.Tensor | None = None,
                     columns: torch.Tensor | None = None, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrent state [B, Hv, dk, dv] and the last K-1 convolution inputs [B, C, K-1] after each row's first
        kept[b] tokens of the window (kept [B] on the window's device, 0 to `tokens`), with no host synchronisation
        and shapes that do not depend on `kept` (what a captured verify step runs: speculative_decoding.py).
        dropped [B, T] (t >= kept[b]) and columns [B, K-1] (kept[b] + j), where the caller has them for every layer.
        With `in_place`, the state may be written over the base, which is then returned (fla's recurrent kernels:
        recurrent_in_place.py); the window cannot be restored again.

        The delta rule runs over all the window's tokens from the base, the tokens past a row's count made neutral
        as pads are (beta 0, log decay 0: S <- S exactly), and the convolution inputs are gathered per row."""
        tokens = self.tokens
        if dropped is None:
            dropped = torch.arange(tokens, device=kept.device)[None, :] >= kept[:, None]  # [B, T]
        # (torch.where: one kernel each, where an out-of-place masked_fill is a copy and a fill)
        beta = torch.where(dropped.view(*dropped.shape, *([1] * (self.beta.dim() - 2))), 0.0, self.beta)
        g_mask = dropped.view(*dropped.shape, *([1] * (self.g.dim() - 2)))
        # a raw gate of -inf is a log decay of exactly 0 (-exp(A_log) * softplus(-inf)); an evaluated one is set to 0
        g = torch.where(g_mask, -math.inf if self.gate_args else 0.0, self.g)
        _, state = self.rule(self.q, self.k, self.v, g, beta, initial_state=self.base, output_final_state=True,
                             use_qk_l2norm=True, state_in_place=in_place, **self.gate_args)
        keep = self.conv_inputs.shape[-1] - tokens
        if columns is None or columns.shape[-1] != keep:
            columns = kept[:, None] + torch.arange(keep, device=kept.device)  # [B, K-1]
        conv = self.conv_inputs.gather(-1, columns[:, None, :].expand(-1, self.conv_inputs.shape[1], -1))
        return state, conv

    def restore_into(self, kept: torch.Tensor, state: torch.Tensor, conv_window: torch.Tensor, shared: dict) -> None:
        """`restore_rows` written into a cache's recurrent `state` [B, Hv, dk, dv] and the last K-1 columns of its
        `conv_window` [B, C, K]; `shared` holds the masks made for the round's first layer, for the others."""
        keep = self.conv_inputs.shape[-1] - self.tokens
        if (self.tokens, keep) not in shared:
            numbers = torch.arange(max(self.tokens, keep), device=kept.device)
            shared[self.tokens, keep] = (numbers[None, : self.tokens] >= kept[:, None], kept[:, None] + numbers[:keep])
        restored, conv = self.restore_rows(kept, *shared[self.tokens, keep], in_place=self.base is state)
        if restored is not state:
            state.copy_(restored)
        conv_window[..., 1:].copy_(conv)

    def keep_first(self, m: int) -> None:
        """Drops the tokens after the first m."""
        keep = self.conv_inputs.shape[-1] - self.tokens
        self.q, self.k, self.v, self.g, self.beta = (t[:, :m] for t in (self.q, self.k, self.v, self.g, self.beta))
        self.conv_inputs = self.conv_inputs[..., : m + keep]

    def drop_first(self, d: int) -> None:
        """Folds the first d tokens into the base (their recurrence run once more)."""
        self.base = self.state_after(d)
        self.q, self.k, self.v, self.g, self.beta = (t[:, d:] for t in (self.q, self.k, self.v, self.g, self.beta))
        self.conv_inputs = self.conv_inputs[..., d:]
        self.start += d

    def append(self, other: RollbackWindow) -> None:
        """The tokens of `other`, which starts where this one ends."""
        keep = other.conv_inputs.shape[-1] - other.tokens
        self.q, self.k, self.v, self.g, self.beta = (
            torch.cat([a, b], dim=1) for a, b in zip((self.q, self.k, self.v, self.g, self.beta),
                                                    (other.q, other.k, other.v, other.g, other.beta)))
        self.conv_inputs = torch.cat([self.conv_inputs, other.conv_inputs[..., keep:]], dim=-1)
        if self.tokens > 2 * MAX_ROLLBACK_TOKENS:
            self.drop_first(self.tokens - MAX_ROLLBACK_TOKENS)


def keeps_window(recording: bool, held: int, tokens: int, grad: bool, packed: bool) -> bool:
    """Whether a forward of `tokens` onto a layer holding `held` keeps a window (see the module docstring)."""
    if grad or packed or tokens == 0 or torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return recording or (held > 0 and 1 < tokens <= MAX_ROLLBACK_TOKENS)


def crop_error(held: int, window: RollbackWindow | None, tokens_to_remove: int) -> str:
    """The one line a crop to a token that was not kept raises."""
    if window is None or window.end != held or window.tokens == 0:
        can = "none of them (its last forward kept nothing)"
    else:
        can = f"{window.start} to {held} tokens"
    return (f"crop({tokens_to_remove}): a GDN/KDA layer's recurrent state cannot be cut back, only restored to a "
            f"token it kept; it holds {held} tokens and can be restored to {can}. A forward keeps what restores "
            f"its last tokens (up to {MAX_ROLLBACK_TOKENS}) when the cache records its past "
            "(cache.activate_past_recording(), as assisted generate does) or continues a cache by 2 to "
            f"{MAX_ROLLBACK_TOKENS} tokens without gradients; else re-run the prompt, or copy the cache "
            "(copy.deepcopy) before the tokens to drop.")


__all__ = ["MAX_ROLLBACK_TOKENS", "RollbackWindow", "crop_error", "keeps_window"]

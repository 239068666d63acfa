"""The kernels every GDN and KDA layer runs through: one dispatch, two implementations.

CUDA tensors with flash-linear-attention (fla) importable go to fla's Triton kernels (`chunk_*` for prefill and
training, `fused_recurrent_*` for decoding); everything else runs this package's pure-PyTorch kernels
(`kernels_delta_rule`, `kernels_conv`). The choice is made per call from the tensors' device; importing this module
never imports fla or triton. The first call that takes a slower path says so once in the log.

Layouts (fla's): q, k [B, T, Hk, dk]; v [B, T, Hv, dv] with Hv a multiple of Hk (value head j reads key head
j // (Hv / Hk)); states [N, Hv, dk, dv] in float32, N = B or the number of packed documents.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_variadic

from . import fla_backend
from .fla_backend import fla_available_for, note_torch_path  # noqa: F401  (fla_available_for: public)
from .inference_norm import inference_gated_rms_norm, inference_l2_normalize
from .kernels_conv import causal_conv1d_torch
from .kernels_delta_rule import (
    L2_NORM_EPS,
    chunk_delta_rule,
    compute_dtype,
    recurrent_delta_rule,
)
from .recurrent_in_place import step_in_place

# Up to this many tokens per sequence (and no packing) the token-by-token form is faster than the chunked one.
RECURRENT_MAX_TOKENS = 16

# fla's token-by-token kernels also serve no-grad forwards of up to this many tokens per sequence inside
# `recurrent_kernels_for_short_sequences()` (a speculative verify step of a few tokens, and its per-row restore:
# speculative_decoding.py), where the chunked kernels would pad each sequence to a chunk of 64 tokens in several
# launches; 1 (decoding steps alone) elsewhere.
_RECURRENT_KERNEL_TOKENS = [1]

# Training through fla's chunked KDA: keep the forward's intermediates (w, u, gated q/k, chunk states) for the
# backward instead of recomputing them (fla's `disable_recompute`): a faster backward for more activation memory.
KDA_KEEP_INTERMEDIATES = True


# ----------------------------------------------------------------------------------------------------- validation


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> int:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: cu_seqlens must be a 1-D int32/int64 tensor [N + 1] of document boundaries, "
            f"got dtype {cu_seqlens.dtype} and shape {_shape(cu_seqlens)}."
        )
    if batch != 1:
        raise ValueError(
            f"{name}: with cu_seqlens the documents are packed along T in one row, so the batch size must be 1, "
            f"got B={batch}. Flatten the batch to [1, B*T, ...]."
        )
    if cu_seqlens.device.type == "cpu":  # values are checked where that costs no device synchronisation
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"{name}: cu_seqlens must start at 0, never decrease and end at T={seq_len}, got {bounds}."
            )
    return cu_seqlens.numel() - 1


def _check_delta_rule(name, q, k, v, g, beta, initial_state, cu_seqlens, per_channel: bool) -> None:
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: {arg} must have 4 dims [B, T, heads, head_dim], got shape {_shape(x)}.")
    B, T, Hk, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{name}: k must have the shape of q [B, T, Hk, dk] = {_shape(q)}, got {_shape(k)}.")
    if v.shape[:2] != (B, T):
        raise ValueError(f"{name}: v must be [B, T, Hv, dv] with B, T = {B}, {T} as in q, got {_shape(v)}.")
    Hv, dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(
            f"{name}: the number of value heads (v.shape[2] = {Hv}) must be a multiple of the number of key heads "
            f"(q.shape[2] = {Hk})."
        )
    g_shape = (B, T, Hv, dk) if per_channel else (B, T, Hv)
    if _shape(g) != g_shape:
        what = ("[B, T, Hv, dk] (one log-decay per key channel)" if per_channel
                else "[B, T, Hv] (one log-decay per head)")
        raise ValueError(f"{name}: g must be {what} = {g_shape}, got {_shape(g)}.")
    if _shape(beta) != (B, T, Hv):
        raise ValueError(f"{name}: beta must be [B, T, Hv] = {(B, T, Hv)}, got {_shape(beta)}.")
    N = B if cu_seqlens is None else _check_cu_seqlens(name, cu_seqlens, B, T)
    if initial_state is not None and _shape(initial_state) != (N, Hv, dk, dv):
        raise ValueError(
            f"{name}: initial_state must be [N, Hv, dk, dv] = {(N, Hv, dk, dv)} (N = number of sequences), "
            f"got {_shape(initial_state)}."
        )


# ------------------------------------------------------------------------------------------------------ delta rule


@contextmanager
def recurrent_kernels_for_short_sequences(max_tokens: int = RECURRENT_MAX_TOKENS) -> Iterator[None]:
    """Inside: fla's token-by-token delta-rule kernels run no-grad forwards of up to `max_tokens` tokens per sequence
    (see `_RECURRENT_KERNEL_TOKENS`); the same math as the chunked kernels, to their rounding."""
    _RECURRENT_KERNEL_TOKENS.append(max_tokens)
    try:
        yield
    finally:
        _RECURRENT_KERNEL_TOKENS.pop()


def gate_log_decay(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The log decay of GDN and KDA from the gate's raw input: -exp(A_log) * softplus(g_raw + dt_bias), in float32
    (float64 for float64 input). GDN: g_raw [B, T, H], A_log and dt_bias [H]; KDA: g_raw [B, T, H, dk], A_log [H],
    dt_bias [H * dk] (one per key channel)."""
    dtype = compute_dtype(g_raw)
    x = g_raw.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).view(x.shape[2:])
    scale = A_log.to(dtype).exp()
    if x.dim() == 4:
        scale = scale.unsqueeze(-1)
    return -scale * F.softplus(x)


def _check_gate(name, A_log, dt_bias, g, per_channel) -> None:
    Hv = g.shape[2]
    if A_log is None:
        if dt_bias is not None:
            raise ValueError(f"{name}: dt_bias is only used with A_log (g then holds the gate's raw input); pass "
                             "both, or a precomputed log decay g and neither.")
        return
    if _shape(A_log) != (Hv,):
        raise ValueError(f"{name}: A_log must be [Hv] = {(Hv,)} (one per value head), got {_shape(A_log)}.")
    expected = (Hv * g.shape[3],) if per_channel else (Hv,)
    if dt_bias is not None and _shape(dt_bias) != expected:
        what = "[Hv * dk] (one per key channel)" if per_channel else "[Hv] (one per value head)"
        raise ValueError(f"{name}: dt_bias must be {what} = {expected}, got {_shape(dt_bias)}.")


def _delta_rule(name, fla_names, q, k, v, g, beta, *, per_channel, scale, initial_state, output_final_state,
                cu_seqlens, use_qk_l2norm, A_log, dt_bias, beta_logits=False, state_in_place=False):
    _check_delta_rule(name, q, k, v, g, beta, initial_state, cu_seqlens, per_channel)
    _check_gate(name, A_log, dt_bias, g, per_channel)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    decoding = q.shape[1] <= _RECURRENT_KERNEL_TOKENS[-1] and not torch.is_grad_enabled()
    kernel = fla_backend.fla_kernel(fla_names[1] if decoding else fla_names[0], q)
    if initial_state is not None:
        initial_state = initial_state.float() if kernel is not None else initial_state.to(compute_dtype(v))
    if beta_logits and (kernel is None or not decoding):  # fla's recurrent kernels alone take logits
        beta, beta_logits = beta.sigmoid(), False
    if (kernel is not None and decoding and state_in_place and output_final_state and cu_seqlens is None
            and initial_state is not None):
        out = step_in_place(per_channel, q, k, v, g, beta, scale, initial_state, use_qk_l2norm, A_log, dt_bias,
                            beta_logits)
        if out is not None:
            return out, initial_state
    if kernel is not None:
        if use_qk_l2norm and not decoding:  # fla's in-kernel L2 norm is tuned per bucket of lengths (inference_norm)
            normed = inference_l2_normalize(L2_NORM_EPS, q, k)
            if normed is not None:
                (q, k), use_qk_l2norm = normed, False
        options = {} if A_log is None else {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
        if beta_logits:
            options["use_beta_sigmoid_in_kernel"] = True
        if per_channel and not decoding and torch.is_grad_enabled() and KDA_KEEP_INTERMEDIATES:
            options["disable_recompute"] = True
        return kernel(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu_seqlens.long() if cu_seqlens is not None else None,  # fla documents a LongTensor
            **options,
        )
    note_torch_path(q, name)
    if A_log is not None:
        g = gate_log_decay(g, A_log, dt_bias)
    if q.shape[1] == 0:  # nothing to run: the state passes through
        return _empty_sequence_result(v, initial_state, output_final_state, q.shape[-1])
    if cu_seqlens is None and q.shape[1] <= RECURRENT_MAX_TOKENS:
        return recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
    return chunk_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm)


def _empty_sequence_result(v, initial_state, output_final_state, dk):
    final = None
    if output_final_state:
        final = initial_state if initial_state is not None else v.new_zeros(v.shape[0], v.shape[2], dk, v.shape[3],
                                                                            dtype=compute_dtype(v))
    return v.new_empty(v.shape), final


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_logits: bool = False,
    state_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule (GDN): per token and value head, S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T;
    o = S^T q (q scaled by `scale`, default dk^-0.5, after the optional L2 norm of q and k).

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g (log-decay, <= 0), beta: [B, T, Hv]; initial_state:
    [N, Hv, dk, dv]. With `cu_seqlens` ([N + 1], B = 1) the N documents packed along T are independent.
    Returns o like v and the final state [N, Hv, dk, dv] (float32) or None.

    With `A_log` ([Hv]) given, g holds the gate's raw input and the log decay is -exp(A_log) * softplus(g + dt_bias)
    (`gate_log_decay`, dt_bias [Hv] optional), which fla computes inside its kernels. With `beta_logits`, beta holds
    logits and the rule uses sigmoid(beta) (inside fla's recurrent kernel when decoding: one kernel less a step).
    With `state_in_place` (with `output_final_state`, where fla's recurrent kernel runs), the final state may be written
    over `initial_state` (a float32 buffer, the cache's) and returned as it: fla's kernels do so
    (recurrent_in_place.py), other paths return a new tensor.
    """
    return _delta_rule("gated_delta_rule", ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                       q, k, v, g, beta, per_channel=False, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                       A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits, state_in_place=state_in_place)


def kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_logits: bool = False,
    state_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi delta rule (KDA): `gated_delta_rule` with a per-channel decay, S <- diag(exp(g)) S, g: [B, T, Hv, dk].
    With `A_log` ([Hv]) given, g is the gate's raw input as in `gated_delta_rule`, dt_bias then [Hv * dk];
    `beta_logits` and `state_in_place` as there."""
    return _delta_rule("kimi_delta_rule", ("chunk_kda", "fused_recurrent_kda"),
                       q, k, v, g, beta, per_channel=True, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                       A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits, state_in_place=state_in_place)


# ------------------------------------------------------------------------------------------------- short convolution


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution over [B, T, C] with kernel `weight` [C, K] (or [C, 1, K]), then `activation`
    ("silu"/"swish" or None). The state holds the last K-1 inputs of each sequence, [N, C, K-1], oldest first;
    `initial_state` continues from one, `output_final_state` returns it. With `cu_seqlens` (B = 1) every document
    starts from its own state (or zeros)."""
    name = "causal_conv1d"
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [B, T, C], got shape {_shape(x)}.")
    B, T, C = x.shape
    weight = _conv_kernel(name, weight, C, activation)
    N = B if cu_seqlens is None else _check_cu_seqlens(name, cu_seqlens, B, T)
    K = weight.shape[1]
    if initial_state is not None and _shape(initial_state) != (N, C, K - 1):
        raise ValueError(
            f"{name}: initial_state must be [N, C, K-1] = {(N, C, K - 1)} (the last K-1 inputs of each of the "
            f"N sequences), got {_shape(initial_state)}."
        )
    if T == 0:  # nothing to convolve: the state passes through
        final = initial_state if initial_state is not None else x.new_zeros(N, C, K - 1)
        return x.new_empty(x.shape), (final if output_final_state else None)
    kernel = fla_backend.fla_kernel("causal_conv1d", x)
    if kernel is not None:
        return _fla_causal_conv1d(kernel, x, weight, activation, initial_state, output_final_state, cu_seqlens)
    return causal_conv1d_torch(x, weight, activation, initial_state, output_final_state, cu_seqlens)


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decoding step of `causal_conv1d` for every row: x [B, 1, C]; `window` [B, C, K] holds the row's last K
    inputs in its last K-1 columns (the first is never read: fla's layout, which lets fla update it in place in one
    kernel) and is updated in place, x shifted in: the whole window, as fla's kernel shifts it, so that afterwards it
    holds the K-1 inputs before x, then x (what state_rollback keeps of a step). Returns the output [B, 1, C]; same
    math as `causal_conv1d` with initial_state = window[..., 1:]."""
    name = "causal_conv1d_step"
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"{name}: x must be one token per row, [B, 1, C], got shape {_shape(x)}.")
    B, _, C = x.shape
    weight = _conv_kernel(name, weight, C, activation)
    if _shape(window) != (B, C, weight.shape[1]):
        raise ValueError(f"{name}: window [B, C, K] must be {(B, C, weight.shape[1])} (B, C as in x, K as in the "
                         f"weight), got {_shape(window)}.")
    kernel = fla_backend.fla_kernel("causal_conv1d_update", x)
    if kernel is not None and window.is_contiguous():
        return kernel(x, window, weight=weight, activation=activation)[0]
    out, final = causal_conv1d_torch(x, weight, activation, window[..., 1:], True)
    window[..., 0].copy_(window[..., 1])
    window[..., 1:].copy_(final)
    return out


def _conv_kernel(name: str, weight: torch.Tensor, channels: int, activation: str | None) -> torch.Tensor:
    """The depthwise kernel as [C, K] (from [C, K] or nn.Conv1d's [C, 1, K]), checked with the activation."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"{name}: weight must be [C, K] or [C, 1, K] with C = {channels} as in x, got "
                         f"{_shape(weight)}.")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{name}: activation must be 'silu', 'swish' or None, got {activation!r}.")
    return weight


def _fla_causal_conv1d(kernel, x, weight, activation, initial_state, output_final_state, cu_seqlens):
    """fla's Triton convolution. Its state holds the last K inputs, the oldest never read: ours is its last K-1. A
    state that is the last K-1 columns of a contiguous [N, C, K] window (the caches' layout: `conv_window`) is handed
    over as that window, its first column unread; another is padded to K columns (a copy)."""
    if initial_state is not None:
        initial_state = _as_fla_window(initial_state)
    out, final = kernel(
        x=x, weight=weight, activation=activation, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens.long() if cu_seqlens is not None else None,
    )
    return out, (final[..., 1:] if final is not None else None)


def _as_fla_window(state: torch.Tensor) -> torch.Tensor:
    """[N, C, K] with `state` [N, C, K-1] as its last K-1 columns: the window `state` is a view of, or a padded copy."""
    N, C, keep = state.shape
    window = (C * (keep + 1), keep + 1, 1)
    if state.stride() == window and state.storage_offset() >= 1:
        return state.as_strided((N, C, keep + 1), window, state.storage_offset() - 1)
    return F.pad(state, (1, 0))


# --------------------------------------------------------------------------------------------------- gated RMSNorm

_GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    activation: str = "silu",
) -> torch.Tensor:
    """RMSNorm over the last dim, times `weight`, times act(gate): x / sqrt(mean(x^2) + eps) * w * act(gate),
    computed in float32 (float64 for float64 x) and returned in x's dtype. act is "silu" (Qwen3-Next, Fast-LLM) or
    "sigmoid" (Kimi). On CUDA: this package's Triton kernel where no gradient is wanted (`inference_norm`), else
    fla's. Takes part in `__torch_function__` dispatch."""
    if has_torch_function_variadic(x, gate, weight):
        return handle_torch_function(gated_rms_norm, (x, gate, weight), x, gate, weight, eps=eps,
                                     activation=activation)
    if activation not in _GATE_ACTIVATIONS:
        raise ValueError(f"gated_rms_norm: activation must be one of {sorted(_GATE_ACTIVATIONS)}, got {activation!r}.")
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"gated_rms_norm: gate must have the shape of x {_shape(x)} and weight [{x.shape[-1]}], got gate "
            f"{_shape(gate)} and weight {_shape(weight)}."
        )
    out = inference_gated_rms_norm(x, gate, weight, eps, activation)
    if out is not None:
        return out
    kernel = fla_backend.fla_kernel("rms_norm_gated", x)
    if kernel is not None:
        return kernel(x, gate, weight, None, activation=activation, eps=eps)
    dtype = compute_dtype(x)
    x32 = x.to(dtype)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(dtype) * _GATE_ACTIVATIONS[activation](gate.to(dtype))).to(x.dtype)

"""Triton kernels of a speculative verify round's GDN and KDA layers: the round's few tokens from the input
projection's output to the delta rule's output in one kernel, and each row's restore to its kept prefix in another
(`verify_delta_rule.py` says when they run; the torch path they replace, `mixer_linear.convolve_and_recur` and
`RollbackWindow.restore_rows`, is their reference).

Both run one program per (row, value head, block of BV value channels), the [dk, BV] tile of the recurrent state in
registers, as fla's recurrent kernel does.

1. `_round_kernel`: first every token's inputs, as [TP, channels] tiles in registers (TP: T padded to a power of two;
   all their loads issued at once, one memory round trip):
   - the short convolution of the value head's key head (q and k channels) and of its BV value channels. The K-1
     inputs before the round come from the cache's window (input at time s < 0 in column K + s), the round's own
     from the projection's output (a strided view: no copy). silu, then rounded to the activations' dtype, as the
     convolution's output is;
   - the L2 norms of q and k in float32 (eps 1e-6), q scaled by dk^-0.5; the log decay g = -exp(A_log) softplus(a +
     dt_bias), one per value head (GDN) or one per key channel (KDA, `PER_CHANNEL`), and beta (the sigmoid of its
     logits where it is given those);
   then the delta rule token by token (row t of a tile taken by a masked sum over its rows):
       S <- diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
   The state is read and never written: a verify cache's forward leaves it for the restore (`restores_every_window`).
   What the restore needs is written for every token, in float32: k normalised (by one program of each key head),
   v convolved (each program its own channels), g and beta (one program of each value head).
2. `_restore_kernel`: the tile run over row b's first kept[b] tokens from those values (loaded first, as tiles)
   and written over the state;
   then the cache's window shifted to the K-1 inputs up to there, from the window before the round and the
   projection's output. Each program shifts its own value channels, and one program of each key head that head's q
   and k channels; each program loads its channels' columns before it stores them, and no other program reads them
   (the recurrence reads the kept values, not the window).

Launched with programmatic dependent launch where it is on (`kernels_launch_triton`). Imported only for CUDA tensors
(triton needs a GPU driver), or in tests under triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the verify round's GDN/KDA kernels need triton (a CUDA machine)") from error

from .kernels_delta_rule import L2_NORM_EPS
from .kernels_launch_triton import await_previous_kernel, dependent_launch

BLOCK_V = 8  # value channels per program (fla's recurrent kernel's block; one warp)


@triton.jit
def _conv_silu(x_row, stride_xt, window_row, channels, weight_ptr, T, TP: tl.constexpr, K: tl.constexpr):
    """[TP, channels] silu(causal convolution) of the round's tokens (rows past T: unused) at `channels` (a block of
    channel indices), float32, rounded once to the activations' dtype as the convolution's output is. Every load is
    issued before any result is needed: one memory round trip for all the tokens."""
    t, c = tl.arange(0, TP)[:, None], channels[None, :]
    acc = tl.zeros((TP, channels.shape[0]), dtype=tl.float32)
    for j in tl.static_range(K):
        s = t - (K - 1) + j  # the input's time: the round's own from 0, the window's before
        own = tl.load(x_row + s * stride_xt + c, mask=(c >= 0) & (s >= 0) & (s < T), other=0.0)
        before = tl.load(window_row + c * K + K + s, mask=(c >= 0) & (s < 0), other=0.0)
        acc += (own.to(tl.float32) + before.to(tl.float32)) * tl.load(weight_ptr + c * K + j).to(tl.float32)
    return (acc * tl.sigmoid(acc)).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _row(tile, tokens, t):
    """Row t of a [TP, N] tile held in registers, [N]."""
    return tl.sum(tl.where((tokens == t)[:, None], tile, 0.0), 0)


@triton.jit
def _at(values, tokens, t):
    """Element t of a [TP] vector held in registers."""
    return tl.sum(tl.where(tokens == t, values, 0.0), 0)


@triton.jit
def _rule_step(h, k, v, g, beta, tokens, t, PER_CHANNEL: tl.constexpr):
    """The state tile h [dk, BV] after token t of the [TP, ...] tiles: S <- diag(exp(g_t)) S (g [TP, dk], one decay
    per key channel) or exp(g_t) S (g [TP]); S <- S + k_t (beta_t (v_t - S^T k_t))^T."""
    if PER_CHANNEL:
        h = h * tl.exp(_row(g, tokens, t))[:, None]
    else:
        h = h * tl.exp(_at(g, tokens, t))
    k_t = _row(k, tokens, t)
    u = (_row(v, tokens, t) - tl.sum(h * k_t[:, None], 0)) * _at(beta, tokens, t)
    return h + k_t[:, None] * u[None, :]


@triton.jit
def _heads(NK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """This program's row, value head, key head, whether it is the one program of its key head that writes the key
    head's values (its first value head's first block), and its channels of q, k and v in the convolution's
    [q | k | v]."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // (HV // NK)
    ck = tl.arange(0, DK)
    cv = i_v * BV + tl.arange(0, BV)
    owns_key_head = (i_v == 0) & (i_hv % (HV // NK) == 0)
    return (i_b, i_hv, i_hk, i_v, owns_key_head, ck, cv, i_hk * DK + ck, NK * DK + i_hk * DK + ck,
            2 * NK * DK + i_hv * DV + cv)


@triton.jit(do_not_specialize=["T"])
def _round_kernel(x_ptr, stride_xb, stride_xt, window_ptr, weight_ptr, b_ptr, stride_bb, stride_bt, stride_bh, a_ptr,
                  stride_ab, stride_at, stride_ah, stride_ac, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, kept_ptr, T,
                  scale, eps, NK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BV: tl.constexpr, K: tl.constexpr, TP: tl.constexpr, PER_CHANNEL: tl.constexpr,
                  BETA_LOGITS: tl.constexpr, PDL: tl.constexpr):
    i_b, i_hv, i_hk, i_v, owns_key_head, ck, cv, q_ch, k_ch, v_ch = _heads(NK, HV, DK, DV, BV)
    C: tl.constexpr = 2 * NK * DK + HV * DV
    G: tl.constexpr = 1 + PER_CHANNEL * (DK - 1)  # decays per value head and token
    W: tl.constexpr = NK * DK + HV * DV + HV * G + HV  # a token's kept values: [k | v | g | beta]
    tokens = tl.arange(0, TP)
    decay_scale = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))  # (weights: read before the wait)
    if PER_CHANNEL:
        dt_bias = tl.load(dt_bias_ptr + i_hv * DK + ck).to(tl.float32)[None, :]
    else:
        dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    await_previous_kernel(PDL)
    x_row, window_row = x_ptr + i_b * stride_xb, window_ptr + i_b * C * K
    h = tl.load(state_ptr + ((i_b * HV + i_hv) * DK + ck[:, None]) * DV + cv[None, :])
    # every token's inputs first, [TP, channels] tiles
    q = _conv_silu(x_row, stride_xt, window_row, q_ch, weight_ptr, T, TP, K)
    k = _conv_silu(x_row, stride_xt, window_row, k_ch, weight_ptr, T, TP, K)
    v = _conv_silu(x_row, stride_xt, window_row, v_ch, weight_ptr, T, TP, K)
    q = q * (tl.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
    a_row = a_ptr + i_b * stride_ab + i_hv * stride_ah
    if PER_CHANNEL:
        raw = tl.load(a_row + tokens[:, None] * stride_at + ck[None, :] * stride_ac, mask=(tokens < T)[:, None],
                      other=0.0)
    else:
        raw = tl.load(a_row + tokens * stride_at, mask=tokens < T, other=0.0)
    raw = raw.to(tl.float32) + dt_bias
    g = decay_scale * tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw)))  # softplus, torch's threshold
    beta = tl.load(b_ptr + i_b * stride_bb + tokens * stride_bt + i_hv * stride_bh, mask=tokens < T, other=0.0)
    beta = beta.to(tl.float32)
    if BETA_LOGITS:
        beta = tl.sigmoid(beta)
    o = tl.zeros((TP, BV), dtype=tl.float32)
    for t in range(T):  # the delta rule, token by token
        h = _rule_step(h, k, v, g, beta, tokens, t, PER_CHANNEL)
        o = tl.where((tokens == t)[:, None], tl.sum(h * _row(q, tokens, t)[:, None], 0)[None, :], o)
    live = (tokens < T)[:, None]
    tl.store(o_ptr + ((i_b * T + tokens[:, None]) * HV + i_hv) * DV + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=live)
    kept_row = kept_ptr + (i_b * T + tokens) * W
    tl.store(kept_row[:, None] + i_hk * DK + ck[None, :], k, mask=live & owns_key_head)
    tl.store(kept_row[:, None] + NK * DK + i_hv * DV + cv[None, :], v, mask=live)
    if PER_CHANNEL:
        tl.store(kept_row[:, None] + NK * DK + HV * DV + i_hv * DK + ck[None, :], g, mask=live & (i_v == 0))
    else:
        tl.store(kept_row + NK * DK + HV * DV + i_hv, g, mask=(tokens < T) & (i_v == 0))
    tl.store(kept_row + NK * DK + HV * DV + HV * G + i_hv, beta, mask=(tokens < T) & (i_v == 0))


@triton.jit
def _shift_window(x_row, stride_xt, window_row, channels, count, K: tl.constexpr, KP: tl.constexpr, mask):
    """The window's last K-1 columns of `channels` set to the K-1 inputs up to the round's first `count` tokens."""
    column = tl.arange(0, KP)[None, :]
    s = count - K + column  # the time of the input column c gets (c = K - 1: the count-th token)
    rows = channels[:, None]
    live = mask & (rows >= 0) & (column >= 1) & (column < K)
    own = tl.load(x_row + s * stride_xt + rows, mask=live & (s >= 0), other=0.0)
    before = tl.load(window_row + rows * K + K + s, mask=live & (s < 0), other=0.0)
    tl.store(window_row + rows * K + column, tl.where(s >= 0, own, before), mask=live)


@triton.jit(do_not_specialize=["T"])
def _restore_kernel(x_ptr, stride_xb, stride_xt, window_ptr, kept_ptr, count_ptr, state_ptr, T, NK: tl.constexpr,
                    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, K: tl.constexpr,
                    KP: tl.constexpr, TP: tl.constexpr, PER_CHANNEL: tl.constexpr, PDL: tl.constexpr):
    i_b, i_hv, i_hk, _, owns_key_head, ck, cv, q_ch, k_ch, v_ch = _heads(NK, HV, DK, DV, BV)
    C: tl.constexpr = 2 * NK * DK + HV * DV
    G: tl.constexpr = 1 + PER_CHANNEL * (DK - 1)
    W: tl.constexpr = NK * DK + HV * DV + HV * G + HV
    await_previous_kernel(PDL)
    count = tl.load(count_ptr + i_b).to(tl.int32)
    tokens = tl.arange(0, TP)
    live = tokens < count
    kept_row = kept_ptr + (i_b * T + tokens) * W
    # the kept tokens' values first, [TP, channels] tiles
    k = tl.load(kept_row[:, None] + i_hk * DK + ck[None, :], mask=live[:, None], other=0.0)
    v = tl.load(kept_row[:, None] + NK * DK + i_hv * DV + cv[None, :], mask=live[:, None], other=0.0)
    if PER_CHANNEL:
        g = tl.load(kept_row[:, None] + NK * DK + HV * DV + i_hv * DK + ck[None, :], mask=live[:, None], other=0.0)
    else:
        g = tl.load(kept_row + NK * DK + HV * DV + i_hv, mask=live, other=0.0)
    beta = tl.load(kept_row + NK * DK + HV * DV + HV * G + i_hv, mask=live, other=0.0)
    state = state_ptr + ((i_b * HV + i_hv) * DK + ck[:, None]) * DV + cv[None, :]
    h = tl.load(state)
    for t in range(count):
        h = _rule_step(h, k, v, g, beta, tokens, t, PER_CHANNEL)
    tl.store(state, h)
    x_row, window_row = x_ptr + i_b * stride_xb, window_ptr + i_b * C * K
    _shift_window(x_row, stride_xt, window_row, v_ch, count, K, KP, True)
    _shift_window(x_row, stride_xt, window_row, q_ch, count, K, KP, owns_key_head)
    _shift_window(x_row, stride_xt, window_row, k_ch, count, K, KP, owns_key_head)


def _grid(batch: int, value_heads: int, value_dim: int) -> tuple[int, int]:
    return (value_dim // BLOCK_V, batch * value_heads)


def _padded(tokens: int) -> int:
    """The token tiles' rows: a power of two (one compiled kernel per padded count)."""
    return max(2, triton.next_power_of_2(tokens))


def _warps(tokens: int) -> int:
    """One warp as fla's recurrent kernel, more where the token tiles (q and k: TP x dk floats) need registers."""
    return max(1, _padded(tokens) // 4)


def round_forward(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, beta: torch.Tensor, a: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, num_k_heads: int,
                  beta_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's output [B, T, HV, dv] of a verify round (the module docstring's kernel 1) and the values its
    restore reads (float32).

    x [B, T, C]: the convolution's input [q | k | v] (C = 2 Hk dk + HV dv; channels contiguous, rows and tokens
    strided); window [B, C, K] (contiguous, the K-1 inputs before the round in its last columns); weight [C, K];
    beta [B, T, HV] (its logits with `beta_logits`) and a, the gate's raw input: [B, T, HV] (GDN) or [B, T, HV, dk]
    (KDA), any strides; A_log [HV] and dt_bias ([HV], KDA [HV dk]) contiguous; state [B, HV, dk, dv] float32
    contiguous, read only. The values for the restore: [B, T, Hk dk + HV dv + HV (KDA: HV dk) + HV]."""
    B, T = x.shape[:2]
    HV, DK, DV = state.shape[1:]
    per_channel = a.dim() == 4
    out = x.new_empty(B, T, HV, DV)
    decays = HV * DK if per_channel else HV
    kept = torch.empty(B, T, num_k_heads * DK + HV * DV + decays + HV, dtype=torch.float32, device=x.device)
    _round_kernel[_grid(B, HV, DV)](
        x, x.stride(0), x.stride(1), window, weight, beta, *beta.stride(), a, *a.stride()[:3],
        a.stride(3) if per_channel else 0, A_log, dt_bias, state, out, kept, T, DK ** -0.5, L2_NORM_EPS,
        NK=num_k_heads, HV=HV, DK=DK, DV=DV, BV=BLOCK_V, K=weight.shape[1], TP=_padded(T), PER_CHANNEL=per_channel,
        BETA_LOGITS=beta_logits, num_warps=_warps(T), **dependent_launch(x.device))
    return out, kept


def restore(x: torch.Tensor, window: torch.Tensor, kept: torch.Tensor, count: torch.Tensor, state: torch.Tensor,
            num_k_heads: int, per_channel: bool) -> None:
    """Row b's state and window put at its first count[b] tokens of the round (the module docstring's kernel 2), in
    place; x, window, state as `round_forward` took them (per_channel: its decay was KDA's), kept what it returned,
    count [B] integers."""
    B, T = x.shape[:2]
    HV, DK, DV = state.shape[1:]
    K = window.shape[-1]
    _restore_kernel[_grid(B, HV, DV)](
        x, x.stride(0), x.stride(1), window, kept, count, state, T, NK=num_k_heads, HV=HV, DK=DK, DV=DV, BV=BLOCK_V,
        K=K, KP=triton.next_power_of_2(K), TP=_padded(T), PER_CHANNEL=per_channel, num_warps=_warps(T),
        **dependent_launch(x.device))

"""What the GDN and KDA mixers share: short convolution then delta rule, over packed, padded or cached sequences."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache_hybrid_linear import LinearStateLayer
from .fla_backend import fla_available_for
from .fused_projections import FusedProjections
from .ops import causal_conv1d, causal_conv1d_step, gate_log_decay
from .sequence_info import SequenceInfo
from .state_rollback import MAX_ROLLBACK_TOKENS, RollbackWindow


@dataclass
class DecayGate:
    """What the decay is made of: log decay = -exp(A_log) * softplus(raw + dt_bias), per value head (GDN: raw
    [B, T, H], dt_bias [H]) or per key channel (KDA: raw [B, T, H, dk], dt_bias [H * dk]); A_log [H]. Handed to the
    delta rule unevaluated, so fla can compute it inside its kernels."""

    raw: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def mask_padding(hidden_states: torch.Tensor, info: SequenceInfo) -> torch.Tensor:
    """Zeroes the hidden states of pad tokens, so their projections (no biases) feed zeros to the convolution.
    (A select, not a product: whatever a pad position holds, even NaN from a fully masked attention row, is dropped.)"""
    if info.padding_mask is None:
        return hidden_states
    return hidden_states.masked_fill(~info.padding_mask.unsqueeze(-1), 0.0)


def conv_state_at_last_real(inputs: torch.Tensor, padding_mask: torch.Tensor, keep: int,
                            initial: torch.Tensor | None) -> torch.Tensor:
    """The short convolution's state [B, C, keep] after each row's last real token: the `keep` inputs up to it, the
    ones before the row's first input from `initial` [B, C, keep] (zeros without). The kernel's final state holds
    each row's last `keep` inputs, which is this for rows padded on the left only; a row padded on the right (as a
    captured prefill pads a prompt to its length bucket) would keep its pads' zero inputs instead."""
    B, T, C = inputs.shape
    before = initial.transpose(1, 2).to(inputs.dtype) if initial is not None else inputs.new_zeros(B, keep, C)
    history = torch.cat([before, inputs], dim=1)  # [B, keep + T, C]: input t at keep + t
    upto = (padding_mask * torch.arange(1, T + 1, device=inputs.device)).amax(-1)  # tokens up to the last real one
    rows = upto[:, None] + torch.arange(keep, device=inputs.device)  # history rows upto .. upto + keep - 1
    return history.gather(1, rows[..., None].expand(B, keep, C)).transpose(1, 2)


def steps_conv_window(cache: LinearStateLayer | None, info: SequenceInfo, tokens: int) -> bool:
    """Whether the short convolution runs as a decoding step on the cache's window (one token per row, a window to
    shift, no packed documents), updating it in place."""
    return cache is not None and cache.conv_window is not None and tokens == 1 and info.cu_seqlens is None


def project_for_convolution(projections: FusedProjections, x: torch.Tensor, linears, rows: torch.Tensor | None,
                            conv_weight: torch.Tensor, info: SequenceInfo, cache: LinearStateLayer | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decoding step's stacked input projection (check `projections.applies` first), split at C = conv_weight's
    channels: (the convolution's input, the other outputs, conv_weight for `convolve_and_recur`). Where the
    convolution steps the cache's window, it runs with the projection (`FusedProjections.convolved`: in a captured
    step, in the GEMV kernel's epilogue) and None is returned for conv_weight: the input is convolved already."""
    if steps_conv_window(cache, info, x.shape[1]):
        mixed, rest = projections.convolved(x, linears, rows, conv_weight, cache.conv_window)
        return mixed, rest, None
    flat = projections(x, linears, rows=rows)
    return flat[..., : conv_weight.shape[0]], flat[..., conv_weight.shape[0]:], conv_weight


def convolve_and_recur(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor | None,
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    gate: DecayGate,
    beta: torch.Tensor,
    rule: Callable,
    info: SequenceInfo,
    cache: LinearStateLayer | None,
    beta_logits: bool = False,
    round_rule: Callable | None = None,
) -> torch.Tensor:
    """silu(causal_conv1d(mixed)) split into q, k, v, then the delta `rule` with the decay of `gate` and beta.

    mixed [B, T, C]; conv_weight None: mixed is the convolution's output already, the cache's window stepped
    (`project_for_convolution`); beta [B, T, H] (its logits with `beta_logits`: the sigmoid then runs in the rule's
    kernel where it can). Pads keep the state as it was (beta = 0, log decay = 0); packed documents each
    start from zero; a cache provides the initial conv/recurrent states and keeps the final ones, and what
    restores them to each of the tokens where a crop can follow (`LinearStateLayer.window_plan`). `round_rule` runs
    a verify round's whole layer where it can, its kernels keeping their own window
    (`verify_delta_rule.delta_rule_round`).
    Returns the delta-rule output [B, T, H, dv].
    """
    g, gate_args = gate.raw, {"A_log": gate.A_log, "dt_bias": gate.dt_bias}
    if info.padding_mask is not None:
        pad = ~info.padding_mask.unsqueeze(-1)  # [B, T, 1]
        if beta_logits:
            beta, beta_logits = beta.sigmoid(), False
        beta = beta.masked_fill(pad, 0.0)
        pad = pad if g.dim() == 3 else pad.unsqueeze(-1)
        if torch.is_grad_enabled():  # the decay evaluated here, zero at pads
            g, gate_args = gate_log_decay(g, gate.A_log, gate.dt_bias).masked_fill(pad, 0.0), {}
        else:  # a raw input of -inf is a log decay of exactly 0 (-exp(A_log) * softplus(-inf)), and the decay is still
            g = g.masked_fill(pad, -math.inf)  # evaluated inside the rule's kernels
    mixed, g, beta = info.flatten(mixed), info.flatten(g), info.flatten(beta)
    recurrent_state = cache.recurrent_state if cache is not None else None
    plan = cache.window_plan(mixed.shape[1], info.cu_seqlens is not None) if cache is not None else None
    # a cache whose kept windows are all restored in their round keeps its states until `restore` writes them: the
    # window's base is the state itself, and this forward's final states are neither computed nor stored
    deferred = plan == "new" and cache.restores_every_window
    base = None if plan != "new" or recurrent_state is None else recurrent_state if deferred else \
        recurrent_state.clone()  # (the state is updated in place)
    if deferred and round_rule is not None and info.padding_mask is None and conv_weight is not None:
        fused = round_rule(mixed, conv_weight, split, g, gate.A_log, gate.dt_bias, beta, beta_logits, cache)
        if fused is not None:  # (the states left for the window's restore, as below)
            out, window = fused
            cache.store(None, None, new_tokens=mixed.shape[1])
            cache.keep_window(window, plan)
            return info.unflatten(out)
    final_states = cache is not None and not deferred
    window_step = conv_weight is None or steps_conv_window(cache, info, mixed.shape[1])  # stepped in place
    if window_step:  # (conv_weight None: convolved with its projection)
        if conv_weight is not None:
            mixed = causal_conv1d_step(mixed, conv_weight, cache.conv_window, activation="silu")
        conv_state = None
    else:
        inputs, initial = mixed, cache.conv_state if cache is not None else None
        mixed, conv_state = causal_conv1d(mixed, conv_weight, activation="silu", initial_state=initial,
                                          output_final_state=final_states, cu_seqlens=info.cu_seqlens)
        if conv_state is not None and info.padding_mask is not None:  # rows padded on the right too
            conv_state = conv_state_at_last_real(inputs, info.padding_mask, conv_state.shape[-1], initial)
    if plan is not None:  # the K-1 conv inputs before the tokens, then theirs
        if window_step:  # [the K-1 before | its input]
            conv_inputs = cache.conv_window.clone()
        else:
            before = initial if initial is not None else inputs.new_zeros(
                inputs.shape[0], inputs.shape[-1], conv_weight.shape[-1] - 1)
            conv_inputs = torch.cat([before, inputs.transpose(1, 2)], dim=-1)
    q, k, v = split(mixed)
    tokens = q.shape[1]
    # a kept window's rule runs twice over q, k, v (this forward, then a restore: state_rollback), and fla copies
    # strided inputs (slices of `mixed`) to contiguous ones before each run: copied once here instead, and kept
    fresh = plan in ("new", "append") and fla_available_for(q)
    if fresh:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    options = {**gate_args, **({"beta_logits": True} if beta_logits else {})}
    if plan == "split":  # the rule up to the window, whose start state is kept, then over it
        cut = tokens - MAX_ROLLBACK_TOKENS
        head, base = rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut],
                          initial_state=recurrent_state, output_final_state=True, use_qk_l2norm=True, **options)
        tail, recurrent_state = rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:],
                                     initial_state=base, output_final_state=True, use_qk_l2norm=True, **options)
        out = torch.cat([head, tail], dim=1)
    else:
        out, recurrent_state = rule(
            q, k, v, g, beta, initial_state=recurrent_state, output_final_state=final_states,
            cu_seqlens=info.cu_seqlens, use_qk_l2norm=True, **options,
            # a decoding step may update the cache's state in place (no copy of it afterwards: recurrent_in_place.py)
            state_in_place=cache is not None and mixed.shape[1] == 1,
        )
    if cache is not None:  # (a decoding step updated the conv window in place: conv_state None)
        cache.store(conv_state, None if deferred else recurrent_state, new_tokens=mixed.shape[1])
    if plan is not None:
        kept = slice(tokens - min(tokens, MAX_ROLLBACK_TOKENS), None)
        own = (lambda t: t.clone()) if cache.window_copies else (lambda t: t)
        own_qkv = (lambda t: t) if fresh else own  # (the copies above are the window's own already)
        cache.keep_window(RollbackWindow(
            rule, gate_args, base, own(conv_inputs[..., kept]), own_qkv(q[:, kept]), own_qkv(k[:, kept]),
            own_qkv(v[:, kept]), own(g[:, kept]), own((beta.sigmoid() if beta_logits else beta)[:, kept]), start=0),
            plan)
    return info.unflatten(out)

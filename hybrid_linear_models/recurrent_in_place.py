"""A decoding step's delta rule with the cache's recurrent state read and written in place by fla's recurrent kernels
(and a verify round's restore: the tokens a row keeps, run from the state before the round, into it).

fla's public recurrent functions return a new final state, which the cache then copies into its own buffer: a kernel
per GDN/KDA layer and step that moves the whole state twice more (per row: 2 MiB read and 2 MiB written for 32 GDN
heads of 128 x 128 float32; at batch 16, 768 MiB per step over the 12 GDN layers of the benchmark model). Here the
kernels write the final state over the initial one, the cache's own buffer:
- KDA through `fused_recurrent_kda_fwd(..., inplace_final_state=True)`, fla's own decoding entry for serving;
- GDN by launching fla's recurrent kernel, as its Python wrapper does, with the state as both its initial and its
  final pointer (the wrapper allocates a new final state). Each program of that kernel reads its [BK, BV] tile of the
  state once, before its first token, and writes that tile once, after its last (the tile stays in registers between
  tokens); no program reads another's tile, so one buffer can be both.
Same kernels, same arguments otherwise: the same output and state, bit for bit (tests/test_recurrent_in_place.py).
The inputs are made contiguous first, as fla's `input_guard` does for its public functions.
"""

from __future__ import annotations

import contextlib

import torch

from . import fla_backend


IN_PLACE_DEVICE_TYPES = ("cuda", "cpu")  # where a step may run in place (benchmarks empty it: the copy path)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gdn_step(kernel, q, k, v, g, beta, scale, state, use_qk_l2norm, A_log, dt_bias, beta_logits) -> torch.Tensor:
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BK, BV = _next_power_of_2(K), min(8, _next_power_of_2(V))  # fla's wrapper's blocks
    out = torch.empty_like(v)
    kernel[(-(-V // BV) * B * HV,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=A_log, dt_bias=dt_bias, o=out, h0=state, ht=state,
        cu_seqlens=None, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IS_BETA_HEADWISE=beta.ndim != v.ndim,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm, APPLY_BETA_SIGMOID=beta_logits, ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False, num_warps=1, num_stages=3)
    return out


def _kda_step(kernel, q, k, v, g, beta, scale, state, use_qk_l2norm, A_log, dt_bias, beta_logits) -> torch.Tensor:
    out, final = kernel(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=state, scale=scale,
                        output_final_state=True, inplace_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                        use_gate_in_kernel=A_log is not None, use_beta_sigmoid_in_kernel=beta_logits)
    assert final is state  # (fla's in-place contract)
    return out


# per rule: fla's kernel (fla_backend name) and how to run it in place
_STEPS = {False: ("fused_recurrent_gated_delta_rule_fwd_kernel", _gdn_step),
          True: ("fused_recurrent_kda_fwd", _kda_step)}


def step_in_place(per_channel: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float, state: torch.Tensor, use_qk_l2norm: bool,
                  A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, beta_logits: bool) -> torch.Tensor | None:
    """The output [B, T, HV, V] of T tokens of the GDN (KDA with `per_channel`) rule, `state` [B, HV, K, V] (float32,
    contiguous) updated in place (a decoding step's token; a verify round's restore, `state_rollback`); None where fla's
    kernel is not importable or the state is not such a buffer (the caller then runs the public kernel and keeps the
    returned state)."""
    name, run = _STEPS[per_channel]
    kernel = fla_backend.fla_kernel(name, q)
    if (kernel is None or q.device.type not in IN_PLACE_DEVICE_TYPES or q.shape[1] < 1
            or state.dtype != torch.float32 or not state.is_contiguous()
            or state.shape != (q.shape[0], v.shape[2], q.shape[3], v.shape[3])):
        return None
    tensors = [t.contiguous() if t is not None else None for t in (q, k, v, g, beta, A_log, dt_bias)]
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # (the CPU: tests' stand-ins)
        return run(kernel, *tensors[:5], scale, state, use_qk_l2norm, *tensors[5:], beta_logits)

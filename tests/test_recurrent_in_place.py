"""A decoding step's delta rule with the state updated in place (recurrent_in_place.py) against fla's public
recurrent kernels: the same kernels, so the same output and final state, bit for bit; the final state is the buffer
given as the initial one. GPU only (fla's kernels)."""

from __future__ import annotations

import pytest
import torch

from hybrid_linear_models import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's recurrent kernels need CUDA")]


def _inputs(per_channel: bool, batch: int, heads: int, value_heads: int, dk: int, dv: int, gated_in_kernel: bool,
            tokens: int = 1):
    g = torch.Generator(device="cpu").manual_seed(3)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).cuda()

    q, k = (rand(batch, tokens, heads, dk).bfloat16() for _ in range(2))
    v = rand(batch, tokens, value_heads, dv).bfloat16()
    raw = rand(batch, tokens, value_heads, *((dk,) if per_channel else ())).bfloat16()
    beta = rand(batch, tokens, value_heads).bfloat16()  # logits
    gate = {}
    if gated_in_kernel:
        gate = {"A_log": rand(value_heads, scale=0.5), "dt_bias": rand(value_heads * (dk if per_channel else 1))}
    else:
        raw = -torch.nn.functional.softplus(raw.float())  # a log decay
    state = rand(batch, value_heads, dk, dv, scale=0.1)
    return (q, k, v, raw, beta), gate, state


@pytest.mark.parametrize("rule", ["gdn", "kda"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gated_in_kernel", [True, False])
@pytest.mark.parametrize("tokens", [1, 4])  # a decoding step; a verify round's restore (its recurrent kernels)
def test_step_in_place_equals_the_public_kernel(rule, batch, gated_in_kernel, tokens):
    per_channel = rule == "kda"
    function = ops.kimi_delta_rule if per_channel else ops.gated_delta_rule
    heads, value_heads = (4, 4) if per_channel else (2, 4)
    tensors, gate, state = _inputs(per_channel, batch, heads, value_heads, 64, 128, gated_in_kernel, tokens)
    if batch > 1:  # strided q, k, v as the mixers' split of one projection gives them
        tensors = tuple(t.repeat_interleave(2, dim=-1)[..., ::2] if t.dim() == 4 else t for t in tensors)
    with torch.no_grad(), ops.recurrent_kernels_for_short_sequences():
        expected, expected_state = function(*tensors, initial_state=state.clone(), output_final_state=True,
                                            beta_logits=True, **gate)
        buffer = state.clone()
        got, got_state = function(*tensors, initial_state=buffer, output_final_state=True, beta_logits=True,
                                  state_in_place=True, **gate)
    assert got_state is buffer
    assert torch.equal(got, expected) and torch.equal(got_state, expected_state)

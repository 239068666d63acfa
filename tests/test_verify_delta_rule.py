"""A verify round's GDN layers on this package's two Triton kernels (verify_delta_rule.py) against the torch path they replace
(`convolve_and_recur` and `RollbackWindow.restore_rows`, themselves checked against each row decoded alone in
test_speculative_batched.py). On a GPU (bf16, fp16) and on the CPU under triton's interpreter
(`TRITON_INTERPRET=1 pytest tests/test_verify_delta_rule.py`: float32 and fp16, the interpreter has no bf16 arithmetic).

Tolerances, on each tensor relative to its largest magnitude (at least 1), against the torch path in float64. Float32:
both float32 paths round the convolution's output and sum in float32, in different orders, and each lies within
5e-6 of float64 on these models (measured), so 2e-5 is the bound. fp16/bf16: the whole model's roundings (its
projections, norms, attention) put the torch path itself some 20 units of the dtype's roundoff (2^-11, 2^-8) from
float64 here; the kernels round at the same points in other orders, so a convolution output can round the other way,
and a unit of v moves the state by beta |k| |v| units (|v| up to a few). The bound, as for the fused attention step:
twice the torch path's own distance in that dtype, plus 2 units (the largest seen on an H200: 1.94 times)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_helpers import runs_triton_kernels, tiny_model

from hybrid_linear_models import verify_delta_rule
from hybrid_linear_models.fused_projections import projections_stacked_for_few_rows
from hybrid_linear_models.speculative_decoding import (
    forward_tokens,
    prefill,
    speculative_generate,
)
from hybrid_linear_models.verify_cache import VerifyCache

UNIT_ROUNDOFF = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
GDN = ["gated_deltanet", "full_attention", "gated_deltanet"]
KDA = ["kimi_delta_attention", "full_attention", "kimi_delta_attention"]
# (layers, head settings): GDN with one value block and with two, one value head a key head and two; KDA (a decay per
# key channel), two value blocks
LAYOUTS = {
    "gdn": (GDN, {"gdn_num_key_heads": 2, "gdn_num_value_heads": 4, "gdn_key_head_dim": 16, "gdn_value_head_dim": 8}),
    "gdn_two_blocks_one_value_head_a_key": (GDN, {"gdn_num_key_heads": 2, "gdn_num_value_heads": 2,
                                                  "gdn_key_head_dim": 32, "gdn_value_head_dim": 16}),
    "kda": (KDA, {"kda_num_heads": 2, "kda_head_dim": 16}),
}


def _device_and_dtypes():
    if torch.cuda.is_available():
        return "cuda", (torch.bfloat16, torch.float16)
    return "cpu", (torch.float32, torch.float16)


DEVICE, DTYPES = _device_and_dtypes()


@pytest.fixture
def kernels(monkeypatch) -> list:
    """The kernels on for this device, its test dtypes and float32; returns the list that counts the round kernel's
    launches."""
    launches, loaded = [], verify_delta_rule.round_kernels()

    def counted(*args, **kwargs):
        launches.append(1)
        return loaded[0](*args, **kwargs)

    monkeypatch.setattr(verify_delta_rule, "ROUND_DEVICE_TYPES", (DEVICE,))
    monkeypatch.setattr(verify_delta_rule, "ROUND_DTYPES", (*DTYPES, torch.float32))
    monkeypatch.setattr(verify_delta_rule, "round_kernels", lambda: (counted, loaded[1]))
    monkeypatch.setattr(verify_delta_rule, "_FAILED", {})
    return launches


def _model(layout: str, dtype: torch.dtype):
    layers, heads = LAYOUTS[layout]
    return tiny_model(layers, seed=3, **heads).to(DEVICE, dtype)


def _filled_cache(model, batch: int = 3, prompt: int = 7) -> VerifyCache:
    """A verify cache after left-padded prompts (rows 1 and 2 padded by 2 and 4)."""
    ids = torch.randint(2, 128, (batch, prompt), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(batch, prompt, dtype=torch.long)
    mask[1, :2], mask[2, :4] = 0, 0
    cache = VerifyCache(model, batch, prompt + 40, torch.device(DEVICE))
    with torch.no_grad():
        prefill(model, cache, (ids * mask).to(DEVICE), mask.to(DEVICE))
    return cache


def _round(model, cache: VerifyCache, ids: torch.Tensor, kept: torch.Tensor, stacked: bool):
    """A verify round's logits [B, T, V] and the cache's tensors after its restore to `kept` (float64)."""
    with torch.no_grad(), projections_stacked_for_few_rows() if stacked else contextlib.nullcontext():
        logits = forward_tokens(model, cache, ids)
        cache.restore(kept)
    return [t.double() for t in (logits, *cache.tensors())]


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked_projections", "separate_projections"])
@pytest.mark.parametrize("tokens", [2, 5])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_round_and_its_restore_equal_the_torch_path(kernels, layout, dtype, tokens, stacked):
    model, exact = _model(layout, dtype), _model(layout, torch.float64)
    ids = torch.randint(2, 128, (3, tokens), generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    kept = torch.tensor([tokens, 0, 2], device=DEVICE)  # all kept, a row that is done, a prefix
    with pytest.MonkeyPatch.context() as off:  # the torch path: the kernels' device refused
        off.setattr(verify_delta_rule, "ROUND_DEVICE_TYPES", ())
        reference = _round(exact, _filled_cache(exact), ids, kept, stacked)
        torch_path = _round(model, _filled_cache(model), ids, kept, stacked)
    assert not kernels
    got = _round(model, _filled_cache(model), ids, kept, stacked)
    assert len(kernels) == 2  # one round kernel per GDN/KDA layer
    for mine, theirs, expected in zip(got, torch_path, reference):
        scale = max(1.0, expected.abs().max().item())
        error = (mine - expected).abs().max().item() / scale
        if dtype == torch.float32:
            assert error <= 2e-5
        else:
            assert error <= 2 * (theirs - expected).abs().max().item() / scale + 2 * UNIT_ROUNDOFF[dtype]
    assert not verify_delta_rule._FAILED


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("layout", ["gdn", "kda"])
def test_a_row_that_keeps_nothing_keeps_its_states_bit_for_bit(kernels, layout):
    model = _model(layout, DTYPES[0])
    cache = _filled_cache(model)
    before = [t.clone() for t in cache.tensors()]
    ids = torch.randint(2, 128, (3, 4), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    _round(model, cache, ids, torch.zeros(3, dtype=torch.long, device=DEVICE), stacked=True)
    assert len(kernels) == 2
    for layer in cache.linear_layers:  # (the attention layers' rejected keys lie past the lengths, unseen)
        index = cache.layers.index(layer)
        assert torch.equal(layer.conv_states[0], before[2 + 2 * index])
        assert torch.equal(layer.recurrent_states[0], before[3 + 2 * index])


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("layout", ["gdn", "kda"])
def test_speculative_greedy_output_with_the_kernels_is_plain_greedy(kernels, layout):
    """A random drafter (nearly every draft rejected) and a left-padded batch: each row's tokens are its plain greedy
    decoding alone."""
    model = _model(layout, torch.float32)  # (no near-ties between the two largest logits to round apart)
    ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0

    class Drafter:
        generator = torch.Generator().manual_seed(1)

        def draft(self, sequences, count):
            return torch.randint(2, 128, (len(sequences), count), generator=self.generator)

    out = speculative_generate(model, (ids * mask).to(DEVICE), Drafter(), num_tokens=3, max_new_tokens=8,
                               attention_mask=mask.to(DEVICE))
    assert kernels, "the kernels did not run"
    with torch.no_grad():
        for row, real in enumerate(mask.bool()):
            prompt = ids[row][real][None].to(DEVICE)
            alone = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            assert torch.equal(out[row, 6:], alone[0, prompt.shape[1]:])


def test_the_kernels_refuse_what_they_do_not_take():
    """Layouts the kernels do not take leave the torch path (`_layout_problem`), on any machine."""
    x = torch.zeros(1, 3, 2 * 2 * 16 + 4 * 8)
    weight = torch.zeros(x.shape[-1], 4)
    q, v = torch.zeros(1, 3, 2, 16), torch.zeros(1, 3, 4, 8)
    beta = a = torch.zeros(1, 3, 4)
    A_log = dt_bias = torch.zeros(4)
    window, state = torch.zeros(1, x.shape[-1], 4), torch.zeros(1, 4, 16, 8)
    args = [x, weight, q, v, beta, a, A_log, dt_bias, window, state]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify_delta_rule, "ROUND_DEVICE_TYPES", ("cpu",))
        patch.setattr(verify_delta_rule, "ROUND_DTYPES", (torch.float32,))
        assert not verify_delta_rule._layout_problem(*args)
        for i, bad in [(0, torch.zeros(1, 17, x.shape[-1])),  # past MAX_ROUND_TOKENS
                       (2, torch.zeros(1, 3, 2, 12)),  # a key width not a power of two
                       (3, torch.zeros(1, 3, 4, 4)),  # a value width under a block
                       (5, torch.zeros(1, 3, 4, 8)),  # a per-channel gate of another width than the keys
                       (7, torch.zeros(4 * 16)),  # a per-channel dt_bias with a per-head gate
                       (8, window[..., :3]),  # a window of another kernel width
                       (9, state.double())]:  # a state not float32
            changed = list(args)
            changed[i] = bad
            assert verify_delta_rule._layout_problem(*changed), i
        per_channel = list(args)  # KDA's gate: one raw value and one dt_bias per key channel
        per_channel[5], per_channel[7] = torch.zeros(1, 3, 4, 16), torch.zeros(4 * 16)
        assert not verify_delta_rule._layout_problem(*per_channel)

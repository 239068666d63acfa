"""The fused attention step (attention_step.py: three Triton kernels from the q/k/v projection to o_proj's input), in a
captured decoding step's static cache and in a speculative verify round's `VerifyCache`, against the torch path it
replaces and a float64 reference. On a GPU (bf16, fp16) and on the CPU
under triton's interpreter (`TRITON_INTERPRET=1 pytest tests/test_attention_step.py`: fp16 only, the interpreter has
no bf16 arithmetic)."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import runs_triton_kernels, tiny_model
from transformers import StaticCache

from hybrid_linear_models import attention_step
from hybrid_linear_models.cuda_graph_decoding import StepCache
from hybrid_linear_models.speculative_decoding import forward_tokens, prefill
from hybrid_linear_models.verify_cache import VerifyCache

UNIT_ROUNDOFF = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}



# (heads, kv_heads, head_dim, rotated fraction, q/k norms, output gate, batch, slots): GQA groups of 2, 8 and 1, the
# benchmark models' 16/2 x 256 and 16/2 x 128, whole and partial rotation, with and without norms and gate, slots
# over several tiles of 64 (and past the 64 splits at which a split covers two tiles)
LAYOUTS = {
    "gqa2_partial": (4, 2, 16, 0.25, True, True, 2, 130),
    "gqa8_whole_no_norm": (16, 2, 32, 1.0, False, True, 1, 70),
    "mha_no_gate": (2, 2, 64, 0.5, True, False, 3, 64),
    "gdn_benchmark": (16, 2, 256, 0.25, True, True, 1, 1152),
    "kda_benchmark": (16, 2, 128, 0.25, True, True, 2, 4500),
    "two_tiles_per_split": (4, 2, 16, 1.0, True, True, 1, 4200),
    # past the split limit of a GPU of up to 156 multiprocessors at batch 1 (2 x SMs splits of 64 slots): several tiles
    # a split there too
    "tiles_per_split_on_a_gpu": (4, 2, 16, 1.0, True, True, 1, 20000),
}
INTERPRETED = ("gqa2_partial", "gqa8_whole_no_norm", "mha_no_gate", "two_tiles_per_split")


def _model(layout: str, dtype: torch.dtype, device: str):
    heads, kv_heads, head_dim, rotated, norms, gate, _, _ = LAYOUTS[layout]
    model = tiny_model(["full_attention"], num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       attention_qk_norm=norms, attention_output_gate=gate,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": rotated})
    model.config._attn_implementation = "sdpa"
    return model.to(device, dtype)


def _step(model, cache: StaticCache, hidden: torch.Tensor, key_mask: torch.Tensor, fused: bool) -> torch.Tensor:
    """The attention layer's output for a one-token step against `cache` (as a captured step's StepCache)."""
    inner = model.model
    positions = cache.layers[0].cumulative_length.view(1, 1).expand(hidden.shape[0], 1)
    tables = inner._step_rotary_tables(hidden, positions)[inner.rotary_of_layer[0]]
    mask = torch.full(key_mask.shape, float("-inf"), dtype=hidden.dtype, device=hidden.device)
    mask = mask.masked_fill_(key_mask, 0.0)[:, None, None, :]
    return _attention_layer(model, hidden, tables, mask, StepCache(cache, None), fused)


def _attention_layer(model, hidden: torch.Tensor, tables, mask: torch.Tensor, cache, fused: bool) -> torch.Tensor:
    """The model's first layer's attention output for `hidden` [B, T, H] against `cache`, on the kernels (`fused`) or
    on the torch path; asserts that the path asked for ran."""
    kernel, launches = attention_step.attention_step_kernel(), []

    def counted(*args, **kwargs):
        launches.append(1)
        return kernel(*args, **kwargs)

    failed = {}
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(attention_step, "STEP_DEVICE_TYPES", (hidden.device.type,) if fused else ())
        patch.setattr(attention_step, "attention_step_kernel", lambda: counted)
        patch.setattr(attention_step, "_FAILED", failed)
        out = model.model.layers[0].self_attn(hidden, tables, mask, cache)[0]
    assert len(launches) == (1 if fused else 0)  # the path asked for ran
    assert not failed, failed  # and its kernels did (a failure falls back to the torch path, with a warning)
    return out


def _filled_cache(model, batch: int, slots: int, prompt: int) -> tuple[StaticCache, torch.Tensor]:
    """A static cache of `slots` slots after a prompt of `prompt` tokens (the last row left-padded by 3; none: an empty
    cache), and the key mask of the next step (real prompt tokens and the step's own slot)."""
    device = model.device
    ids = torch.randint(1, 100, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    padding = torch.ones(batch, prompt, dtype=torch.long, device=device)
    padding[-1, :3] = 0
    cache = StaticCache(config=model.config, max_cache_len=slots)
    if prompt:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=padding, cache=cache, use_cache=True)
    else:  # no prompt: the layer's buffers allocated, the step writes slot 0
        attention = model.model.layers[0].self_attn
        empty = torch.empty(batch, attention.num_key_value_heads, 0, attention.head_dim, device=device,
                            dtype=model.dtype)
        cache.layers[0].lazy_initialization(empty, empty)
    key_mask = torch.zeros(batch, slots, dtype=torch.bool, device=device)
    key_mask[:, :prompt] = padding.bool()
    key_mask[:, prompt] = True
    return cache, key_mask


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_step_against_the_torch_path_and_float64(layout, dtype):
    """Writes the step's key (normed and rotated with the torch path's roundings: within what one rounding of the
    normed key, its float32 sum being ordered differently, makes of the rotation) and value (the same bits) at the
    step's slot and nothing else; its output is no further from the float64 step than twice the torch path's, plus
    one rounding of the output (the attention's sums are ordered differently, and its probabilities rounded before
    normalisation)."""
    if not torch.cuda.is_available() and (dtype == torch.bfloat16 or layout not in INTERPRETED):
        pytest.skip("triton's interpreter: fp16 (no bfloat16 arithmetic), the small layouts")
    slots = LAYOUTS[layout][7]
    _check_fused_step(layout, dtype, slots, min(slots - 8, 100))


# (cache slots, the step's slot): one slot, around a tile of 64, splits past the step's slot skipped (1000 slots: 16
# splits of one tile), two tiles a split (4097: 33 splits) with the step in the last split's first slot or in the first
# tile of a split whose second is skipped
CACHE_LENGTHS = [(1, 0), (15, 14), (16, 15), (17, 16), (63, 40), (64, 63), (65, 64), (1000, 700), (4097, 4096),
                 (4097, 2100)]


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("slots", "prompt"), CACHE_LENGTHS)
def test_fused_step_at_every_cache_length(slots, prompt, dtype):
    """The step of any static cache's length (odd, a multiple of 16, a single slot) as exact as at the layouts' own
    lengths (the checks of the test above), the last row left-padded."""
    if not torch.cuda.is_available() and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter: fp16 (no bfloat16 arithmetic)")
    _check_fused_step("gqa2_partial", dtype, slots, prompt)


def _check_fused_step(layout: str, dtype: torch.dtype, slots: int, prompt: int) -> None:
    """The fused step after `prompt` tokens in a static cache of `slots` slots against the torch path and the float64
    step (see test_fused_step_against_the_torch_path_and_float64)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = LAYOUTS[layout][6]
    model = _model(layout, dtype, device)
    cache, key_mask = _filled_cache(model, batch, slots, prompt)
    hidden = torch.randn(batch, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(device,
                                                                                                           dtype)
    before = copy.deepcopy(cache)
    fused = _step(model, cache, hidden, key_mask, fused=True)
    torch_cache = copy.deepcopy(before)
    reference = _step(model, torch_cache, hidden, key_mask, fused=False)
    exact_cache = copy.deepcopy(before)
    for layer in exact_cache.layers:
        layer.keys, layer.values = layer.keys.double(), layer.values.double()
    exact = _step(copy.deepcopy(model).double(), exact_cache, hidden.double(), key_mask, fused=False)

    unit = UNIT_ROUNDOFF[dtype]
    got, torch_path = cache.layers[0], torch_cache.layers[0]
    untouched = [s for s in range(slots) if s != prompt]
    assert torch.equal(got.keys[:, :, untouched], before.layers[0].keys[:, :, untouched])
    assert torch.equal(got.values[:, :, untouched], before.layers[0].values[:, :, untouched])
    assert torch.equal(got.values[:, :, prompt], torch_path.values[:, :, prompt])
    # a key element is rotate(y)_i = round(round(y_i cos) + round(y_j sin)), y = the normed key: where the norm's sum
    # order moves y_i or y_j by one rounding, the two products move by up to unit * |y| each, |y_i|, |y_j| <= sqrt(2)
    # max|key| (the rotation keeps each pair's length); as the sum may cancel, that bound is absolute (2.83 -> 3)
    key, torch_key = got.keys[:, :, prompt], torch_path.keys[:, :, prompt]
    torch.testing.assert_close(key, torch_key, rtol=unit, atol=3 * unit * torch_key.abs().max().item())
    assert torch.equal(got.cumulative_length, before.layers[0].cumulative_length)  # advanced by the step's end
    assert fused.shape == reference.shape and fused.dtype == dtype
    fused_error = (fused.double() - exact).abs().max()
    torch_error = (reference.double() - exact).abs().max()
    assert fused_error <= 2 * torch_error + unit * exact.abs().max(), (fused_error, torch_error)


@pytest.mark.gpu
@runs_triton_kernels
def test_fused_step_is_taken_only_where_its_conditions_hold(monkeypatch):
    """The kernels serve a captured step's full-attention layers with sdpa: eager attention, a cache that is not a
    captured step's, a mask over other slots, or a sliding layer (its step cache lends no full layer) keep the torch
    path (the function returns None, touching nothing)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(attention_step, "STEP_DEVICE_TYPES", (device,))
    model = _model("gqa2_partial", torch.float16, device)
    cache, _ = _filled_cache(model, 2, 80, 20)
    hidden = torch.randn(2, 1, model.config.hidden_size, device=device, dtype=torch.float16)
    inner = model.model
    positions = torch.full((2, 1), 20, device=device)
    tables = inner._step_rotary_tables(hidden, positions)[inner.rotary_of_layer[0]]
    mask = torch.zeros(2, 1, 1, 80, device=device, dtype=torch.float16)
    attention = inner.layers[0].self_attn
    keys = cache.layers[0].keys.clone()
    with torch.no_grad():
        assert attention_step.fused_attention_step(attention, hidden, tables, mask, cache) is None  # not a StepCache
        model.config._attn_implementation = "eager"
        assert attention_step.fused_attention_step(attention, hidden, tables, mask, StepCache(cache, None)) is None
        model.config._attn_implementation = "sdpa"
        assert attention_step.fused_attention_step(attention, hidden, tables, mask[..., :40],
                                                   StepCache(cache, None)) is None  # a mask over other slots
        assert torch.equal(cache.layers[0].keys, keys)
        assert attention_step.fused_attention_step(attention, hidden, tables, mask, StepCache(cache, None)) is not None
    sliding = tiny_model(["sliding_attention"], sliding_window=4).to(device, torch.float16)
    sliding_cache, _ = _filled_cache(sliding, 1, 16, 6)
    assert StepCache(sliding_cache, None).kernel_kv_layer(0) is None


# (layout, tokens): a verify round's k, up to MAX_STEP_TOKENS; 16 tokens of a group of 8 query heads make 128 rows of a
# KV head, two blocks of MAX_ROW_BLOCK; the KDA benchmark's heads of 128 with 8 tokens, a block of 64 rows beside
# tiles of 128 slots; the GDN
# benchmark's heads of 256 with 3 tokens (24 rows: pipelined) and 5 (40 rows: `WIDE_HEADS_MANY_QUERIES`, no pipeline)
ROUNDS = [("gqa2_partial", 2), ("gqa2_partial", 5), ("gqa8_whole_no_norm", 16), ("mha_no_gate", 4),
          ("kda_benchmark", 4), ("kda_benchmark", 8), ("gdn_benchmark", 3), ("gdn_benchmark", 5)]


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("layout", "tokens"), ROUNDS)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
def test_fused_round_against_the_torch_path_and_float64(layout, tokens, window, dtype):
    """A verify round of `tokens` tokens a row in a `VerifyCache` whose rows hold different lengths and a rejected
    round's keys past them: each token's key and value at its row's slot lengths[b] + t and nothing else written, the
    output within the step's bounds (test_fused_step_against_the_torch_path_and_float64). A sliding layer's window is
    in the mask: the kernels take it as they are."""
    if not torch.cuda.is_available() and (dtype == torch.bfloat16 or layout not in INTERPRETED):
        pytest.skip("triton's interpreter: fp16 (no bfloat16 arithmetic), the small layouts")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads, kv_heads, head_dim, rotated, norms, gate, batch, slots = LAYOUTS[layout]
    slots = min(slots, 200)
    sliding = {} if window is None else {"sliding_window": window}
    model = tiny_model(["full_attention" if window is None else "sliding_attention"], num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, attention_qk_norm=norms,
                       attention_output_gate=gate, **sliding, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": rotated})
    model.config._attn_implementation = "sdpa"
    model = model.to(device, dtype)
    cache = _round_cache(model, batch, slots + 2 * tokens, slots - 8, tokens)
    hidden = torch.randn(batch, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    before = copy.deepcopy(cache)
    fused = _round(model, cache, hidden.to(device, dtype), fused=True)
    torch_cache = copy.deepcopy(before)
    reference = _round(model, torch_cache, hidden.to(device, dtype), fused=False)
    exact_cache = copy.deepcopy(before)
    layer = exact_cache.layers[0]
    layer.keys, layer.values = layer.keys.double(), layer.values.double()
    exact = _round(copy.deepcopy(model).double(), exact_cache, hidden.to(device, torch.float64), fused=False)

    unit = UNIT_ROUNDOFF[dtype]
    written = torch.zeros(batch, cache.slots, dtype=torch.bool)
    written[torch.arange(batch)[:, None], cache.query_slots(tokens).cpu()] = True
    got, torch_path, old = cache.layers[0], torch_cache.layers[0], before.layers[0]
    for b in range(batch):
        assert torch.equal(got.keys[b][:, ~written[b]], old.keys[b][:, ~written[b]])
        assert torch.equal(got.values[b][:, ~written[b]], old.values[b][:, ~written[b]])
        assert torch.equal(got.values[b][:, written[b]], torch_path.values[b][:, written[b]])
        key, torch_key = got.keys[b][:, written[b]], torch_path.keys[b][:, written[b]]  # (the step's bound, per key)
        torch.testing.assert_close(key, torch_key, rtol=unit, atol=3 * unit * torch_key.abs().max().item())
    assert torch.equal(cache.lengths, before.lengths)  # (moved by the round's restore)
    assert fused.shape == reference.shape and fused.dtype == dtype
    fused_error = (fused.double() - exact).abs().max()
    torch_error = (reference.double() - exact).abs().max()
    assert fused_error <= 2 * torch_error + unit * exact.abs().max(), (fused_error, torch_error)


def _round_cache(model, batch: int, slots: int, prompt: int, tokens: int) -> VerifyCache:
    """A verify cache of `slots` slots after left-padded prompts of `prompt` tokens (the last row padded by 3) and one
    round of `tokens` tokens on the torch path whose rows kept all, one and none of them, in turn: rows of different
    lengths, rejected keys past them."""
    device = model.device
    ids = torch.randint(1, 100, (batch, prompt + tokens), generator=torch.Generator().manual_seed(1)).to(device)
    padding = torch.ones(batch, prompt, dtype=torch.long, device=device)
    padding[-1, :3] = 0
    cache = VerifyCache(model, batch, slots, torch.device(device))
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_step, "STEP_DEVICE_TYPES", ())
        prefill(model, cache, ids[:, :prompt] * padding, padding)
        forward_tokens(model, cache, ids[:, prompt:])
        cache.restore(torch.tensor([tokens, 1, 0] * batch, device=device)[:batch])
    return cache


def _round(model, cache: VerifyCache, hidden: torch.Tensor, fused: bool) -> torch.Tensor:
    """The attention layer's output for a verify round of hidden [B, T, H] against `cache`."""
    inner, tokens = model.model, hidden.shape[1]
    tables = inner._step_rotary_tables(hidden, cache.positions(tokens))[inner.rotary_of_layer[0]]
    mask = cache.attention_mask(tokens, cache.layers[0].window, hidden.dtype, eager=False)
    return _attention_layer(model, hidden, tables, mask, cache, fused)


@runs_triton_kernels
def test_attend_kernel_takes_the_stages_that_fit_shared_memory():
    """Where the compiled attend kernel needs more shared memory than the device has (triton raises OutOfResources as
    it loads the kernel, before a launch), it is launched with fewer pipeline stages, and the stages that fit are
    kept for the layout's next calls; a kernel that fits at no stage count raises."""
    from triton.runtime.errors import OutOfResources

    from hybrid_linear_models import kernels_attention_step_triton as kernels

    tried = []

    def attend(STAGES):  # (the kernel's constexpr name)
        tried.append(STAGES)
        if STAGES > 2:
            raise OutOfResources(278528, 232448, "shared memory")

    key = ("test", "layout that fits 2 stages")
    kernels._launch_in_shared_memory(attend, 4, key)
    assert tried == [4, 3, 2] and kernels._stages_that_fit.pop(key) == 2
    kernels._stages_that_fit[key] = 2
    tried.clear()
    kernels._launch_in_shared_memory(attend, 4, key)
    assert tried == [2]
    kernels._stages_that_fit.pop(key)

    def never(STAGES):
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):
        kernels._launch_in_shared_memory(never, 3, ("test", "layout that fits nothing"))

"""Generation: the hybrid cache gives exactly what full forwards give, through every `generate` mode."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache, TextStreamer, pipeline

from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer
from model_helpers import tiny_model, word_tokenizer

# float32; cached decoding runs the token-by-token kernels while the full forward runs the chunked ones, so they
# differ by rounding only (measured ~1e-5 on logits of magnitude ~5).
LOGITS_TOL = 1e-4


def _ids(shape, seed):
    return torch.randint(1, 128, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layer_types", [None, ["gated_deltanet", "kimi_delta_attention"]])
def test_cached_decoding_matches_full_forward(layer_types):
    model = tiny_model(layer_types)
    input_ids = _ids((2, 40), 0)
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids[:, :25], cache=cache, use_cache=True).logits]
        for t in range(25, 40):
            steps.append(model(input_ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= LOGITS_TOL


def test_multi_token_forward_continues_from_the_cache():
    """Chunked prefill / continuing a conversation: later chunks start from the cached states. In float64, where the
    chunked and the cached computations agree to rounding (~1e-13), so any state not carried over would show."""
    model = tiny_model().double()
    input_ids = _ids((2, 90), 1)
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        chunks = [model(input_ids[:, a:b], cache=cache, use_cache=True).logits for a, b in ((0, 30), (30, 77), (77, 90))]
    assert (torch.cat(chunks, dim=1) - full).abs().max() <= 1e-10


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(num_beams=3, do_sample=False)])
def test_generate_with_cache_equals_generate_without(mode):
    """Beam search reorders the cache (reorder_cache); recomputing everything each step must give the same tokens."""
    model = tiny_model()
    input_ids = _ids((2, 10), 2)
    cached = model.generate(input_ids, max_new_tokens=8, min_new_tokens=8, use_cache=True, **mode)
    uncached = model.generate(input_ids, max_new_tokens=8, min_new_tokens=8, use_cache=False, **mode)
    assert torch.equal(cached, uncached)


def test_static_cache_generates_the_same_tokens():
    model = tiny_model()
    input_ids = _ids((2, 10), 3)
    dynamic = model.generate(input_ids, max_new_tokens=6, do_sample=False)
    static = model.generate(input_ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(dynamic, static)


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    model = tiny_model()
    prompts = [_ids((1, n), 10 + n) for n in (9, 4, 6)]
    width = max(p.shape[1] for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - p.shape[1] :] = p
        attention_mask[i, width - p.shape[1] :] = 1
    batched = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=7, min_new_tokens=7,
                             do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p, max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, width:], alone[0, p.shape[1] :]), i


def test_sampling_num_return_sequences_and_eos():
    model = tiny_model()
    input_ids = _ids((2, 6), 4)
    torch.manual_seed(0)
    sampled = model.generate(input_ids, max_new_tokens=5, do_sample=True, num_return_sequences=3, pad_token_id=0)
    assert sampled.shape == (6, 11) and torch.equal(sampled[::3, :6], input_ids)
    greedy = model.generate(input_ids[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    eos = int(greedy[0, 8])  # the third generated token
    stopped = model.generate(input_ids[:1], max_new_tokens=6, do_sample=False, eos_token_id=eos)
    assert stopped[0, -1] == eos and stopped.shape[1] <= 9


def test_text_streamer_and_pipeline(capsys):
    model = tiny_model()
    tokenizer = word_tokenizer([f"w{i}" for i in range(2, 128)])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    prompt = "w5 w9 w17 w33"
    assert tokenizer(prompt).input_ids == [5, 9, 17, 33]
    inputs = tokenizer(prompt, return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, streamer=streamer)
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected[0, 4:])
    expected_text = prompt + tokenizer.decode(expected[0, 4:])  # the pipeline appends the new text to the prompt
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text == expected_text


def test_linear_layers_cache_does_not_grow_with_the_context():
    model = tiny_model()
    sizes = {}
    for length in (10, 300):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(_ids((1, length), 5), cache=cache, use_cache=True)
        sizes[length] = [
            sum(t.numel() for t in (layer.conv_state, layer.recurrent_state)) if isinstance(layer, LinearStateLayer)
            else layer.keys.numel() + layer.values.numel()
            for layer in cache.layers
        ]
    for layer_type, short, long in zip(model.config.mixer_types, sizes[10], sizes[300]):
        if layer_type in ("gated_deltanet", "kimi_delta_attention"):
            assert short == long, layer_type
        elif layer_type == "full_attention":
            assert long == 30 * short
        else:  # sliding layers keep their window (and the tokens of the last forward)
            assert long <= 300 * short / 10
    gdn = next(layer for layer in cache.layers if isinstance(layer, LinearStateLayer))
    assert gdn.recurrent_state.dtype == torch.float32


def test_cache_reorder_and_batch_selection_follow_the_rows():
    model = tiny_model()
    input_ids = _ids((3, 12), 6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, cache=cache, use_cache=True)
        reordered = copy.deepcopy(cache)
        reordered.reorder_cache(torch.tensor([2, 0, 1]))
        step = _ids((3, 1), 7)
        expected = model(step, cache=cache, use_cache=True).logits
        got = model(step[[2, 0, 1]], cache=reordered, use_cache=True).logits
    torch.testing.assert_close(got, expected[[2, 0, 1]], atol=1e-5, rtol=1e-5)  # row order changes BLAS blocking


def test_crop_of_a_prompt_raises_a_clear_error():
    """A prompt keeps nothing to restore (assisted decoding, which crops, records: test_speculative_rollback.py)."""
    model = tiny_model()
    input_ids = _ids((1, 8), 8)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="can be restored to none of them"):
        cache.layers[0].crop(-5)


def test_a_cache_built_for_another_model_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="Build the cache from the model's config"):
        model(_ids((1, 4), 9), cache=DynamicCache(), use_cache=True)


def test_static_cache_object_can_be_passed_in():
    model = tiny_model()
    input_ids = _ids((1, 10), 11)
    cache = StaticCache(config=model.config, max_cache_len=32)
    static = model.generate(input_ids, max_new_tokens=5, do_sample=False, cache=cache)
    assert torch.equal(static, model.generate(input_ids, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_sync_free_decode_step_matches_full_forward(attn_implementation):
    """`decode_step` (what the CUDA graph captures on a GPU) against a static cache, left padding included."""
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention"])
    model.set_attn_implementation(attn_implementation)
    input_ids = _ids((2, 16), 12)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0  # row 1 is left-padded
    cache = StaticCache(config=model.config, max_cache_len=24)
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask).logits
        model(input_ids[:, :10], attention_mask=attention_mask[:, :10], cache=cache, use_cache=True)
        for t in range(10, 16):
            key_mask = torch.zeros(2, 24, dtype=torch.bool)
            key_mask[:, : t + 1] = attention_mask[:, : t + 1].bool()
            positions = (attention_mask[:, : t + 1].cumsum(-1) - 1)[:, -1:]
            hidden = model.model.decode_step(input_ids[:, t : t + 1], positions, key_mask, cache)
            assert (model.lm_head(hidden)[:, 0] - full[:, t]).abs().max() <= LOGITS_TOL, t


def test_a_static_cache_can_be_reset_and_reused():
    """What a serving loop (and the CUDA-graph decoder, which captures per cache object) relies on."""
    model = tiny_model()
    cache = StaticCache(config=model.config, max_cache_len=32)
    for seed in (13, 14):
        input_ids = _ids((2, 10), seed)
        cache.reset()
        reused = model.generate(input_ids, max_new_tokens=6, do_sample=False, cache=cache)
        assert torch.equal(reused, model.generate(input_ids, max_new_tokens=6, do_sample=False)), seed


def test_generate_does_not_compile_around_cuda_graph_decoding(monkeypatch):
    """With a static cache on CUDA `generate` would torch.compile the forward; our CUDA-graph decoding serves that
    case, so auto-compilation is off there unless graph decoding is disabled (off CUDA: tests/test_compile.py)."""
    from transformers import GenerationConfig

    model = tiny_model(["gated_deltanet", "full_attention"])
    kwargs = {"cache": StaticCache(config=model.config, max_cache_len=16)}
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))  # (only its type is read)
    assert not model._valid_auto_compile_criteria(kwargs, GenerationConfig())
    model.set_cuda_graph_decoding(False)
    assert model._valid_auto_compile_criteria(kwargs, GenerationConfig())

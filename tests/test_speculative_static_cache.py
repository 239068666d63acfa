"""Speculative (assisted) decoding with a static cache: `generate(cache_implementation="static",
prompt_lookup_num_tokens=k)` and `generate(cache_implementation="static", assistant_model=...)` equal plain greedy
decoding token for token, each rejected draft cut back by `crop`: the GDN/KDA layers restored from their kept window
(state_rollback.py), the full-attention layers' counters moved back (the stale slots are rewritten before any query
sees them), the sliding-window layers' buffers rebuilt from their recorded history (static_window_rollback.py).

Float64 throughout, the logits compared at 1e-10 (test_speculative_rollback.py says why that margin). The scripted
drafters (always wrong, always right, random) run with both caches in test_speculative_rollback.py."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import (
    replay_graphs_eagerly,
    replay_prefills_eagerly,
    replay_rounds_eagerly,
    tiny_model,
)
from test_speculative_rollback import (
    MODELS,
    _assert_same_as_plain,
    _ids,
    _model,
)
from transformers import StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import (
    StoppingCriteria,
    StoppingCriteriaList,
)

from hybrid_linear_models.state_rollback import MAX_ROLLBACK_TOKENS
from hybrid_linear_models.static_window_rollback import RollbackSlidingWindowLayer

STATIC = {"cache_implementation": "static"}
TOL = 1e-10


class RandomTokens(CandidateGenerator):
    """A drafter of 1 to 4 random tokens a round (almost always wrong)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def get_candidates(self, input_ids, **kwargs):
        count = int(torch.randint(1, 5, (), generator=self.generator))
        draft = torch.randint(2, 128, (1, count), generator=self.generator)
        return torch.cat([input_ids, draft.to(input_ids)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_with_random_token_drafts_equals_plain_greedy(name, monkeypatch):
    model = _model(MODELS[name])
    monkeypatch.setattr(model, "_get_candidate_generator", lambda *args, **kwargs: RandomTokens(len(name)))
    _assert_same_as_plain(model, _ids((1, 7), 9), 10, prompt_lookup_num_tokens=4, **STATIC)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_assisted_decoding_on_gpu_equals_plain_greedy(name):
    """On CUDA (fla's kernels, float32, graph decoding on: the row runs the batched loop's captured verify rounds):
    prompt lookup and an assistant model with a static cache give plain static greedy decoding's tokens."""
    dims = {"gdn_value_head_dim": 16, "gdn_key_head_dim": 16, "kda_head_dim": 16, "head_dim": 16}  # fla's smallest
    model = tiny_model(MODELS[name], seed=0, **dims).cuda()
    input_ids = torch.tensor([[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 12, 7, 8]], device="cuda")
    settings = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False, "pad_token_id": 0, **STATIC}
    with torch.no_grad():
        plain = model.generate(input_ids, **settings)
        assert torch.equal(model.generate(input_ids, **settings, prompt_lookup_num_tokens=3), plain)
        small = tiny_model(["gated_deltanet", "sliding_attention"], seed=3, **dims).cuda()
        assert torch.equal(model.generate(input_ids, **settings, assistant_model=small), plain)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_prompt_lookup_equals_plain_greedy(name):
    """A repetitive prompt (drafts found and partly accepted); the last draft reaches max_length itself."""
    model = _model(MODELS[name])
    input_ids = torch.tensor([[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 12, 7, 8]])
    _assert_same_as_plain(model, input_ids, 12, prompt_lookup_num_tokens=3, **STATIC)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_assistant_model_equals_plain_greedy(name):
    model = _model(MODELS[name])
    input_ids = _ids((1, 8), 2)
    small = _model(["gated_deltanet", "sliding_attention"], seed=3)
    _assert_same_as_plain(model, input_ids, 12, assistant_model=small, **STATIC)
    _assert_same_as_plain(model, input_ids, 12, assistant_model=copy.deepcopy(model), **STATIC)


class NeverStops(StoppingCriteria):
    """A stopping criterion of the caller's own: the batched speculative loop refuses it, so transformers' runs."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_graph_paths_step_aside_while_the_cache_records(monkeypatch):
    """With graph decoding and prefill on (replayed eagerly on the CPU), a request the batched loop refuses (here a
    stopping criterion of the caller's) runs transformers' assisted loop, which captures nothing: a replayed graph
    keeps nothing a crop restores. Prompt lookup finds no draft in a prompt without repeats, so every round is a
    one-token step, which plain static decoding captures."""
    steps, prefills = replay_graphs_eagerly(monkeypatch), replay_prefills_eagerly(monkeypatch)
    rounds = replay_rounds_eagerly(monkeypatch)
    model = _model(MODELS["gdn+attention"])
    input_ids = torch.arange(10, 18)[None]
    _assert_same_as_plain(model, input_ids, 6, prompt_lookup_num_tokens=3,
                          stopping_criteria=StoppingCriteriaList([NeverStops()]), **STATIC)
    assert not steps and not prefills and not rounds
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **STATIC)
    assert steps  # (the stand-in captures plain static decoding's steps)


def test_one_row_with_graphs_on_replays_its_verify_rounds_not_the_step_graphs(monkeypatch):
    """The same request with generate's own stops only: the batched speculative loop takes the row and replays its
    captured verify round (stood in), the plain step and prefill graphs capture nothing, and the tokens are plain
    greedy decoding's."""
    steps, prefills = replay_graphs_eagerly(monkeypatch), replay_prefills_eagerly(monkeypatch)
    rounds = replay_rounds_eagerly(monkeypatch)
    model = _model(MODELS["gdn+attention"])
    input_ids = torch.tensor([[10, 11, 12, 13, 10, 11, 12, 13]])  # (a repeat: prompt lookup drafts)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, **STATIC)
    with torch.no_grad():
        got = model.generate(input_ids, prompt_lookup_num_tokens=3, **options)
    assert rounds and not steps and not prefills
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(got, model.generate(input_ids, **options))


def _sliding_keys(cache):
    return [(layer.cumulative_length_int, layer.keys.clone(), layer.values.clone())
            for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer)]


def _static_prefix(model, *pieces, record=False, slots=40):
    cache = StaticCache(config=model.config, max_cache_len=slots)
    if record:
        cache.activate_past_recording()
    with torch.no_grad():
        for piece in pieces:
            if piece.shape[1]:
                model(piece, cache=cache, use_cache=True)
    return cache


def test_a_sliding_layer_past_its_window_is_restored_by_crop():
    """Window 6: a 9-token prompt then a 5-token draft pass it; each crop leaves the buffer as a forward of the kept
    prefix writes it, and the continuation's logits agree."""
    model = _model(MODELS["sliding"])
    prompt, draft, more = _ids((1, 9), 3), _ids((1, 5), 4), _ids((1, 2), 5)
    for keep in range(6):
        cache = _static_prefix(model, prompt, draft, record=True)
        assert all(isinstance(layer, RollbackSlidingWindowLayer) for layer in cache.layers
                   if isinstance(layer, StaticSlidingWindowLayer))
        cache.crop(keep - 5)
        expected = _static_prefix(model, prompt, draft[:, :keep])
        for (n_a, k_a, v_a), (n_b, k_b, v_b) in zip(_sliding_keys(cache), _sliding_keys(expected), strict=True):
            assert n_a == n_b
            held = min(n_a, k_a.shape[2])
            torch.testing.assert_close(k_a[:, :, :held], k_b[:, :, :held], rtol=0, atol=TOL)
            torch.testing.assert_close(v_a[:, :, :held], v_b[:, :, :held], rtol=0, atol=TOL)
        with torch.no_grad():
            got = model(more, cache=cache, use_cache=True).logits
            want = model(more, cache=expected, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_a_sliding_layer_crop_it_cannot_restore_is_refused_in_one_line():
    model = _model(MODELS["sliding"])
    cache = _static_prefix(model, _ids((1, 9), 6), _ids((1, 3), 7))  # past the window, not recording
    layer = next(layer for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer))
    with pytest.raises(ValueError, match="activate_past_recording") as error:
        layer.crop(-2)
    assert "\n" not in str(error.value)
    cache = _static_prefix(model, _ids((1, 9), 6), _ids((1, MAX_ROLLBACK_TOKENS), 8), record=True, slots=120)
    layer = next(layer for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer))
    with pytest.raises(ValueError, match="keeps the keys to restore") as error:
        layer.crop(-(MAX_ROLLBACK_TOKENS + 1))
    assert "\n" not in str(error.value)

"""Speculative (assisted) decoding with this family's models: transformers' `generate(prompt_lookup_num_tokens=...)`
and `generate(assistant_model=...)` run, each GDN/KDA layer restored exactly by `cache.crop` after a rejected draft
(state_rollback.py).

Float64 throughout: a verify forward runs k + 1 tokens through the chunked or multi-token recurrent kernels where
plain decoding runs one token at a time, and a restored state is recomputed from the kept window, so they agree to
float64 rounding (~1e-14 on logits of magnitude ~5); 1e-10 leaves that margin and still catches any state that is not
restored (an error of order 1e-2 and more)."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import tiny_model
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from hybrid_linear_models import cache_hybrid_linear, mixer_linear, state_rollback
from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer, past_length

TOL = 1e-10

MODELS = {
    "gdn+attention": ["gated_deltanet", "full_attention", "gated_deltanet"],
    "kda+attention": ["kimi_delta_attention", "full_attention", "kimi_delta_attention"],
    "sliding": ["gated_deltanet", "sliding_attention", "kimi_delta_attention"],  # window 6: passed while decoding
}


def _model(layer_types, seed=0):
    return tiny_model(layer_types, seed=seed).double()


def _ids(shape, seed):
    return torch.randint(2, 128, shape, generator=torch.Generator().manual_seed(seed))


class ScriptedDrafter(CandidateGenerator):
    """A stand-in drafter that knows plain greedy's tokens (`truth`) and proposes k of them (right), k others
    (wrong), or a random number of tokens each randomly right or wrong (random)."""

    def __init__(self, truth: torch.Tensor, kind: str, k: int = 4, seed: int = 0):
        self.truth, self.kind, self.k = truth, kind, k
        self.generator = torch.Generator().manual_seed(seed)

    def get_candidates(self, input_ids, **kwargs):
        start = input_ids.shape[1]
        count = self.k if self.kind != "random" else int(torch.randint(1, self.k + 1, (), generator=self.generator))
        right = self.truth[0, start: start + count]
        right = torch.cat([right, right.new_full((count - right.numel(),), 5)])  # (past the end: anything)
        if self.kind == "right":
            draft = right
        elif self.kind == "wrong":
            draft = (right + 1) % 128
        else:
            keep = torch.rand(count, generator=self.generator) < 0.6
            draft = torch.where(keep, right, (right + 1) % 128)
        return torch.cat([input_ids, draft[None].to(input_ids)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


class LogitsRecorder:
    """Every forward's float64 logits, keyed by the position they predict from and the tokens before it."""

    def __init__(self, model):
        self.rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (position, the tokens up to it, logits)
        self.seen = torch.zeros(0, dtype=torch.long)
        self._past = 0
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True)

    def _before(self, module, args, kwargs):
        self._past = int(past_length(kwargs.get("cache")))  # (a static cache counts in a tensor it updates in place)

    def _after(self, module, args, kwargs, output):
        ids = kwargs["input_ids"]
        tokens = ids.shape[1]
        prefix = torch.cat([self.seen[: self._past], ids[0]])  # (the cache holds the first `past` tokens seen)
        self.seen = prefix
        logits = output.logits[0]
        first = self._past + tokens - logits.shape[0]
        for i in range(logits.shape[0]):
            self.rows.append((first + i, prefix[: first + i + 1].clone(), logits[i].clone()))

    def on(self, sequence: torch.Tensor) -> dict[int, torch.Tensor]:
        """The logits computed on prefixes of `sequence` (the accepted tokens), by position."""
        found: dict[int, list[torch.Tensor]] = {}
        for position, prefix, logits in self.rows:
            if position < sequence.numel() and torch.equal(prefix, sequence[: position + 1]):
                found.setdefault(position, []).append(logits)
        return found


def _greedy(model, input_ids, new_tokens, **kwargs):
    recorder = LogitsRecorder(model)
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    model._forward_hooks.clear()
    model._forward_pre_hooks.clear()
    return out, recorder


def _assert_same_as_plain(model, input_ids, new_tokens, **assisted):
    # (the reference: plain greedy decoding on the dynamic cache, eager, whatever generate would choose itself)
    plain, plain_logits = _greedy(model, input_ids, new_tokens, cache_implementation="dynamic")
    got, got_logits = _greedy(model, input_ids, new_tokens, **assisted)
    assert torch.equal(got, plain)
    reference = plain_logits.on(plain[0])
    accepted = got_logits.on(got[0])
    assert set(range(input_ids.shape[1] - 1, plain.shape[1] - 1)) <= set(accepted)
    for position, rows in accepted.items():
        if position in reference:
            for logits in rows:
                torch.testing.assert_close(logits, reference[position][0], rtol=0, atol=TOL)
    return plain


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["wrong", "right", "random"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_with_a_drafter_equals_plain_greedy(name, kind, cache, monkeypatch):
    model = _model(MODELS[name])
    input_ids = _ids((1, 9), 1)
    with torch.no_grad():
        truth = model.generate(input_ids, max_new_tokens=14, min_new_tokens=14, do_sample=False, pad_token_id=0)
    drafter = ScriptedDrafter(truth, kind, k=4, seed=len(name))
    monkeypatch.setattr(model, "_get_candidate_generator", lambda *args, **kwargs: drafter)
    crops = []
    original = LinearStateLayer.crop
    monkeypatch.setattr(LinearStateLayer, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    # (prompt_lookup_num_tokens: the mode switch; the drafter is ours)
    _assert_same_as_plain(model, input_ids, 14, prompt_lookup_num_tokens=4, **cache)
    if kind != "right":
        assert any(n < 0 for n in crops)  # drafts were rejected and the states restored


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["wrong", "random"])
def test_rounds_of_more_drafts_than_a_state_restores_are_cut(kind, cache, monkeypatch):
    """A drafter proposing 80 tokens a round (more than a GDN/KDA window restores: MAX_ROLLBACK_TOKENS) has each
    round cut to MAX_VERIFY_TOKENS - 1 drafts and to max_length, and the output is still plain greedy's."""
    from transformers.generation.utils import GenerationMixin

    from hybrid_linear_models.speculative_decoding import MAX_VERIFY_TOKENS

    model = _model(MODELS["sliding"])
    input_ids = _ids((1, 9), 4)
    with torch.no_grad():
        truth = model.generate(input_ids, max_new_tokens=70, min_new_tokens=70, do_sample=False, pad_token_id=0)
    drafter = ScriptedDrafter(truth, kind, k=80, seed=5)
    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", lambda *args, **kwargs: drafter)
    drafted = []
    original = ScriptedDrafter.get_candidates

    def recorded(self, ids, **kwargs):
        out = original(self, ids, **kwargs)
        drafted.append(out[0].shape[1] - ids.shape[1])
        return out

    monkeypatch.setattr(ScriptedDrafter, "get_candidates", recorded)
    with torch.no_grad():
        got = model.generate(input_ids, max_new_tokens=70, min_new_tokens=70, do_sample=False, pad_token_id=0,
                             prompt_lookup_num_tokens=80, **cache)
    assert torch.equal(got, truth)
    assert max(drafted) > MAX_VERIFY_TOKENS - 1  # (the drafter's own rounds: cut by the model's generator)


def test_prompt_lookup_of_a_long_repeat_equals_plain_greedy():
    """transformers' prompt lookup proposing 70 tokens (a prompt that repeats a 100-token stretch): rounds cut to
    what a crop restores, the tokens plain greedy's."""
    model = _model(MODELS["gdn+attention"])
    stretch = _ids((1, 100), 11)
    _assert_same_as_plain(model, torch.cat([stretch, stretch[:, :10]], dim=1), 16, prompt_lookup_num_tokens=70)


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_prompt_lookup_equals_plain_greedy(name):
    model = _model(MODELS[name])
    input_ids = torch.tensor([[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 12, 7, 8]])  # n-grams to look up
    _assert_same_as_plain(model, input_ids, 12, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_assistant_model_equals_plain_greedy(name):
    """A smaller model of the family (two layers, other weights, the same vocabulary), and the model itself (always
    right), as the assistant; both caches are cropped every round."""
    model = _model(MODELS[name])
    input_ids = _ids((1, 8), 2)
    small = _model(["gated_deltanet", "full_attention"], seed=3)
    _assert_same_as_plain(model, input_ids, 12, assistant_model=small)
    _assert_same_as_plain(model, input_ids, 12, assistant_model=copy.deepcopy(model))


@pytest.mark.parametrize("layer_types", [["gated_deltanet"], ["kimi_delta_attention", "gated_deltanet"]])
def test_models_of_linear_layers_alone_draft_and_verify(layer_types):
    """Without an attention layer, as the model and as its assistant (transformers asks the assistant's cache its
    length, which only attention layers tell it: `generate` builds a LinearOnlyDynamicCache for such a model)."""
    model = _model(layer_types)
    input_ids = torch.tensor([[7, 8, 9, 10, 7, 8, 9, 11, 7, 8]])
    _assert_same_as_plain(model, input_ids, 10, prompt_lookup_num_tokens=3)
    _assert_same_as_plain(model, input_ids, 10, assistant_model=_model(["gated_deltanet"], seed=4))
    _assert_same_as_plain(_model(MODELS["gdn+attention"]), input_ids, 10, assistant_model=model)


def _layer_states(cache):
    states = []
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            states.append((layer.seen_tokens, layer.conv_state.clone(), layer.recurrent_state.clone()))
        else:
            states.append((layer.get_seq_length(), layer.keys.clone(), layer.values.clone()))
    return states


def _assert_same_states(got, expected):
    for (count_a, *a), (count_b, *b) in zip(got, expected, strict=True):
        assert count_a == count_b
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=TOL)


def _prefix_cache(model, *pieces, attention_mask=None, record=False):
    cache = DynamicCache(config=model.config)
    if record:
        cache.activate_past_recording()
    seen = 0
    with torch.no_grad():
        for piece in pieces:
            seen += piece.shape[1]
            mask = None if attention_mask is None else attention_mask[:, :seen]
            model(piece, cache=cache, use_cache=True, attention_mask=mask)
    return cache


@pytest.mark.parametrize("name", list(MODELS))
def test_crop_then_continuation_equals_a_forward_of_the_prefix(name):
    """A verify forward of 5 tokens onto a cache, cut back to each prefix, holds the states a forward of that prefix
    leaves, and continues as it does. The GDN/KDA layers keep what restores a short continuation without
    activate_past_recording; transformers' sliding-window layers past their window need it."""
    model = _model(MODELS[name])
    prompt, draft, more = _ids((1, 11), 3), _ids((1, 5), 4), _ids((1, 3), 5)
    for keep in range(6):
        cache = _prefix_cache(model, prompt, draft, record=name == "sliding")
        cache.crop(keep - 5)
        expected = _prefix_cache(model, prompt, draft[:, :keep]) if keep else _prefix_cache(model, prompt)
        _assert_same_states(_layer_states(cache), _layer_states(expected))
        with torch.no_grad():
            got = model(more, cache=cache, use_cache=True).logits
            want = model(more, cache=expected, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    if name != "sliding":  # (transformers' sliding layer keeps only its window after a crop)
        cache = _prefix_cache(model, prompt, draft)
        cache.crop(-1)
        cache.crop(-2)  # a second crop before any forward
        _assert_same_states(_layer_states(cache), _layer_states(_prefix_cache(model, prompt, draft[:, :2])))


@pytest.mark.parametrize("name", list(MODELS))
def test_recorded_crops_reach_over_several_forwards_and_long_prompts(name):
    """While the cache records its past (as assisted generate asks): a crop reaches back over one-token steps (the
    assistant's drafting) and into the prompt's last tokens (the first verify forward is the prompt plus a draft)."""
    model = _model(MODELS[name])
    prompt = _ids((1, state_rollback.MAX_ROLLBACK_TOKENS + 6), 6)
    steps = _ids((1, 4), 7)
    for remove, expected in ((3, (prompt, steps[:, :1])), (7, (prompt[:, :-3],))):
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
        with torch.no_grad():
            model(prompt, cache=cache, use_cache=True)
            assert cache.is_croppable
            for t in range(4):
                model(steps[:, t: t + 1], cache=cache, use_cache=True)
        cache.crop(-remove)
        _assert_same_states(_layer_states(cache), _layer_states(_prefix_cache(model, *expected)))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_one_token_step_after_a_crop_is_undone(name):
    """After a crop the next forward starts a window; a one-token step (assisted decoding's round without a draft)
    keeps the convolution inputs before it, so crop(-1) undoes it."""
    model = _model(MODELS[name])
    prompt, step = _ids((1, 10), 15), _ids((1, 1), 16)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        cache.crop(0)
        model(step, cache=cache, use_cache=True)
    cache.crop(-1)
    _assert_same_states(_layer_states(cache), _layer_states(_prefix_cache(model, prompt)))


def test_a_window_keeps_its_last_tokens_past_its_bound(monkeypatch):
    """Past twice the bound, a window's oldest tokens are folded into its start state; the last MAX_ROLLBACK_TOKENS
    stay restorable, and a crop further back is refused."""
    for module in (state_rollback, cache_hybrid_linear, mixer_linear):
        monkeypatch.setattr(module, "MAX_ROLLBACK_TOKENS", 3)
    model = _model(MODELS["gdn+attention"])
    prompt, steps = _ids((1, 5), 8), _ids((1, 8), 9)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        for t in range(8):
            model(steps[:, t: t + 1], cache=cache, use_cache=True)
    window = next(layer for layer in cache.layers if isinstance(layer, LinearStateLayer)).rollback
    assert 3 <= window.tokens <= 6
    cache.crop(-3)
    _assert_same_states(_layer_states(cache), _layer_states(_prefix_cache(model, prompt, steps[:, :5])))


def test_left_padded_batch_crops_every_row():
    """transformers' assisted decoding takes one row (it refuses batches); the cache's crop restores every row of a
    left-padded batch, each as that row's own prefix forward leaves it."""
    model = _model(MODELS["sliding"])
    prompt, draft = _ids((2, 8), 10), _ids((2, 4), 11)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    cache = _prefix_cache(model, prompt, draft, attention_mask=mask, record=True)
    cache.crop(-2)
    expected = _prefix_cache(model, prompt, draft[:, :2], attention_mask=mask)
    _assert_same_states(_layer_states(cache), _layer_states(expected))


def test_a_crop_to_a_token_not_kept_is_refused_in_one_line():
    model = _model(MODELS["gdn+attention"])
    prompt, step, draft = _ids((1, 6), 12), _ids((1, 1), 13), _ids((1, 3), 14)
    cache = _prefix_cache(model, prompt, step)  # a plain decoding step keeps nothing
    with pytest.raises(ValueError, match="holds 7 tokens and can be restored to none of them") as error:
        cache.crop(-1)
    assert "\n" not in str(error.value)
    cache = _prefix_cache(model, prompt, draft)
    with pytest.raises(ValueError, match=r"holds 9 tokens and can be restored to 6 to 9 tokens") as error:
        cache.crop(-4)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="negative count"):
        next(layer for layer in cache.layers if isinstance(layer, LinearStateLayer)).crop(2)

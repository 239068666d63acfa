"""Property-based fuzzing of the model's inputs (hypothesis): input_ids, inputs_embeds, attention_mask, position_ids,
labels and cu_seq_lens_q of every dtype, shape and value range (model_input_strategies), with caches of every kind
(none, empty, holding tokens of these rows or of others, static caches too small, the legacy tuple).

Property: the forward either raises one ValueError/TypeError line naming an input, or gives exactly what the same
call gives with its inputs in their canonical form (integer tensors as int64, the mask as 0/1 int64, the cache as it
was before the call): the dtype of an accepted input changes nothing. Nothing else escapes (RuntimeError, IndexError,
AttributeError, a process abort). Every part drawn valid and consistent must run.

Reproducible (derandomize=True) and bounded: one tiny model of every mixer, a few dozen examples of a few tokens.
"""

from __future__ import annotations

import copy

import torch
from fuzz_strategies import FUZZ_SETTINGS
from hypothesis import event, given, settings
from model_helpers import tiny_model
from model_input_strategies import model_inputs
from transformers import DynamicCache, StaticCache

MODEL = tiny_model()  # vocab 128, hidden 64; GDN, attention, KDA, sliding attention (window 6)
INPUT_NAMES = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "cu_seq_lens", "cache",
               "past_key_values")


def _rows_of(inputs: dict) -> int:
    for name in ("input_ids", "inputs_embeds"):
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    return 1


def build_cache(kind: str, rows: int):
    """A cache of `kind` (model_input_strategies.CACHE_KINDS) for a call with `rows` rows."""
    config = MODEL.config
    if kind == "none":
        return None
    if kind == "legacy tuple":
        return tuple((torch.zeros(rows, 2, 3, 16), torch.zeros(rows, 2, 3, 16)) for _ in range(4))
    if kind == "list":
        return []
    if kind.startswith("dynamic"):
        cache = DynamicCache(config=config)
    else:
        cache = StaticCache(config=config, max_cache_len={"static": 16, "static too small": 2}.get(kind, 8))
    if kind.endswith(("holding tokens", "other rows")):
        held_rows = rows + 1 if kind.endswith("other rows") else rows
        with torch.no_grad():
            MODEL(torch.randint(0, config.vocab_size, (held_rows, 3), generator=torch.Generator().manual_seed(0)),
                  cache=cache, use_cache=True)
    return cache


def canonical(inputs: dict) -> dict:
    """The same inputs with every integer (or bool mask) tensor as int64: values unchanged."""
    result = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point or value.dtype.is_complex):
            value = value.long()
        elif name == "attention_mask" and isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            value = value.long() if bool(((value == 0) | (value == 1)).all()) else value
        result[name] = value
    return result


def run(inputs: dict, cache) -> tuple[str, object]:
    try:
        with torch.no_grad():
            return "ran", MODEL(**inputs, cache=cache, use_cache=cache is not None)
    except (ValueError, TypeError) as error:
        return "refused", error


@settings(FUZZ_SETTINGS, max_examples=80, deadline=None)  # (a forward of the tiny model: ~0.1 s)
@given(model_inputs(vocab=128, hidden=64))
def test_model_inputs_are_refused_in_one_line_or_give_the_canonical_result(drawn):
    inputs, cache_kind, must_run = drawn
    rows = _rows_of(inputs)
    cache = build_cache(cache_kind, rows)
    before = copy.deepcopy(cache)
    outcome, result = run(inputs, cache)
    event(f"{outcome}, cache {cache_kind}")
    if outcome == "refused":
        message = str(result)
        assert "\n" not in message and len(message) < 600, message
        assert any(name in message for name in INPUT_NAMES + ("static cache", "StaticCache")), message
        assert not must_run, f"valid inputs refused: {message}"
        return
    reference_outcome, reference = run(canonical(inputs), before)
    assert reference_outcome == "ran", f"accepted, but its canonical form is refused: {reference}"
    torch.testing.assert_close(result.logits, reference.logits, rtol=0, atol=0, equal_nan=True)
    if reference.loss is not None:
        torch.testing.assert_close(result.loss, reference.loss, rtol=0, atol=0, equal_nan=True)

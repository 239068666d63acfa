"""The MTP head as the drafter of a left-padded batch: `generate(..., use_mtp=k)` with several rows runs batched
greedy speculative decoding (speculative_decoding.py) with `MtpBatchDrafter` (mtp_drafting.py).

What must hold, float64 models:
- each row's tokens are its plain greedy decoding alone (any drafts: the batched rule), for k = 1..4;
- a head that always agrees has every draft of every live row accepted; one that never agrees, none;
- the head's shared cache, with its masked entries (pads, rejected drafts, last round's recursion), gives each row
  the head's output of a fresh run over that row's accepted tokens alone: every round's first-draft logits equal
  the head run afresh over the row (the model's hidden states of an uncached forward), to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_model
from test_mtp import _head_that_agrees, _head_that_nearly_agrees
from test_speculative_batched import _alone, _batch

from hybrid_linear_models.mtp_drafting import MtpBatchDrafter
from hybrid_linear_models.speculative_decoding import speculative_generate

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention"]
NEW = 12


def _model(layer_types=LAYERS, seed=0) -> torch.nn.Module:
    return tiny_model(layer_types, seed=seed, num_mtp_layers=1).double()


def _rounds(monkeypatch) -> list[tuple[list[int], list[bool]]]:
    """(kept per row, live per row) of every round the batched drafter observes."""
    seen = []
    observe = MtpBatchDrafter.observe

    def recording(self, greedy, kept, hidden):
        seen.append(kept.tolist())
        return observe(self, greedy, kept, hidden)

    monkeypatch.setattr(MtpBatchDrafter, "observe", recording)
    return seen


@pytest.mark.parametrize("use_mtp", [1, 2, 4])
@pytest.mark.parametrize("layer_types", [LAYERS, ["gated_deltanet", "sliding_attention", "full_attention"]])
def test_each_row_is_its_plain_greedy_decoding(layer_types, use_mtp):
    model = _model(layer_types)
    ids, mask = _batch()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             use_mtp=use_mtp)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))


@pytest.mark.parametrize("use_mtp", [1, 3])
def test_a_head_that_always_agrees_has_every_draft_accepted_in_every_row(monkeypatch, use_mtp):
    model = _model()
    _head_that_agrees(model, 1.0)
    rounds = _rounds(monkeypatch)
    ids, mask = _batch()
    with torch.no_grad():
        out = speculative_generate(model, ids, MtpBatchDrafter(model), num_tokens=use_mtp + 1, max_new_tokens=NEW,
                                   attention_mask=mask)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))
    # every live row keeps the k tokens it verified (its drafts, then the model's own token), until it has its NEW
    assert rounds and all(kept == [use_mtp + 1] * 3 for kept in rounds[:-1]), rounds
    assert len(rounds) == -(-(NEW - 1) // (use_mtp + 1))


def test_a_head_that_never_agrees_has_no_draft_accepted(monkeypatch):
    model = _model()
    _head_that_agrees(model, -1.0)
    rounds = _rounds(monkeypatch)
    ids, mask = _batch()
    with torch.no_grad():
        out = speculative_generate(model, ids, MtpBatchDrafter(model), num_tokens=4, max_new_tokens=NEW,
                                   attention_mask=mask)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))
    assert rounds and all(kept == [1, 1, 1] for kept in rounds), rounds


@pytest.mark.parametrize("head", ["random", "nearly_right"])
def test_every_first_draft_is_the_head_run_afresh_over_the_rows_accepted_tokens(monkeypatch, head):
    """The bookkeeping of the shared head cache: after rounds of full, partial and no acceptance, rows of different
    lengths, each row's first draft logits equal the head over that row's accepted sequence alone, from scratch."""
    model = _model()
    if head == "nearly_right":
        _head_that_nearly_agrees(model)
    ids, mask = _batch()
    rows = [row[real].tolist() for row, real in zip(ids, mask.bool())]  # each row's accepted tokens so far
    errors, kept_seen = [], []
    start, observe = MtpBatchDrafter.start, MtpBatchDrafter.observe

    def check(drafter):
        got = model.lm_head(drafter.g).float()
        for b, tokens in enumerate(rows):
            sequence = torch.tensor([tokens])
            hidden = model.model(sequence).last_hidden_state
            positions = torch.arange(sequence.shape[1]).unsqueeze(0)
            g = model.mtp(hidden[:, :-1], model.model.embed_tokens(sequence[:, 1:]), positions[:, 1:])
            errors.append((got[b] - model.lm_head(g[0, -1]).float()).abs().max().item())

    def checking_start(self, input_ids, attention_mask, hidden, first):
        start(self, input_ids, attention_mask, hidden, first)
        for b, token in enumerate(first.tolist()):
            rows[b].append(token)
        check(self)

    def checking_observe(self, greedy, kept, hidden):
        observe(self, greedy, kept, hidden)
        kept_seen.append(kept.tolist())
        for b, count in enumerate(kept.tolist()):
            rows[b] += greedy[b, :count].tolist()
        check(self)

    monkeypatch.setattr(MtpBatchDrafter, "start", checking_start)
    monkeypatch.setattr(MtpBatchDrafter, "observe", checking_observe)
    with torch.no_grad():
        out = speculative_generate(model, ids, MtpBatchDrafter(model), num_tokens=4, max_new_tokens=NEW,
                                   attention_mask=mask)
    assert torch.equal(out[:, ids.shape[1]:], _alone(model, ids, mask))
    # logits of order 10 in float32 (as generate's): rounding ~1e-6; an entry missing, doubled, unmasked or at the
    # wrong position moves them by 1e-2 and more
    assert errors and max(errors) <= 1e-5, errors
    if head == "nearly_right":
        assert any(1 < kept < 4 for round_ in kept_seen for kept in round_), kept_seen


def test_batched_mtp_refuses_sampling_in_one_line():
    model = _model()
    ids, mask = _batch()
    with pytest.raises(ValueError, match="does not take do_sample=True") as caught:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, use_mtp=2)
    assert "\n" not in str(caught.value)

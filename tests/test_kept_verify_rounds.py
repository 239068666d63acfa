"""Captured verify rounds kept across speculative calls with their caches (kept_verify_rounds.py), on the CPU: the
capture stood in by an eager replay of the captured function (model_helpers.replay_rounds_eagerly), which reads the
kept cache and drafter as a CUDA graph would. A later call of the same shape captures nothing and still decodes each
row as plain greedy decoding alone (float64); a weight given new storage, another shape, or a new graph setting
captures afresh."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import replay_rounds_eagerly, tiny_model
from test_speculative_batched import RandomDrafter, _alone, _batch

from hybrid_linear_models import kept_verify_rounds
from hybrid_linear_models.mtp_drafting import MtpBatchDrafter
from hybrid_linear_models.speculative_decoding import (
    CapturedVerifyRound,
    PromptLookupDrafter,
    speculative_generate,
)

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"]
NEW = 10


@pytest.fixture
def captures(monkeypatch) -> list:
    """Replays stood in (replay_rounds_eagerly); returns the list that counts the captures."""
    replay_rounds_eagerly(monkeypatch)
    counted, record = [], CapturedVerifyRound._record

    def counting(run, device, reset, pool):
        counted.append(1)
        return record(run, device, reset, pool)

    monkeypatch.setattr(CapturedVerifyRound, "_record", staticmethod(counting))
    return counted


def _model():
    return tiny_model(LAYERS, seed=0, num_mtp_layers=1, sliding_window=6).double()


def _generate(model, seed: int, drafter, num_tokens: int = 3, rows: int = 3, length: int = 9):
    ids, mask = _batch(seed, rows, length)
    with torch.no_grad():
        out = speculative_generate(model, ids, drafter, num_tokens=num_tokens, max_new_tokens=NEW,
                                   attention_mask=mask, graphs=True)
    assert torch.equal(out[:, length:], _alone(model, ids, mask, NEW))  # each row its plain greedy decoding alone
    return out


@pytest.mark.parametrize("drafter", ["mtp", "prompt_lookup", "random"])
def test_a_later_call_of_the_same_shape_replays_the_kept_round(captures, drafter):
    """Three calls of other prompts (the third of other prompt lengths in the same slot bucket): one capture, every
    row exact. The MTP head's drafter, which the round runs on the device, is the kept one: its cache and state too
    are started over in place."""
    model = _model()
    make = {"mtp": lambda: MtpBatchDrafter(model), "prompt_lookup": PromptLookupDrafter,
            "random": RandomDrafter}[drafter]
    _generate(model, 1, make())
    kept = list(model._kept_verify_rounds._rounds.values())
    assert len(captures) == 1 and len(kept) == 1
    buffers = [t.data_ptr() for t in kept[0].cache.tensors()]
    _generate(model, 2, make())
    _generate(model, 3, make(), length=12)
    assert len(captures) == 1
    assert [t.data_ptr() for t in kept[0].cache.tensors()] == buffers


def test_another_shape_captures_its_own_round_and_few_are_kept(captures, monkeypatch):
    """Another batch or k is another round; at most KEPT_ROUNDS are kept, the least recently used dropped (and
    captured again when asked for)."""
    monkeypatch.setattr(kept_verify_rounds, "KEPT_ROUNDS", 2)
    model = _model()
    _generate(model, 1, RandomDrafter(), num_tokens=2)
    _generate(model, 1, RandomDrafter(), num_tokens=3)
    _generate(model, 1, RandomDrafter(), num_tokens=3, rows=2)
    assert len(captures) == 3 and len(model._kept_verify_rounds._rounds) == 2
    _generate(model, 1, RandomDrafter(), num_tokens=3)  # kept
    assert len(captures) == 3
    _generate(model, 1, RandomDrafter(), num_tokens=2)  # dropped: captured again
    assert len(captures) == 4


def test_a_weight_given_new_storage_captures_again(captures):
    """The kept round reads the weights by address: a parameter replaced (here the LM head's, with other values)
    drops it, and the call decodes with the new weights."""
    model = _model()
    _generate(model, 1, MtpBatchDrafter(model))
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.flip(0).clone())
    _generate(model, 2, MtpBatchDrafter(model))
    assert len(captures) == 2


def test_graph_settings_and_copies_start_with_nothing_kept(captures):
    model = _model()
    _generate(model, 1, RandomDrafter())
    copied = copy.deepcopy(model)
    assert not copied._kept_verify_rounds._rounds
    _generate(copied, 1, RandomDrafter())
    assert len(captures) == 2
    model.set_cuda_graph_decoding(True)
    assert not model._kept_verify_rounds._rounds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [{"use_mtp": 2}, {"prompt_lookup_num_tokens": 3}], ids=["mtp", "prompt_lookup"])
def test_a_kept_captured_round_decodes_as_a_fresh_capture_on_gpu(options):
    """On CUDA, bf16, real graphs: `generate` of other prompts replaying the round kept from an earlier call gives the
    tokens of the same call on a copy of the model that captures its own round (the same kernels: bit for bit), and
    records no new graph."""
    model = tiny_model(LAYERS, seed=0, num_mtp_layers=1, sliding_window=6,
                       gdn_value_head_dim=16, gdn_key_head_dim=16, kda_head_dim=16, head_dim=16
                       ).to("cuda", torch.bfloat16)
    fresh = copy.deepcopy(model)
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None, **options)
    (first, first_mask), (second, second_mask) = (
        (ids.cuda(), mask.cuda()) for ids, mask in (_batch(1), _batch(2)))
    with torch.no_grad():
        model.generate(first, attention_mask=first_mask, **settings)
        rounds = list(model._kept_verify_rounds._rounds.values())
        assert len(rounds) == 1 and rounds[0].round is not None
        graph = rounds[0].round.graph
        kept = model.generate(second, attention_mask=second_mask, **settings)
        assert rounds[0].round.graph is graph
        assert torch.equal(kept, fresh.generate(second, attention_mask=second_mask, **settings))

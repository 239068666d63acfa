"""The MTP head as the drafter of a left-padded batch: `generate(..., use_mtp=k)` with several rows runs batched
greedy speculative decoding (speculative_decoding.py) with `MtpBatchDrafter` (mtp_drafting.py).

What must hold, float64 models:
- each row's tokens are its plain greedy decoding alone (any drafts: the batched rule), for k = 1..4;
- a head that always agrees has every draft of every live row accepted; one that never agrees, none;
- the head's shared cache, with its per-row lengths (pads, rejected drafts and last round's recursion out of sight),
  gives each row the head's output of a fresh run over that row's accepted tokens alone: every round's first-draft
  logits equal the head run afresh over the row (the model's hidden states of an uncached forward), to float64
  rounding;
- a round drafts the next round's tokens without reading a device value on the host, so a captured round (CUDA
  graph; stood in by an eager replay on the CPU) drafts them too, and its rounds are the uncaptured loop's.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import HostReadsRefused, replay_rounds_eagerly, tiny_model
from test_mtp import _head_that_agrees, _head_that_nearly_agrees
from test_speculative_batched import GPU_DIMS, _alone, _batch

from hybrid_linear_models import speculative_decoding
from hybrid_linear_models.kernels_gemv import decode_gemv_mode
from hybrid_linear_models.mtp_drafting import MtpBatchDrafter
from hybrid_linear_models.mtp_parallel_drafting import ParallelMtpBatchDrafter
from hybrid_linear_models.speculative_decoding import (
    CapturedVerifyRound,
    speculative_generate,
)

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention"]
NEW = 12


def _model(layer_types=LAYERS, seed=0) -> torch.nn.Module:
    return tiny_model(layer_types, seed=seed, num_mtp_layers=1).double()


def track_rows(monkeypatch, drafter_class, rows: list[list[int]], check, kept_seen: list | None = None) -> None:
    """Patches `drafter_class`'s start and observe: each row's tokens gained are appended to `rows` (its accepted
    tokens so far), then `check(drafter)` runs; each round's kept counts go to `kept_seen`."""
    start, observe = drafter_class.start, drafter_class.observe

    def checking_start(self, input_ids, attention_mask, hidden, first, slots):
        start(self, input_ids, attention_mask, hidden, first, slots)
        for b, token in enumerate(first.tolist()):
            rows[b].append(token)
        check(self)

    def checking_observe(self, greedy, kept, hidden):
        observe(self, greedy, kept, hidden)
        if kept_seen is not None:
            kept_seen.append(kept.tolist())
        for b, count in enumerate(kept.tolist()):
            rows[b] += greedy[b, :count].tolist()
        check(self)

    monkeypatch.setattr(drafter_class, "start", checking_start)
    monkeypatch.setattr(drafter_class, "observe", checking_observe)


def _rounds(monkeypatch, drafter_class: type = MtpBatchDrafter) -> list[list[int]]:
    """The tokens each row kept in every round the batched drafter (of `drafter_class`) observes."""
    seen = []
    observe = drafter_class.observe

    def recording(self, greedy, kept, hidden):
        seen.append(kept.tolist())
        return observe(self, greedy, kept, hidden)

    monkeypatch.setattr(drafter_class, "observe", recording)
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

    def check(drafter):
        got = model.lm_head(drafter.g).float()
        for b, tokens in enumerate(rows):
            sequence = torch.tensor([tokens])
            hidden = model.model(sequence).last_hidden_state
            positions = torch.arange(sequence.shape[1]).unsqueeze(0)
            g = model.mtp(hidden[:, :-1], model.model.embed_tokens(sequence[:, 1:]), positions[:, 1:])
            errors.append((got[b] - model.lm_head(g[0, -1]).float()).abs().max().item())

    track_rows(monkeypatch, MtpBatchDrafter, rows, check, kept_seen)
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


def _started(model, ids, mask, num_tokens, slots=40, drafter_class=MtpBatchDrafter):
    """A verify cache and an MTP drafter after the prompts, and the first round's tokens [B, num_tokens]."""
    cache = speculative_decoding.VerifyCache(model, ids.shape[0], slots, ids.device)
    drafter = drafter_class(model)
    first, hidden = speculative_decoding.prefill(model, cache, ids, mask, with_hidden=True)
    drafter.start(ids, mask, hidden, first, cache.slots)
    return cache, drafter, torch.cat([first[:, None], drafter.draft(None, num_tokens - 1)], dim=1)


def test_a_drafting_round_reads_nothing_on_the_host():
    """The round, the head's entries and its next drafts read no device value on the host (what a CUDA graph
    captures: see test_speculative_batched's verify-round test)."""
    model = _model()
    _head_that_nearly_agrees(model)
    ids, mask = _batch()
    with torch.no_grad():
        cache, drafter, step = _started(model, ids, mask, 4)
        live = torch.ones(3, dtype=torch.bool)
        with HostReadsRefused():
            with pytest.raises(AssertionError):  # (the refusal is in place)
                bool(torch.ones(()))
            greedy, _kept, drafts = speculative_decoding.drafting_round(model, cache, step, live, drafter)
    assert drafts.shape == (3, 3) and greedy.shape == (3, 4)


def _head_outputs(monkeypatch) -> list[torch.Tensor]:
    """The head's output g [B, H] at each row's last accepted position after every `MtpBatchDrafter.observe`: what
    the next drafts are made from (a cache entry at a wrong slot or position, or a stale one in sight, moves it)."""
    seen = []
    observe = MtpBatchDrafter.observe

    def recording(self, greedy, kept, hidden):
        observe(self, greedy, kept, hidden)
        seen.append(self.g.clone())

    monkeypatch.setattr(MtpBatchDrafter, "observe", recording)
    return seen


@pytest.mark.parametrize("use_mtp", [1, 3])
@pytest.mark.parametrize("head", ["random", "nearly_right"])
def test_captured_drafting_rounds_are_the_uncaptured_ones(monkeypatch, use_mtp, head):
    """`graphs=True` (the capture stood in by an eager replay of the captured function): every round after the first
    is a replay, which drafts the next round's tokens itself; its head outputs and counts are the uncaptured loop's, and
    each row is its plain greedy decoding alone."""
    model = _model()
    if head == "nearly_right":
        _head_that_nearly_agrees(model)
    ids, mask = _batch()
    runs = {}
    for graphs in (False, True):
        outputs, rounds = _head_outputs(monkeypatch), _rounds(monkeypatch)
        replays = replay_rounds_eagerly(monkeypatch) if graphs else []
        with torch.no_grad():
            out = speculative_generate(model, ids, MtpBatchDrafter(model), num_tokens=use_mtp + 1,
                                       max_new_tokens=NEW, attention_mask=mask, graphs=graphs)
        runs[graphs] = (out, list(rounds), list(outputs), len(replays))
    (plain, plain_rounds, plain_g, _), (captured, captured_rounds, captured_g, replayed) = runs.values()
    assert torch.equal(plain[:, ids.shape[1]:], _alone(model, ids, mask))
    assert torch.equal(captured, plain)
    assert replayed == len(plain_rounds) > 1
    # the captured run's rounds: its capture's two runs (put back after), then one per replay; the same ops on the
    # same values, so the head's outputs are equal bit for bit
    assert captured_rounds[2:] == plain_rounds, (captured_rounds, plain_rounds)
    assert len(captured_g[2:]) == len(plain_g)
    assert all(torch.equal(a, b) for a, b in zip(captured_g[2:], plain_g))
    if head == "nearly_right" and use_mtp > 1:
        assert any(1 < kept < use_mtp + 1 for round_ in plain_rounds for kept in round_), plain_rounds


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("head", ["agrees", "nearly_right"])
def test_rounds_run_ahead_of_the_host_keep_every_row_exact(monkeypatch, graphs, head):
    """With the drafts made on the device, CUDA runs a round ahead of the host's read of the one before
    (`rounds_ahead`; forced here on the CPU, the capture stood in): a row that ends, at its end-of-sequence token or
    at max_new_tokens, is still live in the round already launched. Each row's tokens are still its plain greedy
    decoding alone, cut at its end, padded after it."""
    monkeypatch.setattr(speculative_decoding, "rounds_ahead", lambda on_device, device: int(on_device))
    model = _model()
    if head == "agrees":
        _head_that_agrees(model, 1.0)
    else:
        _head_that_nearly_agrees(model)
    if graphs:
        replay_rounds_eagerly(monkeypatch)
    assert_rows_end_as_alone(model, MtpBatchDrafter, graphs)


def assert_rows_end_as_alone(model, drafter_class, graphs: bool) -> None:
    """`_batch()`'s rows decoded with `drafter_class`, without a stop and with row 1's fifth token as the
    end-of-sequence token: each row's tokens are its plain greedy decoding alone, cut at its end, padded after it."""
    ids, mask = _batch()
    truth = _alone(model, ids, mask)
    eos = int(truth[1, 4])  # row 1's fifth token
    for stop in ({}, {"eos_token_id": eos}):
        with torch.no_grad():
            got = speculative_generate(model, ids, drafter_class(model), num_tokens=4, max_new_tokens=NEW,
                                       attention_mask=mask, pad_token_id=0, graphs=graphs, **stop)[:, ids.shape[1]:]
        for b in range(3):
            ends = (truth[b] == eos).nonzero().flatten() if stop else torch.tensor([])
            end = int(ends[0]) + 1 if ends.numel() else NEW
            assert torch.equal(got[b, :end], truth[b, :end]), (stop, b)
            assert (got[b, end:] == 0).all()


@pytest.mark.parametrize("new", range(2, 8))
def test_a_round_run_past_the_last_rows_end_stays_within_the_cache(monkeypatch, new):
    """The round run ahead writes k more tokens into a row that has ended, its last round having gained up to k - 1
    tokens past max_new_tokens (a head that always agrees, k = 5: every round gains 5); the verify cache's slots
    hold them (a write past its slots raises), for every max_new_tokens modulo k."""
    monkeypatch.setattr(speculative_decoding, "rounds_ahead", lambda on_device, device: int(on_device))
    model = _model()
    _head_that_agrees(model, 1.0)
    ids, mask = _batch()
    with torch.no_grad():
        got = speculative_generate(model, ids, MtpBatchDrafter(model), num_tokens=5, max_new_tokens=new,
                                   attention_mask=mask)
    assert torch.equal(got[:, ids.shape[1]:], _alone(model, ids, mask, new))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("drafter_class, heads", [
    (MtpBatchDrafter, {"num_mtp_layers": 1}),  # Qwen3-Next's head
    # Fast-LLM's heads, copies of the last (KDA) layer: their states restored by the fused round kernels
    (ParallelMtpBatchDrafter, {"num_mtp_layers": 3, "mtp_type": "fast_llm"}),
])
def test_a_captured_drafting_round_equals_the_uncaptured_one_on_gpu(drafter_class, heads):
    """On CUDA, bf16: three drafting rounds replayed from their CUDA graph give the tokens, counts, drafts, caches
    and head state of the same rounds run eagerly from the same start, their products on the decoding GEMV as in the
    capture (the same kernels: bit for bit)."""
    torch.manual_seed(0)
    model = tiny_model(LAYERS, seed=0, **heads, **GPU_DIMS).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in _batch(seed=7))
    results = []
    for captured in (False, True):
        with torch.no_grad():
            cache, drafter, step = _started(model, ids, mask, 4, drafter_class=drafter_class)
            round_ = CapturedVerifyRound(model, cache, 4, drafter=drafter) if captured else None
            outputs = []
            live = torch.ones(3, dtype=torch.bool, device="cuda")
            for _ in range(3):
                if captured:
                    greedy, kept, drafts = round_(step, live)
                else:  # (the products on the kernels the capture records them with: kernels_gemv)
                    with decode_gemv_mode(torch.device("cuda")):
                        greedy, kept, drafts = speculative_decoding.drafting_round(model, cache, step, live, drafter)
                outputs += [greedy, kept, drafts]
                step = torch.cat([greedy[torch.arange(3, device="cuda"), kept - 1][:, None], drafts], dim=1)
        results.append((outputs, [t.clone() for t in cache.tensors() + drafter.tensors()]))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert torch.equal(a, b)

"""generate's stop check one step behind on CUDA (deferred_stop_check.py): on within this package's `_sample` only,
for CUDA only, not for a returned cache that cannot be cropped; and what generate returns is the same as with the
synchronous check (GPU: the deferred check needs CUDA events, which the CPU backend does not have)."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers.generation import utils as generation_utils
from transformers.generation.streamers import BaseStreamer

from hybrid_linear_models import modeling_hybrid_linear
from hybrid_linear_models.deferred_stop_check import deferred_stop_checks
from model_helpers import tiny_model

CUDA = torch.device("cuda")
needs_deferred = pytest.mark.skipif(not hasattr(generation_utils, "DeferredStopCheck"),
                                    reason="this transformers has no deferred stop check")


def _asks(device=CUDA, cache=None, cache_is_returned=False, is_assistant=False) -> bool:
    return generation_utils.DeferredStopCheck.is_supported(device, cache, cache_is_returned, is_assistant=is_assistant)


@needs_deferred
def test_the_check_is_deferred_for_cuda_only_inside_the_context():
    with deferred_stop_checks():
        pass  # installed
    assert not _asks()  # transformers' own rule outside: mps only
    assert _asks(torch.device("mps"))
    pinned = SimpleNamespace(is_croppable=False)
    with deferred_stop_checks() as deferring:
        assert deferring
        assert _asks() and _asks("cuda:0")
        assert not _asks(torch.device("cpu"))
        assert not _asks(is_assistant=True)
        assert not _asks(cache=pinned, cache_is_returned=True)  # the extra step could not be undone
        assert _asks(cache=pinned, cache_is_returned=False)  # dropped anyway
        assert _asks(cache=SimpleNamespace(is_croppable=True), cache_is_returned=True)
        seen = []
        other = threading.Thread(target=lambda: seen.append(_asks()))  # another thread: transformers' rule
        other.start()
        other.join()
        assert seen == [False]
    with deferred_stop_checks(enabled=False) as deferring:
        assert not deferring and not _asks()
    assert not _asks()


class _RecordsTheRule(LogitsProcessor):
    """Asks, at each step of a generate, whether a CUDA stop check would be deferred."""

    def __init__(self):
        self.answers = []

    def __call__(self, input_ids, scores):
        self.answers.append(_asks())
        return scores


@needs_deferred
def test_the_models_sampling_loop_defers_with_graph_decoding_on():
    model = tiny_model(["gated_deltanet", "full_attention"])
    input_ids = torch.randint(1, 128, (1, 5))
    for enabled in (True, False):
        model.set_cuda_graph_decoding(enabled)
        recorder = _RecordsTheRule()
        with torch.no_grad():
            model.generate(input_ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([recorder]))
        assert recorder.answers == [enabled] * 3
        assert not _asks()


@needs_deferred
def test_peers_generating_in_lockstep_keep_the_synchronous_check(monkeypatch):
    """synced_gpus (ZeRO-3, FSDP: every peer runs each step until all are done), by keyword as generate passes it or
    by position: not deferred (the loop is stood in by one that asks the rule)."""
    answers = []
    monkeypatch.setattr(GenerationMixin, "_sample", lambda self, *args, **kwargs: answers.append(_asks()))
    model = tiny_model(["gated_deltanet", "full_attention"])
    model._sample(None, None, None, None, synced_gpus=True)
    model._sample(None, None, None, None, True)
    model._sample(None, None, None, None, synced_gpus=False)
    assert answers == [False, False, True]


class _Tokens(BaseStreamer):
    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        pass


def _generate(model, input_ids, deferred: bool, monkeypatch, **kwargs):
    """generate with the stop check deferred (as the model does) or kept synchronous; also returns how many deferred
    checks were made and the streamed tokens (batch 1)."""
    made = []
    original = generation_utils.DeferredStopCheck.__init__

    def counted(self, *args, **kw):
        made.append(1)
        original(self, *args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(generation_utils.DeferredStopCheck, "__init__", counted)
        if not deferred:
            patch.setattr(modeling_hybrid_linear, "deferred_stop_checks",
                          lambda enabled: contextlib.nullcontext(False))
        streamer = _Tokens() if input_ids.shape[0] == 1 else None
        with torch.no_grad():
            out = model.generate(input_ids, do_sample=False, pad_token_id=0, cache_implementation="static",
                                 streamer=streamer, **kwargs)
    return out, len(made), streamer.puts if streamer else None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_deferred
@pytest.mark.parametrize("batch", [1, 2])
def test_a_deferred_check_returns_what_the_synchronous_check_returns(monkeypatch, batch):
    """An EOS stop (found a step late: the extra step's token dropped) and a max_new_tokens stop (not late): the
    same sequences and streamed tokens as the synchronous check; a returned cache (return_dict_in_generate) that GDN
    states make uncroppable keeps the check synchronous."""
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention"], gdn_value_head_dim=16,
                       gdn_key_head_dim=16, kda_head_dim=16, head_dim=16).cuda()
    input_ids = torch.randint(2, 128, (batch, 12), device="cuda")
    free, _, _ = _generate(model, input_ids, False, monkeypatch, max_new_tokens=16)
    eos = int(free[0, 12 + 5])  # row 0 stops at its sixth new token at the latest
    for kwargs in (dict(max_new_tokens=16, eos_token_id=eos), dict(max_new_tokens=16)):
        deferred, made, streamed = _generate(model, input_ids, True, monkeypatch, **kwargs)
        synchronous, made_sync, streamed_sync = _generate(model, input_ids, False, monkeypatch, **kwargs)
        assert made == 1 and made_sync == 0
        assert torch.equal(deferred, synchronous)
        assert streamed == streamed_sync
    if batch == 1:
        assert deferred.shape[1] == 12 + 16 and synchronous.shape[1] == 12 + 16
        stopped, _, _ = _generate(model, input_ids, True, monkeypatch, max_new_tokens=16, eos_token_id=eos)
        assert stopped.shape[1] <= 12 + 6  # the EOS stop was exercised
    _, made, _ = _generate(model, input_ids, True, monkeypatch, max_new_tokens=16, eos_token_id=eos,
                           return_dict_in_generate=True)
    assert made == 0


@needs_deferred
def test_a_second_copy_of_the_module_shares_the_one_wrapper():
    """A saved folder's remote code is another copy of this module beside the package: it switches the rule the first
    copy wrapped, not a wrapper of its own around it."""
    import importlib.util

    from hybrid_linear_models import deferred_stop_check

    with deferred_stop_checks():
        pass  # installed by the package's copy
    wrapped = generation_utils.DeferredStopCheck.is_supported
    spec = importlib.util.spec_from_file_location("copied_deferred_stop_check", deferred_stop_check.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    with copy.deferred_stop_checks() as deferring:
        assert deferring and _asks()
    assert generation_utils.DeferredStopCheck.is_supported is wrapped and not _asks()

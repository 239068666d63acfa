"""The captured prefill (cuda_graph_prefill.py) on the CPU, its graph stood in by an eager replay of the same captured
run (`CudaGraphPrefill._record`): the padding to a length bucket, the cache it leaves, the binding of each new cache,
the capture on a bucket's second prompt, and every fallback. Compared in float64 with the plain forward, where the
padding changes no operation on a real token: differences are exactly 0 in practice, so the bound of 1e-12 only
allows for a summation order."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from transformers import DynamicCache, StaticCache

from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer
from hybrid_linear_models import cuda_graph_prefill
from hybrid_linear_models.cuda_graph_prefill import (LARGEST_CAPTURED_TOKENS, CudaGraphPrefill, captured_buckets,
                                                     prefill_length)
from model_helpers import EagerReplay, replay_prefills_eagerly, tiny_model

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"]
LAYOUTS = {
    "gdn_kda_attention": (LAYERS, {}),
    "linear_only": (["gated_deltanet", "kimi_delta_attention"], {}),
    "latent_attention": (["mla_attention", "gated_deltanet"], dict(kv_lora_rank=16, qk_nope_head_dim=8,
                                                                   qk_rope_head_dim=4, v_head_dim=8)),
    "sparse_moe": (LAYERS, dict(mlp_types=["sparse_moe", "dense", "sparse_moe", "sparse_moe"], num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    "kimi_moe": (LAYERS, dict(mlp_types=["dense", "kimi_moe", "kimi_moe", "kimi_moe"], num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16)),
}
TOLERANCE = 1e-12


@pytest.fixture
def captured(monkeypatch) -> list[EagerReplay]:
    """The prefill graphs captured (each replayed eagerly), in capture order."""
    return replay_prefills_eagerly(monkeypatch)


def _generate(model, input_ids, cache=None, **kwargs):
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, **kwargs)
    if cache is None:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(input_ids, cache=cache, **kwargs) if cache is not None else model.generate(input_ids,
                                                                                                          **kwargs)


def _assert_same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=TOLERANCE, atol=TOLERANCE)


def test_buckets_pad_by_fewer_than_64_or_a_quarter_and_stay_within_the_cache():
    assert [prefill_length(n) for n in (2, 64, 65, 100, 128, 129, 1000, 1024, 1025, 8191, 8192)] == \
           [64, 64, 128, 128, 128, 192, 1024, 1024, 1280, 8192, 8192]
    for n in range(2, 20000, 7):
        assert n <= prefill_length(n) < n + max(64, n / 4)
    assert prefill_length(1000, slots=1010) == 1010 and prefill_length(50, slots=50) == 50


def test_the_captured_buckets_are_few_and_cover_every_captured_length():
    """What the warm-up captures: 4 buckets per doubling up to LARGEST_CAPTURED_TOKENS in all, every prompt length
    of a captured size falling in one of them, none past the cache's slots."""
    for batch, slots in ((1, None), (1, 1000), (3, 384), (16, None), (64, None), (65, None)):
        buckets = captured_buckets(batch, slots)
        assert buckets == sorted(set(buckets)) and all(batch * b <= LARGEST_CAPTURED_TOKENS for b in buckets)
        largest = min(LARGEST_CAPTURED_TOKENS // batch, slots or LARGEST_CAPTURED_TOKENS)
        for n in range(2, largest + 1):
            if batch * prefill_length(n, slots) <= LARGEST_CAPTURED_TOKENS:
                assert prefill_length(n, slots) in buckets
    assert len(captured_buckets(1, None)) == 20 and captured_buckets(1, 1000)[-1] == 1000
    assert captured_buckets(65, None) == []  # (64 tokens a row is the smallest bucket: 65 rows pass the limit)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_bucket_is_captured_on_its_second_prompt_and_serves_each_new_cache(captured, layout):
    """Three generations of one prompt length, each with a new static cache (as generate makes them): the first
    prefill runs the plain forward, the second captures its bucket, the third replays it into a cache of its own;
    every one gives the tokens and logits of generation with the graphs off, and the states the prefill leaves in
    the cache are the plain forward's."""
    layer_types, settings = LAYOUTS[layout]
    model = tiny_model(layer_types, **settings).double().eval()
    input_ids = torch.randint(1, 100, (2, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0  # a left-padded row, as generate pads a batch
    runs = [_generate(model, input_ids, attention_mask=mask) for _ in range(3)]
    assert len(captured) == 1 and captured[0].replays == 2
    model.set_cuda_graph_decoding(False)
    eager = _generate(model, input_ids, attention_mask=mask)
    for run in runs:
        _assert_same(run, eager)


def test_the_cache_a_padded_prefill_leaves_is_the_plain_forwards(captured):
    """The prompt (37 tokens) is padded to 64: the GDN/KDA states after the replayed prefill are those after the 37
    real tokens, the attention keys of the real tokens are in their slots, the counters say 37."""
    model = tiny_model(LAYERS).double().eval()
    input_ids = torch.randint(1, 100, (1, 37), generator=torch.Generator().manual_seed(2))
    caches = [StaticCache(config=model.config, max_cache_len=80) for _ in range(3)]
    with torch.no_grad():
        for cache in caches[:2]:
            graphed = model(input_ids, cache=cache, logits_to_keep=1).logits
        assert len(captured) == 1
        model.set_cuda_graph_decoding(False)
        plain = model(input_ids, cache=caches[2], logits_to_keep=1).logits
    torch.testing.assert_close(graphed, plain, rtol=TOLERANCE, atol=TOLERANCE)
    for layer, reference in zip(caches[1].layers, caches[2].layers):
        if isinstance(layer, LinearStateLayer):
            assert layer.seen_tokens == reference.seen_tokens == 37 and layer.has_previous_state[0]
            torch.testing.assert_close(layer.conv_state, reference.conv_state, rtol=TOLERANCE, atol=TOLERANCE)
            torch.testing.assert_close(layer.recurrent_state, reference.recurrent_state, rtol=TOLERANCE,
                                       atol=TOLERANCE)
        else:
            assert int(layer.cumulative_length) == int(reference.cumulative_length) == 37
            torch.testing.assert_close(layer.keys[:, :, :37], reference.keys[:, :, :37], rtol=TOLERANCE,
                                       atol=TOLERANCE)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_attention_masks_the_padding_of_left_padded_rows_and_its_own_of_unpadded_ones(captured, attention):
    """Unpadded prompts take sdpa's causal mask over the cache slots (eager attention: the same as an additive
    mask); a batch with a left-padded row, the mask of its real keys: both as generation with the graphs off."""
    model = tiny_model(LAYERS).double().eval()
    model.config._attn_implementation = attention
    ids = torch.randint(1, 100, (2, 21), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    for attention_mask in (None, mask):
        graphed = [_generate(model, ids, attention_mask=attention_mask) for _ in range(2)][-1]
        model.set_cuda_graph_decoding(False)
        eager = _generate(model, ids, attention_mask=attention_mask)
        model.set_cuda_graph_decoding(True)
        _assert_same(graphed, eager)
    assert len(captured) == 2


def test_generate_sized_cache_caps_the_bucket_and_lengths_share_a_bucket(captured):
    """generate sizes its static cache to prompt + new tokens, so a prompt of 60 (bucket 64) with 3 new tokens is
    padded to the cache's 63 slots; prompts of 40 and 57 tokens share the bucket of 64 in a larger cache."""
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (1, 60), generator=torch.Generator().manual_seed(3))
    graphed = [_generate(model, ids, max_length=63) for _ in range(2)]
    model.set_cuda_graph_decoding(False)
    eager = _generate(model, ids, max_length=63)
    model.set_cuda_graph_decoding(True)
    for run in graphed:
        _assert_same(run, eager)
    assert len(captured) == 1
    for length in (40, 57, 40):
        prompt = ids[:, :length]
        graphed = _generate(model, prompt, cache=StaticCache(config=model.config, max_cache_len=100))
        model.set_cuda_graph_decoding(False)
        eager = _generate(model, prompt, cache=StaticCache(config=model.config, max_cache_len=100))
        model.set_cuda_graph_decoding(True)
        _assert_same(graphed, eager)
    assert len(captured) == 1  # each set_cuda_graph_decoding(True) starts afresh: the 57 and second 40 share one


def test_only_the_most_recently_replayed_buckets_are_kept(captured, monkeypatch):
    """Each kept graph holds the storage of a whole cache: beyond KEPT_GRAPHS (2 here) the least recently replayed
    bucket is dropped, and a prompt of its length is captured again."""
    monkeypatch.setattr(cuda_graph_prefill, "KEPT_GRAPHS", 2)
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (1, 300), generator=torch.Generator().manual_seed(10))
    for length in (40, 40, 100, 100, 40, 200, 200, 40, 100, 100):  # buckets 64, 128, 64 (replayed), 256, 64, 128
        _generate(model, ids[:, :length], cache=StaticCache(config=model.config, max_cache_len=300))
    assert [key[1] for key in model._graph_prefill._graphs] == [64, 128]
    assert len(captured) == 4  # 64, 128, 256, then 128 again (dropped when 256 came)


def test_every_bucket_the_warm_up_captured_is_kept(captured, monkeypatch):
    """A warm-up of several batch sizes captures more buckets than KEPT_GRAPHS (2 here): all stay, and none is
    captured again when its prompts come."""
    monkeypatch.setattr(cuda_graph_prefill, "KEPT_GRAPHS", 2)
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (1, 300), generator=torch.Generator().manual_seed(10))
    lengths = (40, 100, 200)  # buckets 64, 128, 256
    _generate(model, ids[:, :10])  # (a first generate makes the derived weights that its steps read, as warm_up's do)
    model._graph_prefill.capture_first_use = True  # (as warm_up sets it)
    for length in lengths:
        _generate(model, ids[:, :length], cache=StaticCache(config=model.config, max_cache_len=300))
    model._graph_prefill.capture_first_use = False
    for length in lengths:
        _generate(model, ids[:, :length], cache=StaticCache(config=model.config, max_cache_len=300))
    assert [key[1] for key in model._graph_prefill._graphs] == [64, 128, 256] and len(captured) == 3


def test_a_new_weight_is_captured_again(captured):
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (1, 20), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        _generate(model, ids)
    with torch.no_grad():
        model.lm_head.weight = nn.Parameter(model.lm_head.weight * 1.5)
    graphed = _generate(model, ids)
    assert len(captured) == 2
    model.set_cuda_graph_decoding(False)
    _assert_same(graphed, _generate(model, ids))


FALLBACKS = {  # the model, the call, the reason given; (the continued cache's first 4 tokens are a captured prefill)
    "sliding_window": (["sliding_attention", "gated_deltanet"], {}, {}, "sliding-window layers"),
    "all_logits": (LAYERS, {}, dict(logits_to_keep=0), "logits of more than the last token"),
    "continued_cache": (LAYERS, {}, dict(continued=True), "already holds tokens"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_a_prefill_that_cannot_be_captured_runs_the_plain_forward_and_says_why_once(captured, case, caplog):
    layer_types, settings, call, reason = FALLBACKS[case]
    model = tiny_model(layer_types, **settings).double().eval()
    ids = torch.randint(1, 100, (1, 12), generator=torch.Generator().manual_seed(5))
    outputs = []
    with torch.no_grad(), caplog.at_level("WARNING"):
        for graphs_on in (True, True, False):
            if not graphs_on:
                model.set_cuda_graph_decoding(False)
            cache = StaticCache(config=model.config, max_cache_len=40)
            if call.get("continued"):
                model(ids[:, :4], cache=cache, logits_to_keep=1)
                outputs.append(model(ids[:, 4:], cache=cache, logits_to_keep=1).logits)
            else:
                outputs.append(model(ids, cache=cache, logits_to_keep=call.get("logits_to_keep", 1)).logits)
    assert len(captured) == (1 if call.get("continued") else 0)
    for output in outputs[:2]:
        torch.testing.assert_close(output, outputs[2], rtol=TOLERANCE, atol=TOLERANCE)
    warnings = [r.getMessage() for r in caplog.records if "CUDA-graph prefill" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0]


def test_a_failed_capture_leaves_an_empty_cache_for_the_plain_forward(monkeypatch, caplog):
    monkeypatch.setattr(CudaGraphPrefill, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(CudaGraphPrefill, "on_by_default", True)
    attempts = []

    def failing_record(run, device, pool):
        attempts.append(1)
        run()  # a warm-up wrote the cache before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(CudaGraphPrefill, "_record", staticmethod(failing_record))
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(6))
    with caplog.at_level("WARNING"):
        runs = [_generate(model, ids) for _ in range(3)]
    model.set_cuda_graph_decoding(False)
    eager = _generate(model, ids)
    for run in runs:
        _assert_same(run, eager)
    assert len(attempts) == 1  # not tried again for that bucket
    warnings = [r.getMessage() for r in caplog.records if "CUDA-graph prefill" in r.getMessage()]
    # the reason names the error, the package line it came through (here the capture's call of the failing record)
    # and its first line only
    assert len(warnings) == 1
    assert re.search(r"capturing the prefill failed \(RuntimeError at cuda_graph_prefill\.py:\d+: operation not "
                     r"permitted when stream is capturing\)", warnings[0]), warnings[0]


def test_a_prompt_longer_than_the_static_cache_is_refused_with_both_sizes(captured):
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (1, 12), generator=torch.Generator().manual_seed(11))
    with torch.no_grad(), pytest.raises(ValueError, match="holds 10 tokens per row, 0 of them written, and this forward adds 12"):
        model(ids, cache=StaticCache(config=model.config, max_cache_len=10), logits_to_keep=1)


def test_no_capture_with_gradients_or_a_dynamic_cache(captured):
    model = tiny_model(LAYERS).double().eval()
    ids = torch.randint(1, 100, (1, 10), generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        model(ids, cache=StaticCache(config=model.config, max_cache_len=20), logits_to_keep=1)  # gradients on
        with torch.no_grad():
            model(ids, cache=DynamicCache(config=model.config), logits_to_keep=1)
    assert not captured


@pytest.mark.parametrize("mixer", ["gated_deltanet", "kimi_delta_attention"])
def test_a_prompt_padded_on_the_right_leaves_the_states_of_its_real_tokens(mixer):
    """The plain forward, too: a row padded on the right (mask zeros after its tokens) leaves the convolution and
    recurrent states its real tokens leave alone; the convolution's from its last real inputs, not from the pads'."""
    model = tiny_model([mixer]).double().eval()
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[1, 2:] = 0  # fewer real tokens than the convolution keeps (3)
    padded = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=padded)
        for row, length in ((0, 7), (1, 2)):
            alone = DynamicCache(config=model.config)
            model(ids[row : row + 1, :length], cache=alone)
            for name in ("conv_state", "recurrent_state"):
                got = getattr(padded.layers[0], name)[row : row + 1]
                torch.testing.assert_close(got, getattr(alone.layers[0], name), rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("layout", ["gdn_kda_attention", "latent_attention"])
def test_an_unpadded_prompt_into_an_empty_static_cache_takes_sdpas_causal_mask(layout, monkeypatch):
    """The plain forward (graphs off) of a prompt into an empty static cache builds no [T, slots] mask for sdpa: its
    own causal mask (aligned at the first slot) is that mask. The logits and the cache it leaves are those with the
    mask built as transformers builds it, and the next tokens decode alike; a padded batch still builds the mask."""
    from hybrid_linear_models import modeling_hybrid_linear

    layer_types, settings = LAYOUTS[layout]
    model = tiny_model(layer_types, **settings).double().eval()
    model.set_cuda_graph_decoding(False)
    ids = torch.randint(1, 100, (2, 23), generator=torch.Generator().manual_seed(12))
    built = []
    original = modeling_hybrid_linear.create_causal_mask
    monkeypatch.setattr(modeling_hybrid_linear, "create_causal_mask", lambda **k: built.append(1) or original(**k))

    def run():
        cache = StaticCache(config=model.config, max_cache_len=40)
        with torch.no_grad():
            prompt = model(ids, cache=cache).logits
            masks_built = len(built)
            step = model(ids[:, -1:], cache=cache).logits
        return prompt, step, masks_built

    *causal, masks_built = run()
    assert masks_built == 0  # (the one-token step after it builds its one-row mask)
    monkeypatch.setattr(modeling_hybrid_linear.HybridLinearModel, "_causal_kernel_suffices", lambda *a: False)
    built.clear()
    *masked, masks_built = run()
    assert masks_built == 1
    for a, b in zip(causal, masked):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    monkeypatch.undo()
    monkeypatch.setattr(modeling_hybrid_linear, "create_causal_mask", lambda **k: built.append(2) or original(**k))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=StaticCache(config=model.config, max_cache_len=40))
    assert built[-1] == 2


def test_prompt_graphs_are_off_unless_asked(monkeypatch):
    """Prompts run the plain forward by default (cuda_graph_prefill's docstring says why); one switch turns their
    graphs on, and graph decoding off turns both off."""
    monkeypatch.setattr(CudaGraphPrefill, "device_types", ("cuda", "cpu"))
    model = tiny_model(LAYERS).double().eval()
    assert model._graph_decoder is not None and model._graph_prefill is None
    model.set_cuda_graph_decoding(True, prompts=True)
    assert model._graph_prefill is not None
    model.set_cuda_graph_decoding(False, prompts=True)
    assert model._graph_decoder is None and model._graph_prefill is None

"""The CUDA-graph decoding path on the CPU, with the graph stood in by an eager replay of the same captured step
(`CudaGraphDecoder._record`): what it adds around the graph is checked here, not only on GPUs — the lean inputs
`prepare_inputs_for_generation` hands it, positions and key masks of left-padded rows, re-capturing after weight
updates."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import GenerationMixin, StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer

from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder, cache_tensors
from model_helpers import replay_graphs_eagerly, tiny_model

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"]


@pytest.fixture
def eager_graphs(monkeypatch) -> list:
    """The steps captured (each replayed eagerly), in capture order."""
    return replay_graphs_eagerly(monkeypatch)


def _generate(model, input_ids, attention_mask, cache=None):
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, attention_mask=attention_mask)
    if cache is None:
        kwargs["cache_implementation"] = "static"
    else:
        cache.reset()
        kwargs["cache"] = cache
    with torch.no_grad():
        return model.generate(input_ids, **kwargs)


def _assert_same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_graph_path_decodes_left_padded_rows_like_eager(eager_graphs, monkeypatch):
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0
    attention_mask[2, :2] = 0
    generic = []
    original = GenerationMixin.prepare_inputs_for_generation  # the generic preparation: only for the prefill
    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation",
                        lambda self, *a, **k: generic.append(1) or original(self, *a, **k))
    graphed = _generate(model, input_ids, attention_mask)
    assert len(eager_graphs) == 1 and len(generic) == 1
    model.set_cuda_graph_decoding(False)
    _assert_same(graphed, _generate(model, input_ids, attention_mask))


def test_generation_from_prompt_embeddings_replays_its_steps(eager_graphs):
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 9))
    embeds = model.get_input_embeddings()(input_ids).detach()
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                  cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        graphed = model.generate(**kwargs)
        assert len(eager_graphs) == 1
        model.set_cuda_graph_decoding(False)
        _assert_same(graphed, model.generate(**kwargs))


def test_graph_follows_weight_updates(eager_graphs):
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 10))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    cache = StaticCache(config=model.config, max_cache_len=40)
    _generate(model, input_ids, attention_mask, cache)
    _generate(model, input_ids, attention_mask, cache)
    assert len(eager_graphs) == 1  # same cache, same weights: captured once

    def update_weights():
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "layernorm" in name or "conv1d" in name:  # read through kept 1 + w and concatenated kernels
                    parameter.add_(0.3 * torch.randn_like(parameter))

    update_weights()  # the next prefill refreshes the kept tensors in place, under the graph's feet
    graphed = _generate(model, input_ids, attention_mask, cache)
    model.set_cuda_graph_decoding(False)
    _assert_same(graphed, _generate(model, input_ids, attention_mask, cache))

    model.set_cuda_graph_decoding(True)  # an update between two decoding steps: captured again
    _generate(model, input_ids, attention_mask, cache)
    eager_cache = copy.deepcopy(cache)
    update_weights()
    past = int(cache.get_seq_length())
    mask = torch.cat([attention_mask, torch.ones(2, past + 1 - attention_mask.shape[1], dtype=torch.long)], dim=1)
    step = dict(input_ids=torch.tensor([[7], [9]]), attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1)
    with torch.no_grad():
        graphed = model(**step, cache=cache).logits
        model.set_cuda_graph_decoding(False)
        eager = model(**step, cache=eager_cache).logits
    assert len(eager_graphs) == 3
    torch.testing.assert_close(graphed, eager[:, -1:], rtol=1e-5, atol=1e-5)


def test_shorter_mask_after_a_longer_generation_clears_stale_slots(eager_graphs):
    model = tiny_model(LAYERS).eval()
    cache = StaticCache(config=model.config, max_cache_len=40)
    long_ids, short_ids = torch.randint(1, 100, (2, 20)), torch.randint(1, 100, (2, 6))
    short_mask = torch.ones_like(short_ids)
    short_mask[1, :2] = 0
    _generate(model, long_ids, torch.ones_like(long_ids), cache)
    graphed = _generate(model, short_ids, short_mask, cache)
    model.set_cuda_graph_decoding(False)
    _assert_same(graphed, _generate(model, short_ids, short_mask, cache))


# ------------------------------------------------------------------------------------------ sliding-window layers

SLIDING = {"windows": (["sliding_attention", "gated_deltanet", "sliding_attention", "full_attention"],
                       {0: {"sliding_window": 2}, 2: {"sliding_window": 5}}),
           "sliding_only": (["sliding_attention", "kimi_delta_attention", "sliding_attention"],
                            {0: {"sliding_window": 3}, 2: {"sliding_window": 4}})}


class FrozenReplay:
    """A stricter stand-in for the recording: each replay runs the recorded step with the Python-side values a CUDA
    graph would have frozen (the sliding layers' counters, which transformers' update branches on) put back to their
    values at recording, transformers' sliding-window update forbidden, and every cache buffer checked to keep its
    address. A step that read a host value, or wrote a reallocated buffer, would go wrong once positions move on."""

    expired = False

    def __init__(self, run, out, cache):
        self.run, self.out, self.cache = run, out, cache
        self.layers = [layer for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer)]
        self.frozen = [layer.cumulative_length_int for layer in self.layers]
        self.addresses = _addresses(cache)
        self.replays = 0

    def replay(self):
        live = [layer.cumulative_length_int for layer in self.layers]
        for layer, value in zip(self.layers, self.frozen):
            layer.cumulative_length_int = value
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(StaticSlidingWindowLayer, "update", _forbidden)
            self.out.copy_(self.run())
        for layer, value in zip(self.layers, live):
            layer.cumulative_length_int = value
        assert _addresses(self.cache) == self.addresses
        self.replays += 1


def _forbidden(*args, **kwargs):
    raise AssertionError("a captured step must not run StaticSlidingWindowLayer.update (it branches on host values)")


def _addresses(cache: StaticCache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_length", [1, 8])  # shorter than every window, longer than every window
@pytest.mark.parametrize("layout", sorted(SLIDING))
def test_sliding_layers_decode_through_the_captured_step_like_uncached(monkeypatch, layout, prompt_length,
                                                                      attention):
    """Several windows per model (one beside a full layer, or sliding layers only), left pads, 14 steps (each
    window's buffer rolls over several times), the step replayed with host values frozen: greedy tokens equal and
    logits equal to the uncached full forwards. In float64, as test_per_layer_settings.heterogeneous_model: the
    paths sum in different orders, which float32 rounding alone turns into 2e-5 on these random weights, and float64
    into ~1e-12, so 1e-9 leaves no room for a real difference (a wrong window, slot or pad moves logits by O(1)). The
    window buffers are left exactly as transformers' own update leaves them (eager static decoding), so eager steps
    can follow."""
    layer_types, per_layer = SLIDING[layout]
    model = tiny_model(layer_types, per_layer_config=per_layer).double()
    model.config._attn_implementation = attention
    input_ids = torch.randint(1, 100, (2, prompt_length), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, : prompt_length // 2] = 0
    cache = StaticCache(config=model.config, max_cache_len=prompt_length + 14)
    recorded = []
    monkeypatch.setattr(CudaGraphDecoder, "device_types", ("cuda", "cpu"))

    def record(run, device, reset, pool=None):
        out = run()  # a warm-up step, undone by the caller as on the GPU
        recorded.append(FrozenReplay(run, out, cache))
        return recorded[-1], out

    monkeypatch.setattr(CudaGraphDecoder, "_record", staticmethod(record))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=14, min_new_tokens=14, do_sample=False,
                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        graphed = model.generate(input_ids, cache=cache, **kwargs)
        without = model.generate(input_ids, use_cache=False, **kwargs)
        model.set_cuda_graph_decoding(False)
        eager_cache = StaticCache(config=model.config, max_cache_len=prompt_length + 14)
        model.generate(input_ids, cache=eager_cache, **kwargs)
    assert len(recorded) == 1 and recorded[0].replays == 13
    assert torch.equal(graphed.sequences, without.sequences)
    for a, b in zip(graphed.logits, without.logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    for layer, eager in zip(cache.layers, eager_cache.layers):
        if isinstance(layer, StaticSlidingWindowLayer):
            assert layer.cumulative_length_int == eager.cumulative_length_int == prompt_length + 13
            torch.testing.assert_close(layer.keys, eager.keys, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(layer.values, eager.values, rtol=1e-9, atol=1e-9)
            assert torch.equal(layer.cumulative_length, eager.cumulative_length)


# ------------------------------------------------------------------------------- fallback to the uncaptured step


def _greedy_static(model, input_ids, **kwargs):
    return model.generate(input_ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                          cache_implementation="static", output_logits=True, return_dict_in_generate=True, **kwargs)


def test_a_failed_capture_falls_back_to_the_uncaptured_step_with_one_warning(monkeypatch, caplog):
    """A capture that raises (an op a CUDA graph cannot hold) leaves the cache as it was, runs the uncaptured
    forward, says why in one warning line (once), and is not tried again for that batch size and cache length
    (another cache of them, as the next generate builds, included)."""
    monkeypatch.setattr(CudaGraphDecoder, "device_types", ("cuda", "cpu"))
    attempts = []

    def failing_record(run, device, reset, pool=None):
        attempts.append(1)
        run()  # a warm-up step advanced the cache before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(CudaGraphDecoder, "_record", staticmethod(failing_record))
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 6))
    with torch.no_grad(), caplog.at_level("WARNING"):
        fallen_back = _greedy_static(model, input_ids)
        again = _greedy_static(model, input_ids)
        model.set_cuda_graph_decoding(False)
        eager = _greedy_static(model, input_ids)
    warnings = [r.getMessage() for r in caplog.records if "CUDA-graph decoding" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    # the error, the package line it came through (the capture's call of the failing record) and its first line
    assert re.search(r"\(RuntimeError at cuda_graph_decoding\.py:\d+: operation not permitted when stream is "
                     r"capturing\)", warnings[0]), warnings[0]
    assert len(attempts) == 1  # not once per step, nor per cache (each generate builds its own)
    for got in (fallen_back, again):
        assert torch.equal(got.sequences, eager.sequences)
        for a, b in zip(got.logits, eager.logits):  # the same eager steps: the same floats
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_step_that_cannot_be_captured_says_why_once(monkeypatch, caplog):
    """One-token steps on a static cache that ask for what a captured step cannot give (here attention weights) run
    uncaptured, with one warning naming the reason for the model, however many steps."""
    graphs = replay_graphs_eagerly(monkeypatch)
    model = tiny_model(LAYERS).eval()
    model.config._attn_implementation = "eager"
    input_ids = torch.randint(1, 100, (1, 6))
    with torch.no_grad(), caplog.at_level("WARNING"):
        got = _greedy_static(model, input_ids, output_attentions=True)
    warnings = [r.getMessage() for r in caplog.records if "CUDA-graph decoding" in r.getMessage()]
    assert graphs == [] and len(warnings) == 1 and "attention weights" in warnings[0]
    assert len(got.attentions) == 5 and got.attentions[-1][0].shape[-2] == 1  # each eager step returned its row


def test_a_weight_given_new_storage_between_generations_is_captured_again(eager_graphs):
    """A captured step reads every weight by address. Between two generations (the prefill ran uncaptured) a weight
    given new storage (`.data = `, as `module.to` does) or replaced (`load_state_dict(assign=True)`) makes the next
    run capture again, with the tokens of uncaptured decoding; an in-place update (read by the graph as it is) does
    not."""
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 7))
    down = lambda: model.model.layers[0].mlp.down_proj  # noqa: E731  (a plain weight: neither stacked nor derived)
    _generate(model, input_ids, None)
    assert len(eager_graphs) == 1
    with torch.no_grad():
        down().weight.mul_(1.5)
    _assert_same(_generate(model, input_ids, None), _uncaptured(model, input_ids))
    assert len(eager_graphs) == 1
    down().weight.data = down().weight.detach() * 0.5
    _assert_same(_generate(model, input_ids, None), _uncaptured(model, input_ids))
    assert len(eager_graphs) == 2
    state = {name: value.clone() * 1.25 if name.endswith("down_proj.weight") else value.clone()
             for name, value in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    _assert_same(_generate(model, input_ids, None), _uncaptured(model, input_ids))
    assert len(eager_graphs) == 3


def _uncaptured(model, input_ids):
    decoder, model._graph_decoder = model._graph_decoder, None  # (the same decoder back after: its captures counted)
    try:
        return _generate(model, input_ids, None)
    finally:
        model._graph_decoder = decoder


def test_a_copy_of_a_model_that_captured_a_step_starts_uncaptured_and_decodes_alike(eager_graphs):
    """copy.deepcopy of a model after graph decoding (a CUDA graph cannot be copied, and it reads the original's
    buffers): the copy holds no captured step, captures its own, and decodes the same tokens."""
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 9))
    graphed = _generate(model, input_ids, None)
    assert model._graph_decoder.captured_keys
    twin = copy.deepcopy(model)
    assert twin._graph_decoder is not model._graph_decoder and not twin._graph_decoder.captured_keys
    _assert_same(_generate(twin, input_ids, None), graphed)
    assert len(eager_graphs) == 2 and next(iter(twin._graph_decoder._graphs.values())).graph is eager_graphs[1]


def test_a_step_past_the_end_of_the_static_cache_is_refused_by_name(eager_graphs):
    """A static cache with no slot left for the step's token: refused with the sizes and the fix (on a GPU the
    captured write past the buffer would be a device-side assertion that leaves the CUDA context unusable)."""
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (1, 6))
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)
        for _ in range(2):  # slots 7 and 8
            model(input_ids=input_ids[:, -1:], cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"holds 8 tokens per row, 8 of them written, and this forward adds 1.*max_cache_len"):
            model(input_ids=input_ids[:, -1:], cache=cache, use_cache=True)


@pytest.fixture
def storage_checked(eager_graphs, monkeypatch) -> list:
    """Every replayed step is checked for what a real CUDA graph relies on: the tensors of the cache it served are
    the storage the graph was captured with (the decoder's buffers). Returns one entry per step checked."""
    checked: list = []
    original = CudaGraphDecoder.step

    def step(self, model, input_ids, position_ids, attention_mask, cache, key):
        logits = original(self, model, input_ids, position_ids, attention_mask, cache, key)
        if logits is not None:
            buffers = self._graphs[key].storage.buffers
            assert [t.data_ptr() for t in cache_tensors(cache)] == [b.data_ptr() for b in buffers]
            checked.append(1)
        return logits

    monkeypatch.setattr(CudaGraphDecoder, "step", step)
    return checked


BINDING_LAYOUTS = {  # every kind of cache layer: GDN, KDA, full and sliding attention, MLA
    "linear": (LAYERS, {}),
    "sliding_and_latent": (["sliding_attention", "mla_attention", "gated_deltanet", "sliding_attention"],
                           dict(per_layer_config={0: {"sliding_window": 3}, 3: {"sliding_window": 5}}, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
}


@pytest.mark.parametrize("layout", sorted(BINDING_LAYOUTS))
@pytest.mark.parametrize("mode", [dict(), dict(num_beams=3)], ids=["greedy", "beam_search"])
def test_one_capture_serves_each_new_cache_and_beam_search_reorders_into_its_storage(storage_checked, eager_graphs,
                                                                                     mode, layout):
    """generate(..., cache_implementation="static") builds a new cache per call and beam search replaces the cache
    tensors with reordered copies every step: the captured step keeps serving them (one capture), each replay
    reading and writing the storage it was captured with, the tokens and scores those of uncaptured decoding, and
    the cache of an earlier call, returned to the user, keeps its values."""
    layer_types, settings = BINDING_LAYOUTS[layout]
    model = tiny_model(layer_types, **settings).eval()
    input_ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(5))
    generation = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, cache_implementation="static", **mode)
    with torch.no_grad():
        first = model.generate(input_ids, **generation)
        kept = [t.clone() for t in cache_tensors(first.past_key_values)]
        second = model.generate(input_ids.flip(0), **generation)
        model.set_cuda_graph_decoding(False)
        eager_first = model.generate(input_ids, **generation)
        eager_second = model.generate(input_ids.flip(0), **generation)
    assert len(eager_graphs) == 1 and len(storage_checked) == 2 * 5  # the first new token comes from the prefill
    _assert_same(first, eager_first)
    _assert_same(second, eager_second)
    for value, tensor in zip(kept, cache_tensors(first.past_key_values)):
        assert torch.equal(value, tensor)


@pytest.mark.parametrize("new_tokens", [2, 3])
def test_capture_with_few_slots_left_writes_inside_the_cache(eager_graphs, new_tokens):
    """generate sizes a static cache to the prompt plus the new tokens, so the first decoding step's token may have
    one of the last slots. The capture's warm-up step and the step replayed after it both start from the cache as the
    step found it (on a GPU a step one slot further would write past the buffer: a device-side assertion or a
    corrupted neighbour)."""
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    generation = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True, cache_implementation="static")
    with torch.no_grad():
        graphed = model.generate(input_ids, **generation)
        assert len(eager_graphs) == 1 and model._graph_decoder.captured_keys  # captured, no failed attempt
        model.set_cuda_graph_decoding(False)
        eager = model.generate(input_ids, **generation)
    _assert_same(graphed, eager)


def _plain_generate(model, input_ids, **options):
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
                "output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        return model.generate(input_ids, **{**settings, **options})


def test_generate_takes_the_captured_static_cache_unless_told_otherwise(eager_graphs):
    """Where graph decoding captures and nothing names a cache, greedy generate takes a static cache and replays the
    captured step, with the tokens and scores of transformers' default dynamic cache."""
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    chosen = _plain_generate(model, input_ids)
    assert isinstance(chosen.past_key_values, StaticCache) and len(eager_graphs) == 1
    dynamic = _plain_generate(model, input_ids, cache_implementation="dynamic")
    assert not isinstance(dynamic.past_key_values, StaticCache) and len(eager_graphs) == 1
    _assert_same(chosen, dynamic)


@pytest.mark.parametrize("options, static", [
    ({"do_sample": True}, True),
    ({"prompt_lookup_num_tokens": 3}, True),
    ({"num_beams": 2}, False),  # (beam search reorders the cache every step: transformers' default kept)
    ({"cache_implementation": "dynamic"}, False),
    ({"use_cache": False}, False),
    ({"output_hidden_states": True}, False),  # (the captured step returns logits only)
], ids=["sample", "assisted", "beams", "dynamic", "no cache", "hidden states"])
def test_the_static_cache_is_chosen_for_the_modes_the_captured_step_serves(eager_graphs, options, static):
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    out = _plain_generate(model, input_ids, **options)
    assert out.sequences.shape == (1, 15)
    assert isinstance(out.past_key_values, StaticCache) == static


def test_graphs_off_or_a_refused_static_cache_keep_the_dynamic_cache(eager_graphs, monkeypatch):
    """No static cache is chosen where nothing is captured, and where the static cache would not fit (memory, or the
    model's positions) generate runs on the dynamic cache instead of refusing what the user did not ask for."""
    from hybrid_linear_models import cache_checks

    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(6))
    model.set_cuda_graph_decoding(False)
    assert not isinstance(_plain_generate(model, input_ids).past_key_values, StaticCache)
    model.set_cuda_graph_decoding(True)
    monkeypatch.setattr(cache_checks, "available_memory", lambda device: 0)
    out = _plain_generate(model, input_ids)
    assert not isinstance(out.past_key_values, StaticCache) and not eager_graphs
    with pytest.raises(ValueError, match="more than the 0.00 MiB available"):  # (asked for: refused, as before)
        _plain_generate(model, input_ids, cache_implementation="static")


@pytest.mark.parametrize("device_map", [{"model": 0, "lm_head": 1}, {"model": 0, "lm_head": "cpu"}],
                         ids=["two devices", "offloaded"])
def test_a_model_dispatched_over_devices_captures_nothing(eager_graphs, device_map):
    """A device map over several devices (or offloading to the host): a graph records one device's stream, so
    nothing is captured and generate keeps the dynamic cache."""
    model = tiny_model(LAYERS).eval()
    model.hf_device_map = device_map
    assert not model.captures_graphs_on(torch.device("cpu"))
    out = _plain_generate(model, torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(1)))
    assert not isinstance(out.past_key_values, StaticCache) and not eager_graphs
    model.hf_device_map = {"": 0}
    assert model.captures_graphs_on(torch.device("cpu"))  # (one device: the stand-in's graphs apply)


def test_a_process_group_of_several_ranks_keeps_the_dynamic_cache(eager_graphs, monkeypatch):
    """Under tensor or expert parallelism, FSDP or ZeRO-3 every rank's step holds collectives: generate keeps
    transformers' default there, and a static cache is taken only where asked for."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *group: 2)
    model = tiny_model(LAYERS).eval()
    input_ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    assert not isinstance(_plain_generate(model, input_ids).past_key_values, StaticCache)
    assert isinstance(_plain_generate(model, input_ids, cache_implementation="static").past_key_values, StaticCache)


def test_a_returned_static_cache_too_short_for_a_follow_up_names_the_dynamic_cache(eager_graphs):
    """The static cache generate chose and returned, passed back for a longer follow-up: refused before any write,
    with the fix (a larger cache, a new one, or cache_implementation="dynamic")."""
    model = tiny_model(LAYERS, max_position_embeddings=4096).eval()
    input_ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(8))
    first = _plain_generate(model, input_ids)
    slots = first.past_key_values.layers[LAYERS.index("full_attention")].max_cache_len
    follow_up = torch.cat([first.sequences, torch.randint(1, 100, (1, slots))], dim=1)
    with pytest.raises(ValueError, match=rf"holds {slots} tokens per row, 14 of them written.*does not grow.*"
                                         r"cache_implementation=\"dynamic\""):
        _plain_generate(model, follow_up, cache=first.past_key_values)


def test_a_replay_counts_its_token_without_a_kernel_per_linear_layer():
    """After each replay the step's linear layers count its token on the host (`seen_tokens` set): no tensor op, so
    no kernel a layer between replays; only where a compiled step kept a count on the device is that count zeroed
    (it was added into seen_tokens, which the set replaces)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybrid_linear_models.cache_hybrid_linear import LinearStateLayer

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model = tiny_model(["linear_attention", "full_attention"])
    with torch.no_grad():
        cache = model(torch.randint(1, 100, (1, 5)), use_cache=True).past_key_values
    layer = next(layer for layer in cache.layers if isinstance(layer, LinearStateLayer))
    with Ops() as ops:
        layer.seen_tokens = layer.seen_tokens + 1
    assert ops.names == [] and layer.seen_tokens == 6
    layer._device_count.add_(3)  # what compiled steps count (cache_hybrid_linear.store under torch.compile)
    layer._counted_on_device = True
    assert layer.seen_tokens == 9
    with Ops() as ops:
        layer.seen_tokens = 10
    assert ops.names == ["zero_"] and layer.seen_tokens == 10 and int(layer._device_count) == 0

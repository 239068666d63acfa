"""What is captured per request, and `warm_up`, on the CPU, each CUDA graph stood in by an eager replay of the same
captured run (model_helpers): static caches come in few sizes (static_cache_slots), the captured decoding steps are
kept per batch size and cache size, a prompt's graph and the step's share their cache's storage, and after
`warm_up` no request of the sizes it covers captures anything. Outputs are compared in float64 with graph decoding off
(the same operations on every real token: differences are 0 in practice, 1e-12 allows for a summation order)."""

from __future__ import annotations

import pytest
import torch

from hybrid_linear_models import cache_checks, token_chunks, warm_up
from hybrid_linear_models.graph_cache_storage import cache_tensors
from hybrid_linear_models.static_cache_slots import static_cache_slots
from model_helpers import replay_graphs_eagerly, replay_prefills_eagerly, tiny_model

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "gated_deltanet"]
TOLERANCE = 1e-12


@pytest.fixture
def graphs(monkeypatch) -> tuple[list, list]:
    """(decoding steps captured, prompt buckets captured), each replayed eagerly."""
    return replay_graphs_eagerly(monkeypatch), replay_prefills_eagerly(monkeypatch)


def _ids(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, the rows after the first left-padded by a few tokens."""
    ids = torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : min(row, length - 1)] = 0
    return ids, mask


def _generate(model, ids, mask, new_tokens=3, **kwargs):
    kwargs.setdefault("cache_implementation", "static")
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              **kwargs)


def _assert_same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=TOLERANCE, atol=TOLERANCE)


def test_static_cache_sizes_are_few_and_hold_what_is_asked():
    sizes = {static_cache_slots(n) for n in range(1, 1 << 20, 97)}
    assert len(sizes) <= 2 * 12 + 1  # 2 per doubling from 256 to 1M
    for n in list(range(1, 5000)) + [65535, 65536, 65537, 10**6]:
        slots = static_cache_slots(n)
        assert n <= slots and (slots == 256 or slots < 1.5 * n)
    assert static_cache_slots(300, positions=320) == 320  # never past the positions where the tokens fit them
    assert static_cache_slots(300, positions=280) == 384  # (the request itself passes them: refused elsewhere)


def test_requests_of_new_lengths_reuse_one_rounded_cache_and_one_captured_step(graphs):
    steps, _ = graphs
    model = tiny_model(LAYERS).double().eval()
    for length in (5, 17, 40, 90):
        result = _generate(model, *_ids(1, length, length))
        assert result.past_key_values.layers[1].max_cache_len == 256
    assert len(steps) == 1


def test_steps_of_each_batch_size_are_kept_and_replayed(graphs):
    """Requests alternating between batch sizes keep one captured step each (no capture at each switch)."""
    steps, _ = graphs
    model = tiny_model(LAYERS).double().eval()
    for batch in (1, 2, 1, 2, 3, 1):
        _generate(model, *_ids(batch, 12, batch))
    assert len(steps) == 3 and len(model._graph_decoder.captured_keys) == 3


def test_a_replayed_prompt_leaves_the_cache_in_the_storage_the_step_reads(graphs):
    """The prompt's graph and the decoding step's share the storage of their cache shape: the step finds the cache
    bound already (no copy), and both graphs hold one storage object."""
    _, prompts = graphs
    model = tiny_model(LAYERS).double().eval()
    for _ in range(2):  # the second prompt of its bucket is captured
        result = _generate(model, *_ids(1, 30, 0))
    assert len(prompts) == 1
    (step,) = model._graph_decoder._graphs.values()
    (prompt,) = model._graph_prefill._graphs.values()
    assert step.storage is prompt.storage
    assert [t.data_ptr() for t in cache_tensors(result.past_key_values)] == [
        b.data_ptr() for b in step.storage.buffers]


def test_after_warm_up_no_request_it_covers_captures_and_outputs_match(graphs, capsys):
    steps, prompts = graphs
    model = tiny_model(LAYERS).double().eval()
    report = model.warm_up(max_batch_size=2, max_length=300)
    printed = capsys.readouterr().out
    assert "warm_up: batch sizes [1, 2]" in printed and f"{report.seconds:.1f} s" in printed
    assert report.static_cache_slots == 384 and report.captured_steps == 2
    assert report.captured_prompts == len(prompts) > 0
    captured = (len(steps), len(prompts))
    requests = [(batch, length) for batch in (1, 2) for length in (2, 7, 64, 65, 130, 250, 297)]
    graphed = [_generate(model, *_ids(batch, length, length)) for batch, length in requests[:7]]
    _generate(model, *_ids(2, 50, 1), cache_implementation="dynamic")  # (the dynamic cache between: moves nothing)
    graphed += [_generate(model, *_ids(batch, length, length)) for batch, length in requests[7:]]
    assert (len(steps), len(prompts)) == captured  # nothing captured after the warm-up
    model.set_cuda_graph_decoding(False)
    for (batch, length), result in zip(requests, graphed):
        _assert_same(result, _generate(model, *_ids(batch, length, length)))


def test_warm_up_refuses_what_does_not_fit_in_one_line(monkeypatch):
    model = tiny_model(LAYERS).double().eval()
    positions = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_length={positions + 1} passes the model's {positions} positions"):
        model.warm_up(max_length=positions + 1)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        model.warm_up(max_batch_size=0)
    monkeypatch.setattr(cache_checks, "available_memory", lambda device: 1000)
    replay_graphs_eagerly(monkeypatch)
    with pytest.raises(ValueError, match=r"warm_up\(max_batch_size=1, max_length=300\).*at most \d+ slots per row "
                                         r"fit") as error:
        model.warm_up(max_length=300)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("batch_sizes", [3, [], [1, 0], [2, "4"], "1", [[1]], [True]])
def test_warm_up_refuses_batch_sizes_that_are_not_a_list_of_positive_integers(batch_sizes):
    model = tiny_model(LAYERS).eval()
    with pytest.raises(ValueError, match=r"^warm_up: batch_sizes must be a non-empty list of positive integers") as e:
        model.warm_up(batch_sizes=batch_sizes, max_length=100)
    assert "\n" not in str(e.value)


def test_warm_up_refuses_a_batch_whose_caches_do_not_fit_before_any_work(monkeypatch):
    """Graphs off (the CPU): the default cache's prompts of the largest batch are checked against the memory
    available before any generate (a batch of 10**5 rows is one line, not an allocator's error after minutes)."""
    model = tiny_model(LAYERS).eval()
    calls = []
    monkeypatch.setattr(warm_up, "_generate", lambda *args: calls.append(args))
    monkeypatch.setattr(cache_checks, "available_memory", lambda device: 2**30)  # (1 GiB: a tiny model's 10**5 rows)
    with pytest.raises(ValueError, match=r"warm_up\(max_batch_size=100000, max_length=300\), its prompts' caches .* "
                                         r"more than the .* available") as error:
        model.warm_up(max_batch_size=10**5, max_length=300)
    assert "\n" not in str(error.value) and not calls


def test_warm_up_on_the_cpu_runs_one_short_prompt_per_batch_size(monkeypatch, capsys):
    """Nothing compiles, tunes or captures on a CPU: one short default-cache generate per batch size, whatever
    max_length (the GPU's lengths and padded rows serve its kernels' keys)."""
    model = tiny_model(LAYERS).eval()
    calls = []
    monkeypatch.setattr(warm_up, "_generate", lambda *args: calls.append(args[1:4]))
    report = model.warm_up(max_batch_size=16, max_length=16384)
    assert calls == [(1, 64, False), (16, 64, False)] and report.generate_calls == 2
    assert "static caches not warmed" in capsys.readouterr().out


def test_a_model_whose_prompts_cannot_be_captured_warms_no_prompt_bucket(graphs, monkeypatch):
    """Sliding-window layers keep prompts uncaptured (cuda_graph_prefill's obstacle): the warm-up captures each batch
    size's decoding step and runs no generate per prompt bucket."""
    model = tiny_model(["gated_deltanet", "sliding_attention"], sliding_window=4).double().eval()
    calls = []
    generate = warm_up._generate
    monkeypatch.setattr(warm_up, "_generate", lambda *args: calls.append(args[1:]) or generate(*args))
    report = model.warm_up(max_batch_size=2, max_length=300)
    assert report.captured_prompts == 0 and report.captured_steps == 2
    static = [call for call in calls if call[-1] == "static"]
    assert len(static) == 1 + 3  # the first static generate, then one per batch size and padding (1; 2; 2 padded)


def test_a_one_token_prompt_into_a_static_cache_says_nothing(graphs, caplog):
    """A one-token prompt's forward is the prefill: it runs uncaptured without the warning of an unfilled cache."""
    model = tiny_model(LAYERS).double().eval()
    with caplog.at_level("WARNING"):
        out = _generate(model, *_ids(1, 1, 0))
    assert out.sequences.shape == (1, 4)
    assert not [record for record in caplog.records if "not been filled" in record.getMessage()]


def test_a_rounded_cache_that_does_not_fit_gives_way_to_the_exact_size(monkeypatch):
    """generate's static cache takes the exact size where the rounded one's buffers would not fit in memory, and is
    refused (one line, before allocating) only where the exact size does not fit either."""
    model = tiny_model(LAYERS).double().eval()
    per_slot = sum(mixer.cache_values_per_token() * 8 for mixer in cache_checks._kv_mixers(model.model) if mixer)
    monkeypatch.setattr(cache_checks, "available_memory", lambda device: per_slot * 100)  # 100 slots a row fit
    result = _generate(model, *_ids(1, 40, 0))
    assert result.past_key_values.layers[1].max_cache_len == 40 + 3 - 1  # (the last new token is not cached)
    with pytest.raises(ValueError, match="at most 100 slots per row fit"):
        _generate(model, *_ids(1, 120, 0))


def test_the_default_cache_warm_up_covers_prompts_run_in_pieces(monkeypatch):
    """Where max_length allows, the warm-up's default-cache prompts include ones run in pieces of tokens
    (token_chunks), their last piece of each divisibility by 16 (a Triton specialisation); none past max_length."""
    monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", 128)
    pieces = {n: token_chunks.chunk_bounds(n) for n in warm_up._dynamic_cache_lengths(1000)}
    last = {(bounds[-1] - bounds[-2]) % 16 == 0 for bounds in pieces.values() if len(bounds) > 2}
    assert last == {True, False}
    for max_length in (100, 194):
        assert all(len(token_chunks.chunk_bounds(n)) == 2 and n <= max_length - warm_up.NEW_TOKENS
                   for n in warm_up._dynamic_cache_lengths(max_length))

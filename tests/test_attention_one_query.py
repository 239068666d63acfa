"""A decoding step's attention by two GEMMs (attention_one_query): against the softmax-attention math in float64, and
inside models (GQA attention, MLA's absorbed step) whose cached decoding must equal the uncached forward."""

from __future__ import annotations

import pytest
import torch

from hybrid_linear_models import attention_one_query
from hybrid_linear_models.attention_one_query import few_queries_apply, one_query_applies, one_query_attention
from model_helpers import assert_cached_generation_equals_uncached, greedy, replay_graphs_eagerly, tiny_model


def reference(query, key, value, mask, scaling):
    """softmax(q k^T * scaling + mask) v per query head (head h reads KV head h // G), in float64: [B, T, H, dv]."""
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


def inputs(batch, heads, kv_heads, queries, keys, dim, value_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    key = torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype)
    value = torch.randn(batch, kv_heads, keys, value_dim, generator=g).to(dtype)
    seen = torch.rand(batch, 1, 1, keys, generator=g) < 0.7
    seen[..., -1] = True  # the step's own key: every row sees at least one key
    return query, key, value, seen


def additive(seen, dtype, masked):
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, masked)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["-inf", "finfo-min", "bool", "none"])
def test_equals_the_attention_math_in_float32(heads, kv_heads, mask_kind):
    query, key, value, seen = inputs(3, heads, kv_heads, 1, 37, 16, 12, torch.float32)
    mask = {"-inf": additive(seen, torch.float32, float("-inf")),
            "finfo-min": additive(seen, torch.float32, torch.finfo(torch.float32).min),
            "bool": seen, "none": None}[mask_kind]
    got, weights = one_query_attention(None, query, key, value, mask, scaling=0.25)
    assert weights is None and got.shape == (3, 1, heads, 12)
    expected = reference(query, key, value, seen if mask is not None else None, 0.25)
    # float32 products and sums of 16 and 37 terms of unit-scale numbers: ~1e-6
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_heads_as_rows_of_one_latent_head_with_a_strided_value_view():
    """MLA's absorbed step: 6 heads are the rows (queries) of one KV head, the value a view of the key's first
    columns (the cache tensor read in place)."""
    query, key, _, seen = inputs(2, 1, 1, 6, 29, 24, 24, torch.float32, seed=1)
    value = key[..., :20]
    mask = additive(seen, torch.float32, float("-inf"))
    got, _ = one_query_attention(None, query, key, value, mask, scaling=0.2)
    torch.testing.assert_close(got.double(), reference(query, key, value, seen, 0.2), rtol=1e-5, atol=1e-5)


def test_bfloat16_error_stays_at_the_rounding_of_its_probabilities_and_output():
    """Scores and softmax run in float32; only the probabilities (as fused kernels do) and the output are rounded to
    bf16 (relative 2^-8 each, bf16's unit roundoff), so the error is at most 2 * 2^-8 * max|v| (the probabilities sum
    to 1)."""
    query, key, value, seen = inputs(2, 8, 2, 1, 300, 64, 64, torch.bfloat16, seed=2)
    mask = additive(seen, torch.bfloat16, float("-inf"))
    got, _ = one_query_attention(None, query, key, value, mask, scaling=64 ** -0.5)
    expected = reference(query, key, value, seen, 64 ** -0.5)
    assert got.dtype == torch.bfloat16
    assert (got.double() - expected).abs().max() <= 2 * 2 ** -8 * value.double().abs().max()


def test_applies_only_to_sdpa_on_the_listed_devices_with_one_mask_row(monkeypatch):
    query = torch.zeros(1, 4, 1, 8)
    one_row, two_rows = torch.zeros(1, 1, 1, 5), torch.zeros(1, 1, 2, 5)
    assert not one_query_applies(query, one_row, "sdpa")  # CPU is not listed by default
    monkeypatch.setattr(attention_one_query, "ONE_QUERY_DEVICES", ("cuda", "cpu"))
    assert one_query_applies(query, one_row, "sdpa") and one_query_applies(query, None, "sdpa")
    assert not one_query_applies(query, one_row, "eager")
    assert not one_query_applies(query, two_rows, "sdpa")
    assert not one_query_applies(query, torch.zeros(1, 4, 1, 5), "sdpa")  # a mask per head
    assert not one_query_applies(query, object(), "sdpa")  # a described mask (sliding windows' blocks)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["-inf", "bool"])
def test_a_few_queries_each_under_its_own_mask_row(heads, kv_heads, mask_kind):
    """A verify round's k query positions: each position's mask row (causal among them, padding, a window) applies to
    that position in every query head of a KV head, not to another position."""
    query, key, value, _ = inputs(3, heads, kv_heads, 5, 37, 16, 12, torch.float32, seed=3)
    seen = torch.rand(3, 1, 5, 37, generator=torch.Generator().manual_seed(4)) < 0.6
    seen[..., 32:] = torch.ones(5, 5).tril().bool()  # the round's own keys, causal; each position sees its own
    mask = additive(seen, torch.float32, float("-inf")) if mask_kind == "-inf" else seen
    got, _ = one_query_attention(None, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(got.double(), reference(query, key, value, seen, 0.25), rtol=1e-5, atol=1e-5)


def test_a_few_queries_apply_only_where_the_cache_gives_every_query_a_key(monkeypatch):
    monkeypatch.setattr(attention_one_query, "ONE_QUERY_DEVICES", ("cuda", "cpu"))

    class Guaranteed:
        every_query_sees_a_key = True

    query = torch.zeros(2, 4, 3, 8)
    rows = torch.zeros(2, 1, 3, 9)
    assert few_queries_apply(query, rows, "sdpa", Guaranteed())
    assert not few_queries_apply(query, rows, "sdpa", object())  # a mask whose rows may be empty (prompt padding)
    assert not few_queries_apply(query, rows, "eager", Guaranteed())
    assert not few_queries_apply(query, None, "sdpa", Guaranteed())  # no mask: causality is not the caller's
    assert not few_queries_apply(query, torch.zeros(2, 1, 1, 9), "sdpa", Guaranteed())  # one row for 3 positions
    assert not few_queries_apply(query, torch.zeros(2, 4, 3, 9), "sdpa", Guaranteed())  # a mask per head
    many = torch.zeros(2, 4, attention_one_query.MAX_FEW_QUERIES + 1, 8)
    assert not few_queries_apply(many, torch.zeros(2, 1, many.shape[2], 9), "sdpa", Guaranteed())
    assert not few_queries_apply(query[:, :, :1], rows[:, :, :1], "sdpa", Guaranteed())  # one query: the step's
    monkeypatch.setattr(attention_one_query, "ONE_QUERY_DEVICES", ("cuda",))
    assert not few_queries_apply(query, rows, "sdpa", Guaranteed())


def test_a_verify_round_attends_through_it_as_through_sdpa(one_query_on_cpu):
    """The batched speculative round (k = 4 tokens a row, left-padded rows of different lengths, a sliding layer):
    its attention layers take the two GEMMs, and the round's tokens, counts and cache are sdpa's to float64
    rounding."""
    from hybrid_linear_models import speculative_decoding
    from hybrid_linear_models.verify_cache import VerifyCache

    model = tiny_model(["full_attention", "gated_deltanet", "sliding_attention"], num_key_value_heads=2,
                       sliding_window=3).double().eval()
    ids = torch.randint(2, 128, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :5] = 0, 0
    results = []
    for few_queries in (True, False):
        if not few_queries:
            attention_one_query.ONE_QUERY_DEVICES = ("cuda",)  # (restored by the fixture's monkeypatch)
        cache = VerifyCache(model, 3, 30, torch.device("cpu"))
        with torch.no_grad():
            first = speculative_decoding.prefill(model, cache, ids * mask, mask)
            drafts = torch.randint(2, 128, (3, 3), generator=torch.Generator().manual_seed(6))
            step = torch.cat([first[:, None], drafts], dim=1)
            calls_before = len(one_query_on_cpu)
            greedy, kept = speculative_decoding.verify_round(model, cache, step, torch.ones(3, dtype=torch.bool))
            round_calls = one_query_on_cpu[calls_before:]
        results.append((greedy, kept, [t.clone() for t in cache.tensors()], round_calls))
    (greedy, kept, tensors, calls), (sdpa_greedy, sdpa_kept, sdpa_tensors, sdpa_calls) = results
    assert calls == [(4, 4), (4, 4)] and not sdpa_calls  # (query heads, positions) of both attention layers
    assert torch.equal(greedy, sdpa_greedy) and torch.equal(kept, sdpa_kept)
    for ours, theirs in zip(tensors, sdpa_tensors):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # float64: the same sums, reordered


# ------------------------------------------------------------------------------------------------ inside models

LAYERS = ["full_attention", "gated_deltanet", "mla_attention", "sliding_attention"]
# float32 decoding against the uncached forward: the same sums in another order (module docstrings): ~1e-6
TOLERANCE = 1e-4


@pytest.fixture
def one_query_on_cpu(monkeypatch) -> list:
    """The path taken on the CPU too; returns the (query heads, queries) of each call it served."""
    monkeypatch.setattr(attention_one_query, "ONE_QUERY_DEVICES", ("cuda", "cpu"))
    calls: list = []
    original = one_query_attention

    def counted(module, query, *args, **kwargs):
        calls.append(tuple(query.shape[1:3]))
        return original(module, query, *args, **kwargs)

    import hybrid_linear_models.mixer_attention as attention_module
    import hybrid_linear_models.mixer_mla as mla_module
    monkeypatch.setattr(attention_module, "one_query_attention", counted)
    monkeypatch.setattr(mla_module, "one_query_attention", counted)
    return calls


def _model():
    return tiny_model(LAYERS, num_key_value_heads=2, sliding_window=3, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=8).eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_decoding_through_it_equals_the_uncached_forward(one_query_on_cpu, cache):
    model = _model()
    input_ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    assert_cached_generation_equals_uncached(model, input_ids, cache, TOLERANCE)
    heads = model.config.num_attention_heads
    assert (heads, 1) in one_query_on_cpu and (1, heads) in one_query_on_cpu  # GQA steps and MLA's absorbed ones


def test_captured_steps_of_left_padded_rows_attend_through_it_like_sdpa(one_query_on_cpu, monkeypatch):
    model = _model()
    input_ids = torch.randint(1, 100, (3, 8), generator=torch.Generator().manual_seed(4))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :1] = 0
    replay_graphs_eagerly(monkeypatch)
    through_it = greedy(model, input_ids, cache_implementation="static", attention_mask=attention_mask)
    served = len(one_query_on_cpu)
    monkeypatch.setattr(attention_one_query, "ONE_QUERY_DEVICES", ())
    sdpa = greedy(model, input_ids, cache_implementation="static", attention_mask=attention_mask)
    assert served > 0 and len(one_query_on_cpu) == served  # the second run took sdpa throughout
    assert torch.equal(through_it.sequences, sdpa.sequences)
    for a, b in zip(through_it.logits, sdpa.logits):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_scores_accumulate_in_float32(dtype):
    """On CUDA the half-precision scores come from one GEMM that returns float32 (bmm's out_dtype): the same bound
    as on the CPU (2 * u * max|v|, u the unit roundoff: bf16 2^-8, fp16 2^-11); float32 within 1e-5 of float64 (TF32
    is off for matmuls by default)."""
    query, key, value, seen = (t.cuda() for t in inputs(2, 16, 2, 1, 1152, 128, 128, dtype, seed=5))
    mask = additive(seen, dtype, float("-inf"))
    got, _ = one_query_attention(None, query, key, value, mask, scaling=128 ** -0.5)
    expected = reference(query, key, value, seen, 128 ** -0.5)
    bound = {torch.bfloat16: 2 * 2 ** -8, torch.float16: 2 * 2 ** -11, torch.float32: 1e-5}[dtype]
    assert got.dtype == dtype
    assert (got.double() - expected).abs().max() <= bound * value.double().abs().max()

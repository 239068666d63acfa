"""Long prompts: the MLPs and the GDN/KDA layers run a chunk of tokens at a time without gradients (token_chunks,
chunked_recurrence), cached decoding after a chunked prefill stays exact, positions past the model's limit are named
(position_limit), and YaRN runs as transformers' Qwen3-Next runs it.

The chunk length (token_chunks.TOKENS_PER_CHUNK, 8192) is patched to 64 so prompts of a few hundred tokens cross
several chunks.

Tolerances:
- chunked against whole, float32: the same math on the same rows; the dense MLP's GEMMs over 64-row-aligned chunks
  are bit-identical on the CPU here, the routed experts' grouped GEMMs get other row counts per expert (float32
  summation order, measured <= 4e-6 on logits up to ~10). 1e-4 is that bound with margin, and a misplaced chunk or a
  route given to another token moves logits by 1e-1 or more.
- cached decoding against the uncached forward, and GDN/KDA layers in chunks against whole, float64: the chunked
  delta rule against its one-token recurrence (or its state carried between pieces) and cached attention against the
  full one differ by summation order only (~1e-13; the pieces measured identical); 1e-9 as tests/test_kimi_moe.py.
- against transformers' Qwen3-Next, float32: 1e-4, tests/test_convert_qwen3_next.py's bound and reasons.
"""

from __future__ import annotations

import logging

import pytest
import torch
from model_helpers import randomize, tiny_config, tiny_model
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM, StaticCache

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM, token_chunks
from hybrid_linear_models.mlp_dense import GatedMLP
from hybrid_linear_models.mlp_sparse_moe import HybridLinearExperts, RoutedMoeBlock
from hybrid_linear_models.position_limit import position_limit

CHUNK = 64
CHUNKED_TOLERANCE = 1e-4
CACHED_TOLERANCE = 1e-9
LAYERS = {"gdn": ["gated_deltanet", "full_attention", "gated_deltanet"],
          "kda": ["kimi_delta_attention", "full_attention", "kimi_delta_attention"]}
MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16)
MLP_CASES = {
    "dense": {},
    "sparse_moe": dict(mlp_types=["sparse_moe", "dense", "sparse_moe"], shared_expert_intermediate_size=24,
                       norm_topk_prob=True, **MOE),
    "kimi_moe": dict(mlp_types=["kimi_moe", "dense", "kimi_moe"], **MOE),
}


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def rows_through(monkeypatch) -> list[int]:
    """The row count of every dense-MLP and MoE-block computation from here on (their per-chunk functions)."""
    rows: list[int] = []
    for cls, name in ((GatedMLP, "_gated"), (RoutedMoeBlock, "_experts_and_shared")):
        original = getattr(cls, name)

        def spy(self, x, *args, original=original, **kwargs):
            rows.append(x.reshape(-1, x.shape[-1]).shape[0])
            return original(self, x, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    return rows


def test_chunks_start_aligned_and_none_is_short(monkeypatch):
    monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", CHUNK)
    assert token_chunks.chunk_bounds(129) == [0, 64, 129]  # a 1-row remainder joins the last chunk
    assert token_chunks.chunk_bounds(280) == [0, 64, 128, 192, 280]  # and a 24-row one
    assert token_chunks.chunk_bounds(352) == [0, 64, 128, 192, 256, 320, 352]  # half a chunk stands alone
    for tokens in range(65, 700):
        bounds = token_chunks.chunk_bounds(tokens)
        sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == tokens and all(start % 64 == 0 for start in bounds[:-1])
        assert min(sizes) >= CHUNK // 2 and max(sizes) < 2 * CHUNK


@pytest.mark.parametrize("mlp", sorted(MLP_CASES))
def test_long_prompt_runs_its_mlps_in_chunks_with_the_whole_prompts_logits(mlp, monkeypatch):
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention"], **MLP_CASES[mlp])
    tokens = prompt(300)
    with torch.no_grad():
        whole = model(tokens).logits
    rows = rows_through(monkeypatch)
    monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", CHUNK)
    with torch.no_grad():
        chunked = model(tokens).logits
    # every MLP (and shared expert) saw chunks of at most 1.5 chunks' rows, 300 rows in all
    assert max(rows) <= CHUNK * 3 // 2 and len(rows) > 2 * len(model.model.layers) and sum(rows) % 300 == 0, rows
    torch.testing.assert_close(chunked, whole, rtol=0, atol=CHUNKED_TOLERANCE)
    assert whole.abs().max() > 1  # logits of a real size: the comparison means something


@pytest.mark.parametrize("mlp", ["sparse_moe", "kimi_moe"])
def test_chunked_moe_sends_every_token_to_the_experts_it_goes_to_whole(mlp, monkeypatch):
    """One MoE block on the same 300 rows, whole then in chunks: the same (expert, weight) routes for every token,
    and the same output to summation order."""
    block = tiny_model(["gated_deltanet"], **{**MLP_CASES[mlp], "mlp_types": [mlp]}).model.layers[0].mlp
    routes: list[torch.Tensor] = []
    original = HybridLinearExperts.forward

    def spy(self, hidden_states, top_k_index, top_k_weights):
        routes.append(torch.cat([top_k_index.float(), top_k_weights.float()], -1))
        return original(self, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(HybridLinearExperts, "forward", spy)
    block.experts.config._experts_implementation = "eager"  # (this class's own forward: the spy sees every call)
    x = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = block(x)
        whole_routes = torch.cat(routes)
        routes.clear()
        monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", CHUNK)
        chunked = block(x)
    assert len(routes) == len(token_chunks.chunk_bounds(300)) - 1 > 1
    assert torch.equal(torch.cat(routes), whole_routes)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=CHUNKED_TOLERANCE)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_long_prompt_runs_its_gdn_and_kda_layers_in_chunks_with_the_whole_prompts_logits(padded, monkeypatch):
    """Each GDN/KDA layer takes the prompt a chunk of tokens at a time, its state carried (chunked_recurrence): the
    logits of the whole forward, a left-padded row's included (its pads fall in the first chunks)."""
    model = tiny_model(["gated_deltanet", "full_attention", "kimi_delta_attention"]).double()
    tokens = torch.cat([prompt(300), prompt(300, seed=1)])
    mask = torch.ones_like(tokens)
    mask[1, :150] = 0
    kwargs = {"attention_mask": mask} if padded else {}
    with torch.no_grad():
        whole = model(tokens, **kwargs).logits
    seen: list[int] = []
    for layer in model.model.layers:
        if layer.mixer_state == "recurrent":
            layer.linear_attn.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", CHUNK)
    with torch.no_grad():
        chunked = model(tokens, **kwargs).logits
    assert max(seen) <= CHUNK * 3 // 2 and sum(seen) == 2 * 300, seen
    torch.testing.assert_close(chunked, whole, rtol=0, atol=CACHED_TOLERANCE)


@pytest.mark.parametrize("how", ["no cache", "dynamic cache", "static cache", "generate", "generate static"])
def test_an_unpadded_prompt_attends_through_sdpas_causal_kernel_with_no_mask(how, monkeypatch):
    """No [T, T] mask is built for a prompt without padding (2-D mask of ones or none): sdpa gets is_causal and no
    mask, so its flash or memory-efficient kernel runs in O(T) memory."""
    model = tiny_model(LAYERS["gdn"])
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        calls.append((query.shape[2], attn_mask, is_causal))
        return sdpa(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tokens = prompt(300)
    ones = torch.ones_like(tokens)
    with torch.no_grad():
        if how == "no cache":
            model(tokens, attention_mask=ones)
        elif how.endswith("cache"):
            cache = (DynamicCache(config=model.config) if how == "dynamic cache"
                     else StaticCache(config=model.config, max_cache_len=320))
            model(tokens, attention_mask=ones, cache=cache, use_cache=True, logits_to_keep=1)
        else:
            model.generate(tokens, attention_mask=ones, max_new_tokens=2, do_sample=False, pad_token_id=0,
                           **({"cache_implementation": "static"} if how.endswith("static") else {}))
    [prompt_call] = [call for call in calls if call[0] == 300]
    assert prompt_call[1] is None and prompt_call[2] is True


def test_training_runs_the_mlp_whole(monkeypatch):
    model = tiny_model(LAYERS["gdn"]).train()
    rows = rows_through(monkeypatch)
    monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", CHUNK)
    model(prompt(300), labels=prompt(300)).loss.backward()
    assert rows == [300] * 3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_cached_decoding_after_a_chunked_prefill_equals_the_uncached_forward(kind, cache, monkeypatch):
    """Prefill 200 tokens (four MLP chunks, several of the delta rule's 64-token chunks), then 12 one-token steps:
    the logits at every position equal the uncached forward's over all 212 tokens."""
    monkeypatch.setattr(token_chunks, "TOKENS_PER_CHUNK", CHUNK)
    model = tiny_model(LAYERS[kind], mlp_types=["dense", "sparse_moe", "dense"], **MOE).double()
    tokens = prompt(212)
    with torch.no_grad():
        expected = model(tokens, use_cache=False).logits
        cached = (DynamicCache(config=model.config) if cache == "dynamic"
                  else StaticCache(config=model.config, max_cache_len=256))
        got = [model(tokens[:, :200], cache=cached, use_cache=True).logits]
        for position in range(200, 212):
            got.append(model(tokens[:, position : position + 1], cache=cached, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, 1), expected, rtol=0, atol=CACHED_TOLERANCE)


@pytest.mark.parametrize("rope, limit", [
    ({"rope_type": "default"}, (64, "max_position_embeddings")),
    ({"rope_type": "yarn", "factor": 4.0}, (256, "max_position_embeddings 64 x rope factor 4, yarn")),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, (64, "max_position_embeddings")),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
     (128, "original_max_position_embeddings 16 x rope factor 8, yarn")),
    ({"rope_type": "linear", "factor": 2.0}, (128, "max_position_embeddings 64 x rope factor 2, linear")),
    ({"rope_type": "dynamic", "factor": 2.0}, (128, "max_position_embeddings 64 x rope factor 2, dynamic")),
])
def test_position_limit_is_max_position_embeddings_stretched_by_the_rope_scaling(rope, limit):
    config = tiny_config(LAYERS["gdn"], max_position_embeddings=64, rope_parameters=rope)
    assert position_limit(config) == limit


def test_a_model_without_rotary_full_attention_has_no_position_limit():
    assert position_limit(tiny_config(["gated_deltanet", "kimi_delta_attention", "sliding_attention"],
                                      max_position_embeddings=64)) is None


def test_an_input_past_the_positions_is_warned_about_once_and_runs(caplog):
    model = tiny_model(LAYERS["gdn"], max_position_embeddings=64)
    with caplog.at_level(logging.WARNING, logger="hybrid_linear_models.position_limit"), torch.no_grad():
        model(prompt(64))
        assert not caplog.records
        logits = model(prompt(100)).logits
        model(prompt(120))
    assert logits.shape == (1, 100, 128) and torch.isfinite(logits).all()
    [record] = caplog.records
    assert "\n" not in record.getMessage()
    assert record.getMessage().startswith(
        "the input reaches 100 positions; this model's positions go to 64 (max_position_embeddings)")
    assert "'rope_type': 'yarn', 'factor': 1.6, 'original_max_position_embeddings': 64" in record.getMessage()


def test_generate_warns_before_the_prefill_when_prompt_plus_new_tokens_pass_the_positions(caplog):
    model = tiny_model(LAYERS["gdn"], max_position_embeddings=64)
    with caplog.at_level(logging.WARNING, logger="hybrid_linear_models.position_limit"), torch.no_grad():
        out = model.generate(prompt(50), max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 80)
    [record] = [record for record in caplog.records if record.name == "hybrid_linear_models.position_limit"]
    assert record.getMessage().startswith("the prompt plus max_new_tokens (less the last, never fed back) reaches 79 "
                                          "positions; this model's positions go to 64 (max_position_embeddings)")


def test_generate_to_exactly_the_positions_plus_the_last_token_is_silent_and_static_takes_it(caplog):
    """50 + 15 = 65 tokens feed 64 positions (the last token is never fed back): no warning, and the static cache of
    64 slots takes it; one token more is refused, naming 65 tokens in all."""
    model = tiny_model(LAYERS["gdn"], max_position_embeddings=64)
    settings = {"do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    with caplog.at_level(logging.WARNING, logger="hybrid_linear_models.position_limit"), torch.no_grad():
        out = model.generate(prompt(50), max_new_tokens=15, min_new_tokens=15, **settings)
        assert out.shape == (1, 65)
        assert not [record for record in caplog.records if record.name == "hybrid_linear_models.position_limit"]
        with pytest.raises(ValueError, match="ask for at most 65 tokens in all"):
            model.generate(prompt(50), max_new_tokens=16, min_new_tokens=16, **settings)


def test_a_static_cache_takes_the_positions_yarn_extends_and_refuses_past_them():
    model = tiny_model(LAYERS["gdn"], max_position_embeddings=64, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with torch.no_grad():
        out = model.generate(prompt(100), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             cache_implementation="static")
        assert out.shape == (1, 108)
        with pytest.raises(ValueError, match=r"300 key slots per row .* more than the model's 256 positions "
                                             r"\(max_position_embeddings 64 x rope factor 4, yarn\)"):
            model(prompt(8), cache=StaticCache(config=model.config, max_cache_len=300), use_cache=True)


# ------------------------------------------------------------------------------------------------ YaRN, transformers


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25}


def yarn_pair() -> tuple[Qwen3NextForCausalLM, HybridLinearForCausalLM]:
    """transformers' Qwen3-Next with YaRN (trained length 32, factor 4) and ours, the same config and weights."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=32, rope_parameters=dict(YARN))
    theirs = Qwen3NextConfig(**common, num_hidden_layers=3,
                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=8, num_experts=0)
    torch.manual_seed(0)
    reference = randomize(Qwen3NextForCausalLM(theirs)).eval()
    ours = HybridLinearForCausalLM(HybridLinearConfig(
        **common, layer_types=LAYERS["gdn"], gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=16,
        gdn_value_head_dim=8)).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


def test_yarn_matches_transformers_qwen3_next_past_the_trained_length_and_survives_saving(tmp_path):
    reference, ours = yarn_pair()
    tokens = prompt(100)  # positions to 99: past the trained 32, within YaRN's 128
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(ours(tokens).logits, expected, rtol=0, atol=1e-4)
        greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(tokens, **greedy), reference.generate(tokens, **greedy))
        assert torch.equal(ours.generate(tokens, cache_implementation="static", **greedy),
                           reference.generate(tokens, **greedy))
    ours.save_pretrained(tmp_path)
    again = HybridLinearForCausalLM.from_pretrained(tmp_path).eval()
    assert {key: again.config.rope_parameters[key] for key in YARN} == YARN
    assert again.model.rotary_emb.attention_scaling == reference.model.rotary_emb.attention_scaling != 1.0
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, ours(tokens).logits)


def test_warm_up_takes_the_positions_yarn_extends_and_refuses_past_them():
    model = tiny_model(LAYERS["gdn"], max_position_embeddings=64, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match=r"max_length=257 passes the model's 256 positions \(max_position_embeddings "
                                         r"64 x rope factor 4, yarn\)"):
        model.warm_up(max_length=257)
    report = model.warm_up(max_length=256, verbose=False)
    assert report.generate_calls > 0

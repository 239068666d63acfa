"""Multi-head latent attention ("mla_attention", mixer_mla.py): the layer against transformers' KimiLinearAttention
(the same weights) and, in its rotary (DeepSeek) form, against a reference written here from the math; its latent
cache (dynamic, static, the CUDA-graph path replayed eagerly) against uncached decoding; packing, left padding,
per-layer settings, config errors, saving and remote code."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from distributed_helpers import run_script
from model_helpers import (
    WITHOUT_THE_PACKAGE_PRELUDE,
    assert_cached_generation_equals_uncached,
    assert_padded_and_packed_rows_run_alone,
    assert_same_generation,
    greedy,
    randomize,
    replay_graphs_eagerly,
    run_without_the_package,
)
from numerics import max_rel_err
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.cache_hybrid_linear import layer_bytes_per_token
from hybrid_linear_models.mixer_mla import (
    HybridLinearMultiHeadLatentAttention,
    cache_bytes_per_token,
    full_kv_bytes_per_token,
)

MLA = dict(num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
HYBRID = ["kimi_delta_attention", "mla_attention", "gated_deltanet", "mla_attention"]


def mla_config(layer_types=None, **overrides) -> HybridLinearConfig:
    settings = dict(vocab_size=128, hidden_size=32, intermediate_size=48, layer_types=layer_types or HYBRID,
                    kda_num_heads=2, kda_head_dim=8, gdn_num_key_heads=2, gdn_num_value_heads=2,
                    gdn_key_head_dim=8, gdn_value_head_dim=8, rms_norm_eps=1e-6, **MLA)
    return HybridLinearConfig(**{**settings, **overrides})


def mla_model(layer_types=None, seed: int = 0, **overrides) -> HybridLinearForCausalLM:
    """A tiny hybrid model whose layer 1 is Kimi's form (no rotary, full-rank q) and layer 3 DeepSeek's (rotary on
    the shared slice, q LoRA), with distinct random weights everywhere."""
    overrides.setdefault("per_layer_config", {3: {"mla_use_nope": False, "q_lora_rank": 12}})
    torch.manual_seed(seed)
    return randomize(HybridLinearForCausalLM(mla_config(layer_types, **overrides)), seed).eval()


# ------------------------------------------------------------------------------- the layer against references


def _kimi_pair(q_lora_rank: int, rope: int, bias: bool = False):
    """transformers' KimiLinearAttention and ours with the same random weights (eager attention, plain norms of
    epsilon 1e-6: KimiLinearRMSNorm's default, which its MLA norms use)."""
    sizes = dict(MLA, qk_rope_head_dim=rope)
    kimi_config = KimiLinearConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, q_lora_rank=q_lora_rank or None,
                                   num_key_value_heads=sizes["num_attention_heads"], attention_bias=bias, **sizes)
    kimi_config._attn_implementation = "eager"
    torch.manual_seed(0)
    kimi = KimiLinearAttention(kimi_config, 0)
    randomize(kimi, seed=1)
    config = mla_config(["mla_attention"], qk_rope_head_dim=rope, q_lora_rank=q_lora_rank, zero_centered_norms=False,
                        mla_norm_eps=1e-6, attention_bias=bias)
    config._attn_implementation = "eager"
    ours = HybridLinearMultiHeadLatentAttention(config, 0)
    assert set(dict(ours.named_parameters())) == {n for n, p in kimi.named_parameters() if p is not None}
    ours.load_state_dict(kimi.state_dict())
    return kimi, ours


@pytest.mark.parametrize("q_lora_rank,rope,bias", [(0, 4, False), (12, 4, False), (0, 0, False), (12, 0, False),
                                                   (12, 4, True), (0, 4, True)])
def test_layer_and_gradients_equal_transformers_kimi_attention(q_lora_rank, rope, bias):
    kimi, ours = _kimi_pair(q_lora_rank, rope, bias)
    assert (ours.o_proj.bias is not None) == bias
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.full((9, 9), torch.finfo(torch.float32).min).triu(1)[None, None]
    outputs, gradients = [], []
    for layer, call in ((kimi, lambda h: kimi(h, mask)[0]), (ours, lambda h: ours(h, None, mask)[0])):
        h = x.clone().requires_grad_()
        out = call(h)
        out.square().sum().backward()
        outputs.append(out.detach())
        gradients.append({"input": h.grad, **{n: p.grad for n, p in layer.named_parameters() if p is not None}})
    # The same float32 operations in the same order except the RMSNorm kernel and the key assembly (cat vs copy):
    # differences are a few float32 roundings (~1e-7 relative), far inside 1e-5.
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for name, expected in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], expected, rtol=1e-5, atol=1e-6, msg=name)


def _reference_deepseek(layer: HybridLinearMultiHeadLatentAttention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """The rotary MLA of one sequence x [T, hidden] from the formulas (module docstring), token by token and head by
    head: plain RMSNorms, pairs (j, j + p/2) rotated by angle position * theta^(-2j/p), causal softmax."""
    nope, rope, v_dim, r = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.kv_lora_rank
    x = x.double()
    weight = {n: p.detach().double() for n, p in layer.named_parameters()}

    def rms(values, w):
        return values / torch.sqrt(values.square().mean(-1, keepdim=True) + layer.kv_a_layernorm.eps) * w

    def rotate(values, position):
        half = rope // 2
        angles = position * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rope)
        a, b = values[:half], values[half:]
        return torch.cat([a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin()])

    q_latent = rms(x @ weight["q_a_proj.weight"].T, weight["q_a_layernorm.weight"])
    q = (q_latent @ weight["q_b_proj.weight"].T).view(len(x), layer.num_heads, nope + rope)
    compressed = x @ weight["kv_a_proj_with_mqa.weight"].T
    latent = rms(compressed[:, :r], weight["kv_a_layernorm.weight"])
    kv = (latent @ weight["kv_b_proj.weight"].T).view(len(x), layer.num_heads, nope + v_dim)
    outputs = torch.zeros(len(x), layer.num_heads, v_dim, dtype=torch.float64)
    for t in range(len(x)):
        for i in range(layer.num_heads):
            query = torch.cat([q[t, i, :nope], rotate(q[t, i, nope:], t)])
            scores = torch.stack([query @ torch.cat([kv[j, i, :nope], rotate(compressed[j, r:], j)])
                                  for j in range(t + 1)]) / math.sqrt(nope + rope)
            outputs[t, i] = scores.softmax(0) @ kv[: t + 1, i, nope:]
    return outputs.reshape(len(x), -1) @ weight["o_proj.weight"].T


def test_rotary_form_equals_a_reference_from_the_math():
    model = mla_model(["mla_attention"], zero_centered_norms=False,
                      per_layer_config={0: {"mla_use_nope": False, "q_lora_rank": 12}})
    layer = model.model.layers[0].self_attn
    captured = {}
    layer.register_forward_hook(lambda module, args, output: captured.update(x=args[0], y=output[0]))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4)))
    expected = _reference_deepseek(layer, captured["x"][0], model.config.rope_parameters["rope_theta"])
    # float32 against a float64 loop: rounding of float32 projections and softmax, ~1e-6 relative
    torch.testing.assert_close(captured["y"][0].double(), expected, rtol=1e-5, atol=1e-5)
    # and the rotation matters: the same weights without it give other outputs
    model.model.layers[0].self_attn.rotary = False
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4)))
    assert (captured["y"][0].double() - expected).abs().max() > 1e-3


@pytest.mark.parametrize("mscale", [{}, {"mscale": 1.0, "mscale_all_dim": 1.0},
                                    {"mscale": 0.707, "mscale_all_dim": 0.707}],
                         ids=["plain yarn", "mscale 1", "mscale 0.707"])
def test_rotary_form_with_yarn_equals_transformers_deepseek_v3_past_the_trained_length(mscale):
    """MLA with rotary keys (DeepSeek's form, rope_interleave False) and YaRN, mscale_all_dim's softmax correction
    included, against transformers' DeepseekV3ForCausalLM of the same weights, 100 positions past a trained 32, in
    float32: both take the rotary tables in float32 (in float64 ours are float64's, theirs float32's: 1e-6 apart)
    and run the same ops, so only the order of float32 sums may differ (~1e-6 relative)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
            **mscale}
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "tie_word_embeddings": False}
    theirs = DeepseekV3Config(**common, num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=None,
                              rope_interleave=False, rope_parameters=dict(yarn), n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    reference = randomize(DeepseekV3ForCausalLM(theirs)).eval()
    ours = HybridLinearForCausalLM(HybridLinearConfig(**common, layer_types=["mla_attention"] * 2,
                                                      mla_use_nope=False, zero_centered_norms=False,
                                                      rope_parameters=dict(yarn), head_dim=16)).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(x).logits
        torch.testing.assert_close(ours(x).logits, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# --------------------------------------------------------------------------------------------- cache and decoding

# Cached steps see the same keys as the uncached forward; only the summation order differs (one-token steps attend
# in the latent space: kv_b_proj folded into the query and output, module docstring), float32: ~1e-6.
TOLERANCE = 1e-4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_uncached(cache):
    model = mla_model()
    input_ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    assert_cached_generation_equals_uncached(model, input_ids, cache, TOLERANCE)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_beside_full_and_sliding_attention_with_rotary_tables_of_their_own(cache):
    """A rotary MLA layer (6 rotated dims) beside attention layers (16 * 0.25 = 4 rotated dims) and a NoPE one: two
    rotary tables, one causal mask shared by full and latent attention, the sliding layer its own window."""
    model = mla_model(["full_attention", "mla_attention", "sliding_attention", "mla_attention"], head_dim=16,
                      num_key_value_heads=2, sliding_window=3, qk_rope_head_dim=6, mla_use_nope=False,
                      per_layer_config={3: {"mla_use_nope": True, "q_lora_rank": 12}})
    assert model.model.rotary_of_layer == [0, 1, 0, None]
    assert [r.inv_freq.numel() for r in model.model.rotary_embs] == [2, 3]  # rotated pairs: 4 / 2 and 6 / 2
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(13))
    assert_cached_generation_equals_uncached(model, input_ids, cache, TOLERANCE)


def test_cuda_graph_path_replayed_eagerly_equals_eager_decoding(monkeypatch):
    captured = replay_graphs_eagerly(monkeypatch)
    model = mla_model()
    input_ids = torch.randint(1, 128, (3, 8), generator=torch.Generator().manual_seed(6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    attention_mask[2, :1] = 0
    graphed = greedy(model, input_ids, cache_implementation="static", attention_mask=attention_mask)
    assert len(captured) == 1 and captured[0].replays == 7  # the 7 steps after the prefill ran the captured step
    model.set_cuda_graph_decoding(False)
    eager = greedy(model, input_ids, cache_implementation="static", attention_mask=attention_mask)
    assert_same_generation(graphed, eager, TOLERANCE)
    # and each left-padded row decodes as it does alone, without a cache
    for row in range(3):
        alone = greedy(model, input_ids[row : row + 1, (attention_mask[row] == 0).sum():], use_cache=False)
        assert torch.equal(graphed.sequences[row, 8:], alone.sequences[0, -8:])


def test_absorbed_decoding_step_equals_the_expanded_one(monkeypatch):
    model = mla_model()
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(7))
    paths = []
    for name in ("_absorbed", "_expanded"):
        original = getattr(HybridLinearMultiHeadLatentAttention, name)
        monkeypatch.setattr(HybridLinearMultiHeadLatentAttention, name,
                            lambda self, *a, _original=original, _name=name, **k: paths.append(_name) or
                            _original(self, *a, **k))
    with torch.no_grad():
        for implementation in ("eager", "sdpa"):
            model.config._attn_implementation = implementation
            cache = DynamicCache(config=model.config)
            paths.clear()
            model(input_ids[:, :5], cache=cache, use_cache=True)
            assert paths == ["_expanded", "_expanded"]  # the prompt: per-head keys and values (both MLA layers)
            step = model(input_ids[:, 5:], cache=cache, use_cache=True).logits
            assert paths[2:] == ["_absorbed", "_absorbed"]  # the one-token step: in the latent space
            full = model(input_ids).logits[:, 5:]
            torch.testing.assert_close(step, full, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_a_decoding_step_stacks_the_query_and_latent_projections(monkeypatch, q_lora_rank):
    """In a one-token step q_proj (or q_a_proj) and kv_a_proj_with_mqa (a Linear subclass keeping Linear's forward)
    run as one stacked GEMM, whose parameters become views of the stack; the step's logits are those of the two
    products apart (float64: the same dot products)."""
    from hybrid_linear_models import fused_projections

    model = mla_model(["mla_attention"], per_layer_config={0: {"q_lora_rank": q_lora_rank}}).double()
    layer = model.model.layers[0].self_attn
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(8))
    stacked = []
    call = fused_projections.FusedProjections.__call__

    def counted(self, x, linears, *args, **kwargs):
        stacked.append(len(linears))
        return call(self, x, linears, *args, **kwargs)

    monkeypatch.setattr(fused_projections.FusedProjections, "__call__", counted)

    def step():
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids[:, :5], cache=cache, use_cache=True)
            return model(input_ids[:, 5:], cache=cache, use_cache=True).logits

    together = step()
    assert stacked == [2]  # (the prompt's projections ran apart; the step's as one)
    first = layer.q_a_proj if q_lora_rank else layer.q_proj
    assert first.weight.untyped_storage().data_ptr() == layer.kv_a_proj_with_mqa.weight.untyped_storage().data_ptr()
    monkeypatch.setattr(fused_projections, "stacks_projections", lambda x: False)
    monkeypatch.setattr("hybrid_linear_models.mixer_mla.stacks_projections", lambda x: False)
    torch.testing.assert_close(together, step(), rtol=1e-12, atol=1e-12)


def test_a_lora_adapter_on_kv_b_proj_is_decoded_with_its_update():
    """peft wraps kv_b_proj; the one-token steps then expand the latents through the wrapper (the absorbed form reads
    the plain weight, which would leave the adapter out), so cached decoding still equals uncached decoding."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(mla_model(), LoraConfig(r=2, target_modules=["kv_b_proj"], init_lora_weights=False))
    input_ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        adapted = model(input_ids).logits
        with model.disable_adapter():
            assert (model(input_ids).logits - adapted).abs().max() > 1e-3  # the adapter changes the outputs
    assert_cached_generation_equals_uncached(model, input_ids, "dynamic", TOLERANCE)


def test_attention_weights_are_recorded_for_mla_layers():
    model = mla_model()
    model.config._attn_implementation = "eager"
    cache = DynamicCache(config=model.config)
    input_ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        prompt = model(input_ids, output_attentions=True, cache=cache, use_cache=True).attentions
        step = model(input_ids[:, :1], output_attentions=True, cache=cache, use_cache=True).attentions
    assert [a.shape for a in prompt] == [(2, 4, 5, 5)] * 2 and [a.shape for a in step] == [(2, 4, 1, 6)] * 2
    for weights in (*prompt, *step):  # each query's weights: a distribution over the keys it sees
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert torch.all(prompt[0].triu(1) == 0)  # causal


def test_packed_and_left_padded_rows_equal_rows_run_alone():
    # attention masks keep documents and pads apart: only the summation order may differ (float32)
    assert_padded_and_packed_rows_run_alone(mla_model(), seed=8, tolerance=1e-5)


def test_packed_gradients_equal_the_sum_of_separate_ones():
    model = mla_model()
    generator = torch.Generator().manual_seed(12)
    a, b = torch.randint(2, 128, (1, 7), generator=generator), torch.randint(2, 128, (1, 4), generator=generator)
    probe = torch.randn(1, 11, 128, generator=generator)  # a random linear function of the logits

    def gradients(run):
        model.zero_grad()
        run().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "self_attn" in n}

    separate = gradients(lambda: (model(a).logits * probe[:, :7]).sum() + (model(b).logits * probe[:, 7:]).sum())
    positions = torch.cat([torch.arange(7), torch.arange(4)]).unsqueeze(0)
    packed = gradients(lambda: (model(torch.cat([a, b], 1), position_ids=positions).logits * probe).sum())
    assert len(packed) == 5 + 7  # both MLA layers' parameters (layer 3 with q LoRA)
    # float32, only the summation order differs (the GDN/KDA kernels chunk the packed row differently): measured
    # ~2e-6 of each gradient's largest entry
    errors = {name: max_rel_err(packed[name], expected) for name, expected in separate.items()}
    assert max(errors.values()) <= 1e-5, errors


def test_cache_holds_only_the_latent_and_the_shared_key_per_layer():
    model = mla_model(per_layer_config={1: {"kv_lora_rank": 8}, 3: {"kv_lora_rank": 24, "mla_use_nope": False}})
    assert model.model.layers[1].self_attn.kv_b_proj.in_features == 8
    assert model.model.layers[3].self_attn.kv_b_proj.in_features == 24
    cache = DynamicCache(config=model.config)
    assert type(cache.layers[1]) is DynamicLayer and type(cache.layers[3]) is DynamicLayer  # transformers' own
    with torch.no_grad():
        model(torch.randint(1, 128, (2, 5)), cache=cache, use_cache=True)
    for index, rank in ((1, 8), (3, 24)):
        settings = model.config.per_layer_config[index]
        assert cache.layers[index].keys.shape == (2, 1, 5, rank + 4) and cache.layers[index].values.numel() == 0
        assert layer_bytes_per_token(cache.layers[index]) == cache_bytes_per_token(settings, torch.float32) == (rank + 4) * 4
        assert full_kv_bytes_per_token(settings, torch.float32) == 4 * (8 + 4 + 6) * 4
    assert_cached_generation_equals_uncached(model, torch.randint(1, 128, (1, 6)), "static", TOLERANCE)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_static_multi_token_steps_expand_only_the_filled_slots(implementation):
    """A prefill (left-padded row included) then a chunked-prefill step of 3 tokens against a static cache of 64
    slots: kv_b_proj sees only the filled slots (7, then 10 rows per batch row), and the logits are those of a tight
    cache (10 slots) and of the uncached forward (the same keys, only the summation order differs in the uncached
    one: float32 ~1e-6, TOLERANCE as above)."""
    from transformers import StaticCache

    model = mla_model()
    model.config._attn_implementation = implementation
    input_ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(14))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding in the second row
    rows = []
    hooks = [model.model.layers[i].self_attn.kv_b_proj.register_forward_hook(
        lambda module, args, output: rows.append(args[0].shape[-2])) for i in (1, 3)]
    logits = {}
    with torch.no_grad():
        for slots in (64, 10):
            cache = StaticCache(config=model.config, max_cache_len=slots)
            rows.clear()
            prompt = model(input_ids[:, :7], attention_mask=attention_mask[:, :7], cache=cache, use_cache=True)
            step = model(input_ids[:, 7:], attention_mask=attention_mask, cache=cache, use_cache=True)
            assert rows == [7, 7, 10, 10], (slots, rows)  # per MLA layer: the filled slots, never max_cache_len
            logits[slots] = torch.cat([prompt.logits, step.logits], dim=1)
        for hook in hooks:
            hook.remove()
        uncached = model(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(logits[64], logits[10], rtol=0, atol=1e-6)  # the same slots, the same math
    real = attention_mask.bool()  # the pads' own logits are not defined the same way by every path
    torch.testing.assert_close(logits[64][real], uncached[real], rtol=TOLERANCE, atol=TOLERANCE)


def test_static_prefill_returns_weights_over_every_slot():
    """An eager prefill against a static cache of 16 slots expands only the 7 filled ones, and still returns attention
    weights over all 16 slots, as transformers' attention over the whole buffer does (the same shape as the
    full-attention layer's): the filled slots' weights those of a dynamic cache, zero on the unfilled slots."""
    from transformers import StaticCache

    model = mla_model(["mla_attention", "full_attention", "mla_attention"],
                      per_layer_config={2: {"mla_use_nope": False, "q_lora_rank": 12}})
    model.config._attn_implementation = "eager"
    input_ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        static = model(input_ids, cache=StaticCache(config=model.config, max_cache_len=16), use_cache=True,
                       output_attentions=True).attentions
        dynamic = model(input_ids, cache=DynamicCache(config=model.config), use_cache=True,
                        output_attentions=True).attentions
    assert [tuple(weights.shape) for weights in static] == [(2, 4, 7, 16)] * 3
    for over_slots, over_tokens in zip(static, dynamic):
        torch.testing.assert_close(over_slots[..., :7], over_tokens, rtol=0, atol=1e-6)  # the same keys and math
        assert not over_slots[..., 7:].any()


def test_static_cache_holds_transformers_static_layers_for_latent_attention():
    from transformers import StaticCache

    cache = StaticCache(config=mla_config(), max_cache_len=12)
    assert [type(layer) is StaticLayer for layer in cache.layers] == [False, True, False, True]


# ------------------------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("overrides,field", [
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(v_head_dim=None), "v_head_dim"),
    (dict(q_lora_rank=-1), "q_lora_rank"),
    (dict(mla_norm_eps=0.0), "mla_norm_eps"),
    (dict(per_layer_config={1: {"mla_use_nope": False, "qk_rope_head_dim": 3}}),
     "per_layer_config[1].qk_rope_head_dim"),
    (dict(per_layer_config={2: {"kv_lora_rank": 8}}), "per_layer_config[2].kv_lora_rank"),
])
def test_bad_settings_give_one_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError) as error:
        mla_config(**overrides)
    message = str(error.value)  # one line, its one problem naming the field first
    assert message.startswith(f"Invalid HybridLinearConfig: {field}") and "\n" not in message, message
    assert message.count(field.rsplit(".", 1)[-1]) <= 2, message  # named, perhaps again in the fix; nothing else


def test_model_card_and_docs_describe_the_layer():
    from hybrid_linear_models.conversion.model_card import render_model_card

    config = mla_config(per_layer_config={3: {"mla_use_nope": False, "q_lora_rank": 12}})
    card = render_model_card(config, name="toy", parameter_count=1, dtype="float32", source_format="hf",
                             source_format_description="d", source_path="p")
    assert ("1 multi-head latent attention (4 heads (q/k 8 + 4, v 6), KV latent rank 16, full-rank q, no rotary "
            "(NoPE)), 1 Gated DeltaNet") in card
    assert "KV latent rank 16, q LoRA rank 12, rotary on the shared slice) |" in card
    assert "| 3 | multi-head latent attention (`mla_attention`), mla_use_nope=False, q_lora_rank=12 |" in card
    assert "        kv_lora_rank (`int`, defaults to 512; mla_attention): MLA: rank" in HybridLinearConfig.__doc__


# --------------------------------------------------------------------------------------------- saving, remote code

_REMOTE_LOAD = WITHOUT_THE_PACKAGE_PRELUDE + textwrap.dedent("""

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, reference = sys.argv[1], load_file(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
        generated = model.generate(reference["input_ids"], max_new_tokens=4, do_sample=False, pad_token_id=0)
    print(json.dumps({"module": type(model.model.layers[1].self_attn).__module__,
                      "package_imported": any(m.split(".")[0] == "hybrid_linear_models" for m in sys.modules),
                      "max_diff": (logits - reference["logits"]).abs().max().item(),
                      "generated": generated.tolist()}))
""")


@pytest.mark.slow  # a subprocess that loads the model without the package
def test_save_and_load_round_trip_with_and_without_the_package(tmp_path):
    from safetensors.torch import save_file

    model = mla_model()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    assert (folder / "mixer_mla.py").is_file()
    loaded = HybridLinearForCausalLM.from_pretrained(folder).eval()
    assert loaded.config.per_layer_config[3].q_lora_rank == 12 and loaded.config.per_layer_config[1].q_lora_rank == 0
    input_ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = model(input_ids).logits
        assert torch.equal(loaded(input_ids).logits, logits)  # the same weights, code and inputs
        generated = model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    save_file({"input_ids": input_ids, "logits": logits}, tmp_path / "reference.safetensors")
    script = tmp_path / "load.py"
    script.write_text(_REMOTE_LOAD)
    result = run_without_the_package(script, folder, tmp_path / "reference.safetensors", cwd=tmp_path)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules") and report["module"].endswith("mixer_mla")
    assert not report["package_imported"]
    assert report["max_diff"] <= 1e-5  # the same code on the same CPU in float32: equal up to summation order
    assert report["generated"] == generated.tolist()


def test_a_deep_copy_of_a_rotary_mla_model_gives_its_logits():
    """copy.deepcopy (Trainer, peft, the GPU tests' TF32 copies) reconstructs the rotary settings view of a DeepSeek-
    form layer from a bare instance; its attribute forwarding once recursed without end there (found on an H200)."""
    import copy

    model = mla_model()
    input_ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(model)(input_ids).logits, model(input_ids).logits)


def test_layers_take_plain_rotary_tuples_as_under_torch_compile(monkeypatch):
    """transformers compiles static-cache decoding on CUDA; dynamo cannot unpack a RotaryTables, so under compilation
    the model hands every layer (cos, sin) tuples, which give the same logits (found on an H200)."""
    model = mla_model(["full_attention", "mla_attention", "gated_deltanet", "mla_attention"], head_dim=16,
                      num_key_value_heads=2, qk_rope_head_dim=6, mla_use_nope=False)
    input_ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(input_ids).logits
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        tables = model.model._position_embeddings(model.model.embed_tokens(input_ids), torch.arange(7)[None])
        assert all(type(pair) is tuple for pair in tables)
        assert torch.equal(model(input_ids).logits, expected)


# ------------------------------------------------------------------------------------------- tensor parallelism


def _tensor_parallel_check(*directories, indivisible=None) -> list[str]:
    """tests/tensor_parallel_check.py on 2 gloo ranks (as tests/test_training.py's TP tests): its output lines."""
    extra = () if indivisible is None else ("--indivisible", indivisible)
    return run_script("tensor_parallel_check.py", *directories, *extra, ranks=2).splitlines()


@pytest.mark.slow  # two torchrun ranks
def test_tensor_parallel_plan_shards_mla_heads(tmp_path):
    """tp_plan="auto" on 2 ranks: each MLA layer's query and kv_b_proj rows split by heads, o_proj by its columns,
    the shared key slice's gradient summed over the ranks at the layer's own width; logits, greedy decoding (the
    absorbed one-token steps on each rank's heads included) and every parameter's gradient are the unsharded model's,
    for the test model and for one whose MLA layers differ in qk_rope_head_dim (4 and 6; transformers' style would
    read one model-wide width: with 4 for both, layer 3's kv_a_proj_with_mqa gradient is 0.41 off)."""
    mla_model().save_pretrained(tmp_path / "same")
    mla_model(per_layer_config={3: {"mla_use_nope": False, "q_lora_rank": 12, "qk_rope_head_dim": 6}}).save_pretrained(
        tmp_path / "rope_widths")
    lines = _tensor_parallel_check(tmp_path / "same", tmp_path / "rope_widths")
    differences = [[float(x) for x in line.split()[1:]] for line in lines if line.startswith("MAX_DIFFERENCE")]
    assert len(differences) == 2
    # float32: o_proj's row-parallel sum and the heads split over 2 ranks change only the summation order (measured
    # 4.3e-5 / 6.1e-5 and 2.9e-5 / 3.8e-5: logits / gradients relative to their max), as in test_training's TP tests
    for logits, gradients in differences:
        assert logits <= 1e-4 and gradients <= 1e-4, differences

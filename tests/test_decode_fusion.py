"""The decoding step's fused paths (fused_projections, RotaryTables, the residual add moved into the next norm, the
full layers' cache writes): each equals the unfused computation, and follows every kind of weight update."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.derived_weights import SharedRows, derived_weights
from hybrid_linear_models.fused_projections import FusedProjections
from hybrid_linear_models.mixer_attention import RotaryTables, apply_rotary, rotate_together
from model_helpers import replay_graphs_eagerly, tiny_model

# every mixer and both attention layouts (gated with q/k norm and partial rotary on layer 1, plain on layer 3)
LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"]
PER_LAYER = {3: {"attention_output_gate": False, "attention_qk_norm": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}}


# Fused and separate GEMMs may sum a dot product in another order: float32 rounding, ~1e-7 relative per product,
# which 4 layers of norms and recurrences keep well under 1e-5 on these weights (logits of order 1); a wrong row,
# head or cache slot moves them by O(1). (float64 would tighten it, but torch's float64 depthwise conv on the CPU
# takes ~0.4 s a call.)
TOLERANCE = 1e-5
FLOAT64_TOLERANCE = 1e-10


def _model(**overrides) -> HybridLinearForCausalLM:
    return tiny_model(LAYERS, per_layer_config=PER_LAYER, kda_gate_bias=True, attention_bias=True, **overrides)


def _decode(model, prompt, tokens, cache=None):
    """Logits of a prefill and of one-token steps after it, and the cache."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        out = [model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]]
        for token in tokens.T:
            out.append(model(input_ids=token[:, None], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1), cache


def _without_fusion(monkeypatch):
    """Every module runs its projections separately (the reference)."""
    monkeypatch.setattr(FusedProjections, "applies", lambda self, x, linears: False)


def test_fused_decoding_equals_unfused(monkeypatch):
    model = _model()
    prompt, tokens = torch.randint(1, 100, (2, 7)), torch.randint(1, 100, (2, 3))
    fused, fused_cache = _decode(model, prompt, tokens)
    shared = [d for d in derived_weights(model) if isinstance(d, SharedRows) and d.value is not None]
    # every layer's input projections (4 mixers, 4 MLPs; attention and KDA biases too) ran stacked
    assert len(shared) >= 8
    with monkeypatch.context() as patch:
        _without_fusion(patch)
        separate, separate_cache = _decode(model, prompt, tokens)
    torch.testing.assert_close(fused, separate, rtol=TOLERANCE, atol=TOLERANCE)
    for a, b in zip(fused_cache.layers, separate_cache.layers):
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            if isinstance(x, list):
                x, y = x[0], y[0]
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, rtol=TOLERANCE, atol=TOLERANCE)


def test_stacked_weights_share_the_parameters_storage():
    model = _model()
    prompt, tokens = torch.randint(1, 100, (1, 4)), torch.randint(1, 100, (1, 1))
    _decode(model, prompt, tokens)
    mlp = model.model.layers[0].mlp
    stacked = mlp._gate_up.kept_tensors()[0].value
    assert stacked.untyped_storage().data_ptr() == mlp.gate_proj.weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.data_ptr() == stacked[mlp.gate_proj.out_features:].data_ptr()
    torch.testing.assert_close(stacked, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), rtol=0, atol=0)


def test_weight_updates_reach_the_fused_path(monkeypatch):
    """An optimiser step (training between two generations), load_state_dict and a dtype move: each time the fused
    step gives what the separate projections give with the updated weights."""
    model = _model()
    prompt, tokens = torch.randint(1, 100, (2, 5)), torch.randint(1, 100, (2, 2))

    def fused_equals_separate():
        fused, _ = _decode(model, prompt, tokens)
        with monkeypatch.context() as patch:
            _without_fusion(patch)
            separate, _ = _decode(model, prompt, tokens)
        torch.testing.assert_close(fused, separate, rtol=TOLERANCE, atol=TOLERANCE)
        return fused

    first = fused_equals_separate()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=prompt, labels=prompt).loss.backward()  # through the parameters (views of the stacked tensors)
    optimizer.step()
    model.eval()
    after_step = fused_equals_separate()
    assert (after_step - first).abs().max() > 1e-3  # the update moved the logits, and the fused path followed

    other = _model(seed=1)
    model.load_state_dict(other.state_dict())
    loaded = fused_equals_separate()
    torch.testing.assert_close(loaded, _decode(other, prompt, tokens)[0], rtol=TOLERANCE, atol=TOLERANCE)

    model.double()  # new storage for every parameter: stacked again on the next step, in float64
    fused, _ = _decode(model, prompt, tokens)
    with monkeypatch.context() as patch:
        _without_fusion(patch)
        separate, _ = _decode(model, prompt, tokens)
    # like with like: both float64 (float64 against the float32 logits would measure float32's own rounding, up to
    # ~2e-5 on these logits, not the fusion). A stack left in float32 would differ by that rounding, a stale one by
    # O(1); float64's reordered sums stay near 1e-15.
    assert fused.dtype == torch.float64
    torch.testing.assert_close(fused, separate, rtol=FLOAT64_TOLERANCE, atol=FLOAT64_TOLERANCE)


def test_saved_after_decoding_reloads_the_same(tmp_path):
    model = _model()
    prompt, tokens = torch.randint(1, 100, (1, 5)), torch.randint(1, 100, (1, 2))
    logits, _ = _decode(model, prompt, tokens)  # the projections now share storage
    model.save_pretrained(tmp_path)
    reloaded = HybridLinearForCausalLM.from_pretrained(tmp_path).eval()
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[name], loaded[name]) for name in saved)
    # (a BLAS may round differently for a weight at another alignment: the views sit at offsets of one tensor)
    torch.testing.assert_close(_decode(reloaded, prompt, tokens)[0], logits, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary_fraction", [0.25, 1.0])
def test_rotating_q_and_k_together_is_apply_rotary_exactly(dtype, rotary_fraction):
    torch.manual_seed(0)
    B, H, H_kv, hd = 2, 4, 2, 32
    rotary = int(hd * rotary_fraction)
    angles = torch.randn(B, 1, rotary // 2).repeat(1, 1, 2) * 5
    tables = RotaryTables(pair=(angles.cos().to(dtype), angles.sin().to(dtype)))
    q, k = torch.randn(B, 1, H, hd, dtype=dtype), torch.randn(B, 1, H_kv, hd, dtype=dtype)
    expected = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *tables)
    got = rotate_together(q, k, tables)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])  # the same products and sums


def test_captured_step_follows_in_place_updates_of_stacked_weights(monkeypatch):
    """The captured step reads the stacked tensors: an in-place update of a projection (an optimiser step between
    two generations) needs no new capture, a dtype or device move does (the parameters leave the stacked storage)."""
    graphs = replay_graphs_eagerly(monkeypatch)
    model = _model()
    prompt = torch.randint(1, 100, (2, 6))
    cache = StaticCache(config=model.config, max_cache_len=12)
    tokens = torch.randint(1, 100, (2, 3))
    _decode(model, prompt, tokens, cache)
    assert len(graphs) == 1
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(1.5)
            getattr(layer, layer.mixer_attribute).parameters().__next__().mul_(0.5)
    cache.reset()
    graphed, _ = _decode(model, prompt, tokens, cache)
    assert len(graphs) == 1
    with monkeypatch.context() as patch:
        _without_fusion(patch)
        model.set_cuda_graph_decoding(False)
        eager, _ = _decode(model, prompt, tokens)
    torch.testing.assert_close(graphed, eager, rtol=TOLERANCE, atol=TOLERANCE)
    kept = derived_weights(model)
    model.to(torch.float32)  # the same dtype: nothing moves
    assert not any(d.stale() for d in kept)
    model.double()  # new storage: the captured graph's tensors are stale, CudaGraphDecoder.step captures again
    assert any(isinstance(d, SharedRows) and d.stale() for d in kept)


@pytest.mark.parametrize("layer_type", ["gated_deltanet", "kimi_delta_attention"])
def test_decoding_hands_beta_logits_to_fla_recurrent_kernel(monkeypatch, layer_type):
    """A decoding step gives fla's recurrent kernel beta's logits with use_beta_sigmoid_in_kernel (one sigmoid
    kernel less): with fla's documented contract (sigmoid inside, then the rule) the step equals the torch path."""
    from types import SimpleNamespace

    from hybrid_linear_models import fla_backend, ops
    from hybrid_linear_models.kernels_delta_rule import recurrent_delta_rule

    seen = []

    def contract(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                 use_beta_sigmoid_in_kernel=False):
        seen.append(use_beta_sigmoid_in_kernel)
        beta = beta.sigmoid() if use_beta_sigmoid_in_kernel else beta
        g = ops.gate_log_decay(g, A_log, dt_bias) if use_gate_in_kernel else g
        return recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel)

    model = tiny_model([layer_type, "full_attention"])
    prompt, tokens = torch.randint(1, 100, (2, 5)), torch.randint(1, 100, (2, 2))
    expected, _ = _decode(model, prompt, tokens)
    fake = SimpleNamespace(fused_recurrent_gated_delta_rule=contract, fused_recurrent_kda=contract)
    monkeypatch.setattr(fla_backend, "fla_for", lambda tensor: fake)
    got, _ = _decode(model, prompt, tokens)
    assert seen == [True, True]  # the two one-token steps (the prompt runs the chunked torch path)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "factor": 4.0,
     "original_max_position_embeddings": 64},  # attention_scaling != 1
    {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
     "original_max_position_embeddings": 64},  # and unrotated dims: built from (cos, sin)
])
def test_step_rotary_tables_straight_from_positions_are_the_tables_from_cos_and_sin(rope):
    """A decoding step builds the whole-head tables from the positions with the signed frequencies (cos even, sin
    odd): the same values, bit for bit, as padding and negating the rotary embedding's own (cos, sin)."""
    model = tiny_model(["full_attention"], rope_parameters=rope, head_dim=32).to(torch.bfloat16)
    rotary = model.model.rotary_emb
    x = torch.zeros(3, 1, 8, dtype=torch.bfloat16)
    positions = torch.tensor([[0], [17], [30000]])
    from_pair = RotaryTables(pair=rotary(x, positions)).whole_head(32)
    direct = model.model._step_rotary_tables(x, positions)[0].whole_head(32)
    for a, b in zip(direct, from_pair):
        assert torch.equal(a, b)


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@_GPU[0]
@_GPU[1]
def test_gpu_captured_fused_step_equals_the_uncaptured_unfused_one(monkeypatch):
    """On CUDA (fla's kernels when installed): greedy decoding replayed from the captured, fused step gives the tokens
    of uncaptured decoding with separate projections, and logits as close to the float32 model's as that unfused bf16
    decoding's. The two bf16 paths round at different points (fla's recurrent kernel takes beta's logits, the fused
    norm adds the residual in float32, transformers compiles the uncaptured static-cache step), so neither equals the
    other to a fixed bf16 ulp count (0.12 apart on logits of order 1 on an H200); each is one bf16 rounding history
    of the same math, hence the bound: the fused path's error against float32 at most twice the unfused path's."""
    reference = _model().to("cuda")
    model = _model().to("cuda", torch.bfloat16)
    prompt = torch.randint(1, 100, (2, 12), device="cuda")
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                    return_dict_in_generate=True)
    with torch.no_grad():
        graphed = model.generate(prompt, cache_implementation="static", **settings)
        model.set_cuda_graph_decoding(False)
        with monkeypatch.context() as patch:
            _without_fusion(patch)
            plain = model.generate(prompt, cache_implementation="static", **settings)
        exact = reference(graphed.sequences).logits[:, prompt.shape[1] - 1:-1].float()
    assert torch.equal(graphed.sequences, plain.sequences)
    fused_error = max((a.float() - exact[:, i]).abs().max() for i, a in enumerate(graphed.logits))
    unfused_error = max((b.float() - exact[:, i]).abs().max() for i, b in enumerate(plain.logits))
    assert fused_error <= 2 * unfused_error, (fused_error, unfused_error)


@_GPU[0]
@_GPU[1]
def test_gpu_step_rotary_tables_equal_the_tables_from_cos_and_sin():
    """CUDA's cos and sin are even and odd too: the step's direct tables equal those built from (cos, sin)."""
    model = tiny_model(["full_attention"], head_dim=32).to("cuda", torch.bfloat16)
    x = torch.zeros(3, 1, 8, dtype=torch.bfloat16, device="cuda")
    positions = torch.tensor([[0], [17], [30000]], device="cuda")
    from_pair = RotaryTables(pair=model.model.rotary_emb(x, positions)).whole_head(32)
    direct = model.model._step_rotary_tables(x, positions)[0].whole_head(32)
    for a, b in zip(direct, from_pair):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mlp_type", ["sparse_moe", "kimi_moe"])
def test_shared_experts_decode_with_gate_and_up_as_one_gemm(monkeypatch, tmp_path, mlp_type):
    """The MoE blocks' shared experts are the dense MLP's module: in a decoding step their gate and up run as one
    GEMM (stacked rows of one tensor), with the logits of the separate projections (TOLERANCE above); saved while
    stacked, the model reloads every tensor bit for bit."""
    from test_kimi_moe import kimi_moe_model
    from test_sparse_moe_model import moe_model

    build = moe_model if mlp_type == "sparse_moe" else kimi_moe_model
    model = build(mlp_types=["dense", mlp_type, mlp_type, mlp_type]).to(torch.float32)
    prompt, tokens = torch.randint(1, 100, (2, 7)), torch.randint(1, 100, (2, 3))
    fused, _ = _decode(model, prompt, tokens)
    blocks = [layer.mlp for layer in model.model.layers[1:]]
    shared_experts = [getattr(block, "shared_expert", None) or block.shared_experts for block in blocks]
    for expert in shared_experts:
        stacked = expert._gate_up.kept_tensors()[0].value
        assert stacked is not None
        assert expert.up_proj.weight.data_ptr() == stacked[expert.gate_proj.out_features:].data_ptr()
    model.save_pretrained(tmp_path)
    saved, loaded = model.state_dict(), HybridLinearForCausalLM.from_pretrained(tmp_path).state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[name], loaded[name]) for name in saved)
    with monkeypatch.context() as patch:
        _without_fusion(patch)
        separate, _ = _decode(model, prompt, tokens)
    torch.testing.assert_close(fused, separate, rtol=TOLERANCE, atol=TOLERANCE)

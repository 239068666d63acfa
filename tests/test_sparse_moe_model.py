"""Sparse MoE layers in the whole model: against transformers' Qwen3NextForCausalLM (logits, loss, router logits, aux
loss), and everywhere the family works (packing, left padding, cached and graph decoding, gradient checkpointing,
LoRA on the experts' 3-D weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.mlp_sparse_moe import HybridLinearSparseMoeBlock
from model_helpers import assert_cached_generation_equals_uncached, assert_padded_and_packed_rows_run_alone
from model_helpers import assert_same_generation, experts_implementations_run, greedy, randomize, replay_graphs_eagerly
from model_helpers import tiny_config

LAYERS = ["gated_deltanet", "full_attention", "gated_deltanet", "gated_deltanet"]
MLPS = ["sparse_moe", "sparse_moe", "dense", "sparse_moe"]
MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           norm_topk_prob=True)


def _qwen_pair(seed: int = 0):
    """transformers' Qwen3NextForCausalLM (GDN + gated attention, MoE and dense MLPs) and ours, the same weights."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, **MOE)
    qwen_config = Qwen3NextConfig(
        **common, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        decoder_sparse_step=1, mlp_only_layers=[2], router_aux_loss_coef=0.25)
    qwen_config._attn_implementation = "eager"
    qwen_config._experts_implementation = "eager"
    torch.manual_seed(seed)
    reference = randomize(Qwen3NextForCausalLM(qwen_config), seed).eval()
    ours = HybridLinearForCausalLM(HybridLinearConfig(
        **common, layer_types=LAYERS, mlp_types=MLPS, gdn_num_key_heads=2, gdn_num_value_heads=4,
        gdn_key_head_dim=16, gdn_value_head_dim=8, rope_parameters=dict(qwen_config.rope_parameters),
        attention_output_gate=True, attention_qk_norm=True, zero_centered_norms=True, router_aux_loss_coef=0.25,
    )).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)  # the name map is the identity, MoE layers included
    return reference, ours


def moe_model(seed: int = 0, **overrides) -> HybridLinearForCausalLM:
    """A tiny float64 model of every mixer with MoE and dense MLPs (float64: comparisons of the same math in
    another order or grouping then agree to ~1e-15, so 1e-9 tolerances catch any real difference)."""
    settings = dict(MOE, mlp_types=MLPS)
    settings.update(overrides)
    torch.manual_seed(seed)
    config = tiny_config(["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"],
                         **settings)
    return randomize(HybridLinearForCausalLM(config), seed).double().eval()


@pytest.mark.parametrize("implementation", ["grouped_mm_gather", "grouped_mm", "eager"])
def test_logits_loss_and_aux_loss_match_transformers_qwen3_next(implementation):
    reference, ours = _qwen_pair()
    ours.set_experts_implementation(implementation)
    input_ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids, labels=input_ids, output_router_logits=True)
        got = ours(input_ids, labels=input_ids, output_router_logits=True)
    # float32, 4 layers: the GDN chunked kernel and the grouped GEMMs sum in other orders than transformers' loops
    # (logits ~3 in magnitude, differences ~1e-6); 1e-4 as for the dense model (test_modeling), far below any
    # mapping, routing or scaling error
    assert (expected.logits - got.logits).abs().max() <= 1e-4
    assert len(got.router_logits) == 3 and got.router_logits[0].shape == (66, 8)
    for a, b in zip(expected.router_logits, got.router_logits):
        assert (a - b).abs().max() <= 1e-4
    # aux loss ~1 (k=3 of 8 experts, balanced: 3); its top-k counts are integers that only a near-tie could flip
    assert abs(expected.aux_loss.item() - got.aux_loss.item()) <= 1e-5
    assert abs(expected.loss.item() - got.loss.item()) <= 1e-5
    plain = ours(input_ids, labels=input_ids).loss  # without router logits: no aux loss term
    assert abs((got.loss - plain).item() - 0.25 * got.aux_loss.item()) <= 1e-5


def test_aux_loss_excludes_padding_as_qwen3_next():
    model = moe_model()
    input_ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0
    with torch.no_grad():
        out = model(input_ids, attention_mask=mask, output_router_logits=True)
    expected = load_balancing_loss_func(out.router_logits, 8, 3, mask)  # transformers' own, from the same logits
    torch.testing.assert_close(out.aux_loss.double(), expected.double(), rtol=1e-6, atol=0)  # float32 sums inside
    unmasked = load_balancing_loss_func(out.router_logits, 8, 3, None)
    assert abs(unmasked.item() - expected.item()) > 1e-4  # the mask changed it: the pads were excluded


def test_packing_left_padding_and_router_logits_per_token():
    model = moe_model()
    # float64 (moe_model): each row / document as run alone, the experts grouping other tokens in their GEMMs
    assert_padded_and_packed_rows_run_alone(model, seed=3, tolerance=1e-9)


def test_flattening_collator_rows_equal_separate_rows():
    from transformers import DataCollatorWithFlattening

    model = moe_model()
    generator = torch.Generator().manual_seed(4)
    docs = [torch.randint(2, 128, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(
        [{"input_ids": doc} for doc in docs])
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).logits
        separate = torch.cat([model(torch.tensor([doc])).logits for doc in docs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-9, atol=1e-9)


def _greedy(model, input_ids, **kwargs):
    return greedy(model, input_ids, new_tokens=6, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_uncached(cache):
    model = moe_model()
    input_ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(5))
    assert_cached_generation_equals_uncached(model, input_ids, cache, tolerance=1e-9, new_tokens=6)  # float64


def test_graph_decoding_runs_a_sync_free_experts_implementation(monkeypatch):
    """The captured one-token step (its graph stood in by an eager replay, as in test_graph_decoding_cpu.py) of a
    model configured with the eager experts loop runs grouped_mm_gather inside (no host sync), and equals uncached
    decoding; outside the step the model's own choice is back."""
    replay_graphs_eagerly(monkeypatch)
    inside = experts_implementations_run(monkeypatch)
    model = moe_model()
    model.set_experts_implementation("eager")
    input_ids = torch.randint(2, 128, (2, 4), generator=torch.Generator().manual_seed(6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    without = _greedy(model, input_ids, use_cache=False, attention_mask=attention_mask)
    inside.clear()
    graphed = _greedy(model, input_ids, cache_implementation="static", attention_mask=attention_mask)
    moe_layers = MLPS.count("sparse_moe")
    assert inside[:moe_layers] == ["eager"] * moe_layers  # the prompt runs eagerly, with the model's choice
    assert set(inside[moe_layers:]) == {"grouped_mm_gather"} and len(inside) > 2 * moe_layers
    assert model.config._experts_implementation == "eager"
    assert_same_generation(graphed, without, tolerance=1e-9)  # float64 (moe_model)


def test_gradient_checkpointing_gives_the_same_gradients_and_aux_loss():
    model = moe_model().train()
    model.config.fuse_linear_cross_entropy = False
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    grads, aux = [], []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        out = model(input_ids, labels=input_ids, output_router_logits=True)
        out.loss.backward()
        aux.append(out.aux_loss.item())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert aux[0] == aux[1] and len(model.model.layers[0].mlp.experts.gate_up_proj.shape) == 3
    assert grads[0].keys() == grads[1].keys() and "model.layers.0.mlp.gate.weight" in grads[0]  # aux loss reaches it
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)  # float64


def test_lora_on_the_experts_3d_weights():
    """peft's target_parameters wraps the experts' 3-D weights (one rank-r update per expert); the adapted model
    equals the merged one."""
    from peft import LoraConfig, get_peft_model

    from hybrid_linear_models.mlp_sparse_moe import LORA_TARGET_PARAMETERS

    model = moe_model().float()
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        base = model(input_ids).logits
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"],
                                               target_parameters=list(LORA_TARGET_PARAMETERS)))
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert any("experts" in name and "lora_A" in name for name in trainable)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        before = adapted(input_ids).logits
        merged = adapted.merge_and_unload()(input_ids).logits
    assert (before - base).abs().max() > 1e-3  # the experts' adapters changed the output
    # float32: the merged weight W + BA is rounded once, the adapter adds BA x separately; ~1e-6 relative
    torch.testing.assert_close(before, merged, rtol=1e-4, atol=1e-4)
    assert isinstance(model.model.layers[0].mlp, HybridLinearSparseMoeBlock)


@pytest.mark.parametrize("fields, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be a positive integer"),
    ({"num_experts": 0}, "num_experts must be a positive integer"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be True or False"),
    ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef"),
])
def test_bad_moe_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{**MOE, "mlp_types": MLPS, **fields})


def test_per_layer_moe_settings_and_their_aux_loss():
    """Layers may differ in their experts (per_layer_config); the aux loss pools the layers of each (experts, top-k)
    and weights the groups by their layer counts (moe_load_balancing), Qwen3-Next's loss within each group."""
    model = moe_model(per_layer_config={3: {"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
                                            "shared_expert_intermediate_size": 0}})
    last = model.model.layers[3].mlp
    assert last.experts.gate_up_proj.shape == (4, 16, 64) and last.shared_expert is None
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 32, 64)
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(input_ids, output_router_logits=True)
    assert [tuple(r.shape) for r in out.router_logits] == [(12, 8), (12, 8), (12, 4)]
    first = load_balancing_loss_func(out.router_logits[:2], 8, 3)
    second = load_balancing_loss_func(out.router_logits[2:], 4, 1)
    torch.testing.assert_close(out.aux_loss.double(), ((2 * first + second) / 3).double(), rtol=1e-6, atol=0)


def test_fresh_weights_follow_qwen3_next_init(tmp_path):
    # Qwen3-Next's _init_weights: router and 3-D experts from N(0, initializer_range) (the router is built as zeros,
    # so a missed init would show as std 0); 8 x 32 x 64 = 16k draws put the sample std within 2% of 0.05
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(tiny_config(LAYERS, **MOE, mlp_types=MLPS, initializer_range=0.05))
    block = model.model.layers[0].mlp
    for tensor in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        assert abs(tensor.std().item() - 0.05) < 0.05 * 0.05 and abs(tensor.mean().item()) < 0.005
    # a saved model reloads with its weights, bit for bit (the init leaves loaded tensors alone), and its logits:
    # to ~1e-7 relative here (measured 9e-7 absolute on logits ~3, with every experts implementation), as the loaded
    # tensors' other memory placement can steer the CPU GEMMs to other vectorised paths; 1e-5 bounds that
    model.save_pretrained(tmp_path)
    reloaded = HybridLinearForCausalLM.from_pretrained(tmp_path)
    state = reloaded.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    input_ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model.eval()(input_ids).logits, rtol=1e-5, atol=1e-5)

"""Kimi-Linear's MoE MLP ("kimi_moe"): the block against transformers' KimiLinearMoE with the same weights (every
experts implementation, grouped routing, shared experts, renormalisation, scaling), its router against the math
written out per token, and the MLP in the whole model (cached and graph decoding, packing and padding, gradient
checkpointing, router logits and the aux loss, save / load, initialisation, bad configs)."""

from __future__ import annotations

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.mlp_kimi_moe import HybridLinearKimiMoeBlock
from hybrid_linear_models.mlp_sparse_moe import EXPERTS_IMPLEMENTATIONS
from model_helpers import (
    assert_cached_generation_equals_uncached,
    assert_padded_and_packed_rows_run_alone,
    assert_same_generation,
    experts_implementations_run,
    forward_backward,
    greedy,
    randomize,
    replay_graphs_eagerly,
    tiny_config,
)
from distributed_helpers import reported, run_script
from numerics import assert_close

HIDDEN = 32
# one dict per routing variant: the default single group, grouped top-k, no shared experts, no renormalisation
VARIANTS = {
    "one_group": dict(n_group=1, topk_group=1, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.0),
    "grouped": dict(n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.446),
    "no_shared": dict(n_group=2, topk_group=1, n_shared_experts=0, norm_topk_prob=True, routed_scaling_factor=2.5),
    "unnormalised": dict(n_group=4, topk_group=3, n_shared_experts=1, norm_topk_prob=False,
                         routed_scaling_factor=0.5),
}
EXPERTS = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16)


def _kimi_config(**fields) -> KimiLinearConfig:
    config = KimiLinearConfig(hidden_size=HIDDEN, num_local_experts=fields.pop("num_experts"), hidden_act="silu",
                              **fields)
    config._experts_implementation = "eager"
    return config


def _block_pair(implementation: str, variant: str, dtype=torch.float32):
    """(ours with `implementation`, transformers' KimiLinearMoE with its eager experts), the same weights and a
    random correction bias (large enough to change choices)."""
    fields = {**EXPERTS, **VARIANTS[variant]}
    torch.manual_seed(0)
    reference = KimiLinearMoE(_kimi_config(**fields)).to(dtype)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3)  # router logits of order 1: the top-k choice is not a tie
    reference.gate.e_score_correction_bias.normal_(0, 0.2)
    config = tiny_config(["gated_deltanet"], hidden_size=HIDDEN, mlp_types=["kimi_moe"], **fields)
    config._experts_implementation = implementation
    ours = HybridLinearKimiMoeBlock(config, 0).to(dtype)
    state = {name: tensor for name, tensor in reference.state_dict().items()
             if ours.shared_experts is not None or not name.startswith("shared_experts.")}  # 0 shared: none
    missing, unexpected = ours.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return ours, reference


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
def test_block_equals_kimi_linear_moe(implementation, variant):
    # float32 (torch's grouped_mm has no float64 kernel): both routers are float32 F.linear + sigmoid + the same
    # grouped top-k, so the choice is identical (checked); outputs and gradients then differ only by summation order
    # inside the GEMMs and over the k experts, a few float32 ulps (~1e-7 relative); 1e-5 leaves room and still
    # catches any wrong weight, choice, bias use or scaling (errors of order 1e-1)
    ours, reference = _block_pair(implementation, variant)
    x = torch.randn(3, 7, HIDDEN)
    _, weights, experts = ours.gate(x)
    _, ref_weights, ref_experts = reference.gate(x)
    order, ref_order = experts.sort(-1), ref_experts.sort(-1)  # transformers' top-k is unsorted
    assert torch.equal(order.values, ref_order.values), "another choice of experts"
    assert weights.dtype == torch.float32
    assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices), 1e-6, "routing weights")
    got, ref = forward_backward(ours, x), forward_backward(reference, x)
    assert_close(got[0], ref[0], 1e-5, f"{implementation}: output")
    assert_close(got[1], ref[1], 1e-5, f"{implementation}: input gradient")
    for name, grad in got[2].items():
        assert_close(grad, ref[2][name], 1e-5, f"{implementation}: gradient of {name}")
    assert "gate.e_score_correction_bias" not in got[2]  # a buffer: no gradient, not an optimizer's parameter


def _router_by_the_formula(x, weight, bias, groups, kept_groups, top_k, normalise, scale):
    """The routing of each token written out from the math (float64, one token at a time, Python sorts)."""
    experts = weight.shape[0]
    size = experts // groups
    weights, chosen = [], []
    for row in x.double():
        scores = torch.sigmoid(weight.double() @ row).tolist()
        corrected = [s + b for s, b in zip(scores, bias.double().tolist())]
        group_score = [sum(sorted(corrected[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        best_groups = sorted(range(groups), key=lambda g: -group_score[g])[:kept_groups]
        candidates = [e for e in range(experts) if e // size in best_groups]
        top = sorted(sorted(candidates, key=lambda e: -corrected[e])[:top_k])
        w = [scores[e] for e in top]
        total = sum(w)
        weights.append([scale * (v / total if normalise else v) for v in w])
        chosen.append(top)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(chosen)


@pytest.mark.parametrize("variant", ["grouped", "unnormalised"])
def test_router_follows_the_formula_per_token(variant):
    ours, _ = _block_pair("eager", variant, dtype=torch.float64)  # float64: the routing runs in float64 too
    settings = VARIANTS[variant]
    x = torch.randn(20, HIDDEN, dtype=torch.float64)
    _, weights, experts = ours.gate(x)
    order = experts.sort(-1)
    expected_weights, expected_experts = _router_by_the_formula(
        x, ours.gate.weight, ours.gate.e_score_correction_bias, settings["n_group"], settings["topk_group"],
        EXPERTS["num_experts_per_tok"], settings["norm_topk_prob"], settings["routed_scaling_factor"])
    assert torch.equal(order.values, expected_experts)
    # float64 both ways, the same few sums in another order: ~1e-16; 1e-12 catches any difference of the math
    assert_close(weights.gather(1, order.indices), expected_weights, 1e-12, "routing weights")


def test_the_bias_steers_the_choice_not_the_weights():
    ours, _ = _block_pair("eager", "one_group", dtype=torch.float64)
    x = torch.randn(16, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        ours.gate.e_score_correction_bias.zero_()
        ours.gate.e_score_correction_bias[5] = 10.0  # above any sigmoid difference: expert 5 is always chosen
    logits, weights, experts = ours.gate(x)
    assert (experts == 5).any(-1).all()
    scores = torch.sigmoid(logits).gather(1, experts)  # the weights come from the uncorrected scores
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True), rtol=1e-12, atol=0)


def test_group_score_is_the_sum_of_each_groups_best_two():
    # 2 groups of 4, keep 1: group 0 holds the single best expert (0.95) but group 1 the better pair (0.9 + 0.9);
    # scoring by the best expert alone would keep group 0, by the whole group's sum group 0 as well (0.95 + 3 x 0.5)
    ours, _ = _block_pair("eager", "one_group", dtype=torch.float64)
    ours.gate.num_group, ours.gate.topk_group, ours.gate.top_k = 2, 1, 2
    logit = lambda p: torch.log(torch.tensor(p / (1 - p), dtype=torch.float64))  # noqa: E731
    target = torch.stack([logit(p) for p in (0.95, 0.5, 0.5, 0.5, 0.9, 0.9, 0.1, 0.1)])
    with torch.no_grad():
        ours.gate.weight.zero_()
        ours.gate.weight[:, 0] = target
        ours.gate.e_score_correction_bias.zero_()
    _, _, experts = ours.gate(torch.eye(HIDDEN, dtype=torch.float64)[:1])
    assert sorted(experts[0].tolist()) == [4, 5]


def test_a_bf16_router_casts_its_weight_once_and_follows_updates():
    """A bf16 model's router scores in float32 (as transformers' KimiLinear does): its float32 weight is kept between
    no-grad steps (no cast per decoding step), equal to the cast, rebuilt after an in-place update, and under
    autograd the cast is differentiable."""
    ours, _ = _block_pair("eager", "one_group", dtype=torch.bfloat16)
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        first = ours.gate._float_weight(torch.float32)
        assert first.dtype == torch.float32 and torch.equal(first, ours.gate.weight.float())
        assert ours.gate._float_weight(torch.float32) is first  # kept
        logits, _, _ = ours.gate(x)
        torch.testing.assert_close(logits, x.float() @ ours.gate.weight.float().T, rtol=0, atol=0)
        ours.gate.weight.mul_(2)
        assert torch.equal(ours.gate._float_weight(torch.float32), ours.gate.weight.float())  # followed the update
    logits, _, _ = ours.gate(x)
    logits.sum().backward()
    assert ours.gate.weight.grad is not None and ours.gate.weight.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------- in the whole model

LAYERS = ["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"]
MLPS = ["dense", "kimi_moe", "kimi_moe", "kimi_moe"]  # Kimi-Linear's first_k_dense_replace = 1
MOE = dict(EXPERTS, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.446, norm_topk_prob=True)


def kimi_moe_model(seed: int = 0, dtype=torch.float64, **overrides) -> HybridLinearForCausalLM:
    """A tiny model of every mixer with a dense first layer and Kimi MoE layers, random correction biases (float64:
    the same math in another order agrees to ~1e-15, so 1e-9 tolerances catch any real difference)."""
    settings = dict(MOE, mlp_types=MLPS)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = randomize(HybridLinearForCausalLM(tiny_config(LAYERS, **settings)), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    return model.to(dtype).eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_uncached(cache):
    model = kimi_moe_model()
    input_ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(5))
    assert_cached_generation_equals_uncached(model, input_ids, cache, tolerance=1e-9, new_tokens=6)  # float64


def test_every_experts_implementation_agrees():
    model = kimi_moe_model(dtype=torch.float32)
    input_ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(6))
    logits = {}
    for implementation in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids).logits
    # float32: the same routing (a float32 router on the same inputs), the expert GEMMs summed in other orders,
    # ~1e-7 relative per layer over 3 MoE layers; 1e-5 leaves room and is far below any routing difference
    for implementation, value in logits.items():
        assert_close(value, logits["eager"], 1e-5, implementation)


def test_packing_and_left_padding():
    # float64: each row / document as run alone, the experts grouping other tokens (pads included) in their GEMMs
    assert_padded_and_packed_rows_run_alone(kimi_moe_model(), seed=3, tolerance=1e-9)


def test_graph_decoding_routes_every_token_without_host_sync(monkeypatch):
    """The captured one-token step (its graph stood in by an eager replay, as in test_graph_decoding_cpu.py) of a
    model configured with the eager experts loop runs grouped_mm_gather (no host sync) and equals uncached decoding:
    the replayed step routes each new token afresh."""
    captured = replay_graphs_eagerly(monkeypatch)
    inside = experts_implementations_run(monkeypatch)
    model = kimi_moe_model()
    model.set_experts_implementation("eager")
    input_ids = torch.randint(2, 128, (2, 4), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    without = greedy(model, input_ids, new_tokens=6, use_cache=False, attention_mask=attention_mask)
    inside.clear()
    graphed = greedy(model, input_ids, new_tokens=6, cache_implementation="static", attention_mask=attention_mask)
    moe_layers = MLPS.count("kimi_moe")
    assert captured and sum(step.replays for step in captured) >= 4
    assert inside[:moe_layers] == ["eager"] * moe_layers  # the prompt runs eagerly, with the model's choice
    assert set(inside[moe_layers:]) == {"grouped_mm_gather"}
    assert_same_generation(graphed, without, tolerance=1e-9)  # float64


def test_gradient_checkpointing_gives_the_same_gradients():
    model = kimi_moe_model().train()
    model.config.fuse_linear_cross_entropy = False
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(8))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids, labels=input_ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "model.layers.1.mlp.gate.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)  # float64


def test_router_logits_are_recorded_and_the_aux_loss_counts_softmax_routers_only():
    model = kimi_moe_model()
    input_ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(input_ids, labels=input_ids, output_router_logits=True)
        plain = model(input_ids, labels=input_ids)
    assert [tuple(r.shape) for r in out.router_logits] == [(12, 8)] * 3
    assert out.aux_loss is None and out.loss.item() == plain.loss.item()  # Kimi-Linear: no auxiliary loss
    # with a softmax-routed layer beside them, the aux loss is that layer's alone (transformers' own function)
    mixed = kimi_moe_model(mlp_types=["sparse_moe", "kimi_moe", "dense", "kimi_moe"],
                           shared_expert_intermediate_size=8)
    with torch.no_grad():
        out = mixed(input_ids, output_router_logits=True)
    assert len(out.router_logits) == 3
    expected = load_balancing_loss_func(out.router_logits[:1], 8, 3)
    torch.testing.assert_close(out.aux_loss.double(), expected.double(), rtol=1e-6, atol=0)  # float32 sums inside


def test_per_layer_settings():
    model = kimi_moe_model(per_layer_config={3: {"num_experts": 4, "num_experts_per_tok": 1, "n_group": 1,
                                                 "topk_group": 1, "n_shared_experts": 0,
                                                 "routed_scaling_factor": 1.5}})
    last, first = model.model.layers[3].mlp, model.model.layers[1].mlp
    assert last.experts.gate_up_proj.shape == (4, 32, 64) and last.shared_experts is None
    assert last.gate.routed_scaling_factor == 1.5 and last.gate.e_score_correction_bias.shape == (4,)
    assert first.gate.num_group == 4 and first.shared_experts.gate_proj.weight.shape == (16, 64)
    with torch.no_grad():
        _, weights, _ = last.gate(torch.randn(5, 64, dtype=torch.float64))
    torch.testing.assert_close(weights, torch.full((5, 1), 1.5, dtype=torch.float64))  # top-1 renormalised x 1.5


def test_fresh_init_save_load_and_bfloat16_load(tmp_path):
    # transformers' KimiLinear init: router and 3-D experts from N(0, initializer_range) (the router is built as
    # zeros: a skipped init would show as std 0), the correction bias zeros; 8 x 32 x 64 draws put the sample std
    # within 5% of 0.05
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(tiny_config(LAYERS, **MOE, mlp_types=MLPS, initializer_range=0.05))
    block = model.model.layers[1].mlp
    for tensor in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        assert abs(tensor.std().item() - 0.05) < 0.05 * 0.05
    assert torch.equal(block.gate.e_score_correction_bias, torch.zeros(8))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in dict(model.named_parameters())
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    reloaded = HybridLinearForCausalLM.from_pretrained(tmp_path)
    state = reloaded.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())  # bias included
    input_ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        # loaded tensors in other memory can steer the CPU GEMMs to other vectorised paths, ~1e-7 relative (as the
        # sparse MoE's reload test measured); 1e-5 bounds that
        torch.testing.assert_close(reloaded(input_ids).logits, model.eval()(input_ids).logits, rtol=1e-5, atol=1e-5)
    # loaded in bfloat16, the router weight and its bias stay float32 (as transformers keeps them), values exact
    low = HybridLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    gate = low.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert low.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(gate.e_score_correction_bias, block.gate.e_score_correction_bias)
    assert torch.equal(gate.weight, block.gate.weight)
    with torch.no_grad():
        assert low(input_ids).logits.dtype == torch.bfloat16


def test_lora_on_the_experts_and_shared_experts():
    """peft's target_parameters wraps the experts' 3-D weights, target_modules the shared experts' projections (the
    router `gate` is no target); the adapted model equals the merged one."""
    from peft import LoraConfig, get_peft_model

    from hybrid_linear_models.mlp_sparse_moe import LORA_TARGET_PARAMETERS

    model = kimi_moe_model(dtype=torch.float32)
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        base = model(input_ids).logits
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"],
                                               target_parameters=list(LORA_TARGET_PARAMETERS)))
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert any("layers.1.mlp.experts" in name and "lora_A" in name for name in trainable)
    assert any("layers.1.mlp.shared_experts.up_proj.lora_A" in name for name in trainable)
    assert not any("mlp.gate.lora" in name or "mlp.gate.weight" in name for name in trainable)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        before = adapted(input_ids).logits
        merged = adapted.merge_and_unload()(input_ids).logits
    assert (before - base).abs().max() > 1e-3  # the adapters changed the output
    # float32: the merged weight W + BA is rounded once, the adapter adds BA x separately; ~1e-6 relative
    torch.testing.assert_close(before, merged, rtol=1e-4, atol=1e-4)


def test_hf_conversion_carries_the_correction_bias(tmp_path):
    # our hf format's canonical names come from the model's state_dict (buffers included): a --from hf --to hf
    # conversion keeps every tensor bit for bit, the float32 correction bias among them
    from safetensors.torch import load_file

    from hybrid_linear_models.conversion import convert_checkpoint

    model = kimi_moe_model(dtype=torch.float32)
    model.save_pretrained(tmp_path / "ours")
    convert_checkpoint(tmp_path / "ours", tmp_path / "out", from_format="hf", to_format="hf")
    written = {name: tensor for file in (tmp_path / "out").glob("*.safetensors") for name, tensor in
               load_file(file).items()}
    bias = written["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    assert all(torch.equal(written[name], tensor) for name, tensor in model.state_dict().items())


def test_qwen3_next_writer_refuses_kimi_moe_layers():
    from hybrid_linear_models.conversion import ConversionError
    from hybrid_linear_models.conversion.qwen3_next.checkpoint import qwen3_next_rows

    config = tiny_config(["gated_deltanet", "full_attention"], mlp_types=["dense", "kimi_moe"], **EXPERTS)
    with pytest.raises(ConversionError, match=r"^this model does not fit Qwen3-Next: layer 1's MLP is 'kimi_moe' "
                                              r"\(mlp_types\[1\]\), and Qwen3-Next's MLPs are"):
        qwen3_next_rows(config)


@pytest.mark.parametrize("fields, message", [
    ({"topk_group": 5}, "topk_group=5 exceeds n_group=4; a token keeps at most every group: lower topk_group."),
    ({"n_group": 3}, "n_group=3 does not divide num_experts=8; the experts form n_group equal groups: choose an "
                     "n_group that divides num_experts."),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts of the topk_group=2 groups a token "
                                 "keeps (2 per group); lower num_experts_per_tok or raise topk_group."),
    ({"n_group": 8, "topk_group": 4}, "n_group=8 leaves 1 expert per group, and a group's score is the sum of its best "
                                      "2: use at most num_experts / 2 = 4 groups (or topk_group = n_group)."),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor must be in (0.0, inf), got -1.0."),
    ({"n_shared_experts": -1}, "n_shared_experts must be a positive integer or 0 (none), got -1."),
    ({"n_group": 0}, "n_group must be a positive integer, got 0."),
    ({"per_layer_config": {2: {"topk_group": 6}}}, "per_layer_config[2].topk_group=6 exceeds n_group=4; a token "
                                                    "keeps at most every group: lower topk_group."),
])
def test_bad_config_names_the_field(fields, message):
    # one line, the whole message: the field, the problem and the fix
    with pytest.raises(ValueError) as error:
        tiny_config(LAYERS, **{**MOE, "mlp_types": MLPS, **fields})
    assert str(error.value) == f"Invalid HybridLinearConfig: {message}"


@pytest.mark.slow  # two torchrun ranks importing torch and transformers: ~25 s of CPU, most of it start-up
def test_tensor_parallel_plan_shards_the_experts(tmp_path):
    """2 ranks over gloo (as tests/test_sparse_moe_distributed.py): transformers' plan for the kimi_moe layers (experts
    split along their width, summed by "moe_tp_experts"; shared experts colwise / rowwise; router and its bias
    replicated) reproduces the unsharded model; the check script asserts each rank holds half of every expert."""
    model = kimi_moe_model(dtype=torch.float32, mlp_types=["kimi_moe", "dense", "kimi_moe", "kimi_moe"])
    model.save_pretrained(tmp_path)
    out = run_script("tensor_parallel_check.py", tmp_path, ranks=2)
    logits, gradients = (float(x) for x in reported(out, "MAX_DIFFERENCE"))
    # float32; the experts' and MLPs' row-parallel sums are split over 2 ranks, as for the sparse MoE (measured there
    # 2.3e-5 / 5.2e-5); the routing is replicated, so no choice differs
    assert logits <= 1e-4 and gradients <= 1e-4


# ------------------------------------------------------------------------------------ on a GPU (the lead runs these)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_DIMS = dict(gdn_value_head_dim=16, gdn_key_head_dim=16, kda_head_dim=16, head_dim=16)  # fla's smallest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@needs_cuda
def test_experts_implementations_agree_on_cuda(dtype):
    model = kimi_moe_model(dtype=torch.float32, **GPU_DIMS).to("cuda", dtype)
    block = model.model.layers[1].mlp
    x = torch.randn(3, 50, model.config.hidden_size, device="cuda", dtype=dtype)
    outputs = {}
    for implementation in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = block(x).float()
    # one router (the same routing), GEMMs summed in other orders: float32 ~1e-6 (TF32 off by default), bf16 a few
    # ulps of 2^-8 on outputs rounded once per GEMM (as the sparse MoE's GPU test)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for implementation, out in outputs.items():
        assert_close(out, outputs["eager"], tol, implementation)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm_gather", "grouped_mm"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decoding_matches_eager_decoding(implementation):
    """Capture refuses any host synchronisation, so a captured step proves the kimi_moe routing has none (the eager
    experts loop is swapped for grouped_mm_gather inside the step); the replays route each new token afresh."""
    model = kimi_moe_model(dtype=torch.float32, **GPU_DIMS).cuda()
    model.set_experts_implementation(implementation)
    input_ids = torch.randint(1, 128, (3, 40), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                  pad_token_id=0, cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    graphed = model.generate(input_ids, **kwargs)
    assert model._graph_decoder.last_graph is not None  # the graph path ran
    assert model.config._experts_implementation == implementation  # restored after the capture
    model.set_cuda_graph_decoding(False)
    eager = model.generate(input_ids, **kwargs)
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.scores, eager.scores):  # TF32 matmuls may differ between the two paths' shapes: 1e-3
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


# ------------------------------------------------------------------------------------------------ the CPU speed paths

def test_group_score_by_two_maxes_equals_topk_two():
    # the router's group score (a max, a one-element mask, a second max) against topk(2).values.sum: the same floats,
    # ties included (small integers make repeated maxima and repeated runner-ups common), so torch.equal
    from hybrid_linear_models.mlp_kimi_moe import _sum_of_two_largest

    generator = torch.Generator().manual_seed(3)
    grouped = torch.randint(0, 4, (64, 4, 6), generator=generator).float()
    grouped[0, 0] = 2.0  # a group that is all one value
    grouped = torch.cat([grouped, torch.randn(64, 4, 6, generator=generator)])
    assert torch.equal(_sum_of_two_largest(grouped), grouped.topk(2, dim=-1).values.sum(-1))

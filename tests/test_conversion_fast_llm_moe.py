"""Fast-LLM's MoE MLP (`mlp.type: moe`) against our sparse MoE (Qwen3-Next's): the weight layout converters, the math
they must preserve, and the config reader's mapping and refusals (conversion/fast_llm/mlp_moe.py).

The math reference is written here from Fast-LLM's MixtureOfExpertMLP (top-k of the logits, softmax over the selected
logits in float32, each expert's rows of the stacked `layer_1` [gate | up] and of the transposed `layer_2`), and is
compared with transformers' own Qwen3NextSparseMoeBlock fed the converted weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from hybrid_linear_models.conversion.errors import ConversionError
from hybrid_linear_models.conversion.fast_llm.metadata_fields import MetadataFields
from hybrid_linear_models.conversion.fast_llm.mlp_moe import StackedExperts, read

E, K, WIDTH, H = 5, 2, 6, 16


def _fast_llm_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"layer_1": torch.randn(E * 2 * WIDTH, H, generator=generator, dtype=torch.float64) * 0.3,
            "layer_2": torch.randn(E * WIDTH, H, generator=generator, dtype=torch.float64) * 0.3,
            "router": torch.randn(E, H, generator=generator, dtype=torch.float64)}


def _fast_llm_moe(x: torch.Tensor, weights: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """Fast-LLM's top-k MoE (mixture_of_experts.py `_topk_routing` and `mlp_autograd_looped`), per token."""
    logits = x @ weights["router"].t()
    top_logits, top_experts = torch.topk(logits, k=k, dim=-1)
    scores = torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
    layer_1 = weights["layer_1"].chunk(E)  # expert e: rows [gate (WIDTH) | up (WIDTH)]
    layer_2 = weights["layer_2"].chunk(E)  # expert e: its down projection, transposed (WIDTH, H)
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(k):
            expert = int(top_experts[token, slot])
            gate, up = (layer_1[expert] @ x[token]).chunk(2)
            out[token] += scores[token, slot] * (layer_2[expert].t() @ (F.silu(gate) * up))
    return out


def test_stacked_experts_convert_both_ways_bit_exact():
    weights = _fast_llm_weights()
    layer_1, layer_2 = StackedExperts(transposed=False, experts=E), StackedExperts(transposed=True, experts=E)
    gate_up, = layer_1.forward([weights["layer_1"]])
    down, = layer_2.forward([weights["layer_2"]])
    assert gate_up.shape == (E, 2 * WIDTH, H) and down.shape == (E, H, WIDTH)
    assert layer_1.forward_shapes([(E * 2 * WIDTH, H)]) == [(E, 2 * WIDTH, H)]
    assert layer_2.forward_shapes([(E * WIDTH, H)]) == [(E, H, WIDTH)]
    assert layer_2.inverse_shapes([(E, H, WIDTH)]) == [(E * WIDTH, H)]
    assert torch.equal(down[3], weights["layer_2"][3 * WIDTH:4 * WIDTH].t())  # expert 3, transposed
    assert torch.equal(gate_up[2, :WIDTH], weights["layer_1"][4 * WIDTH:5 * WIDTH])  # expert 2: its gate rows
    assert torch.equal(layer_1.inverse([gate_up])[0], weights["layer_1"])
    assert torch.equal(layer_2.inverse([down])[0], weights["layer_2"])
    with pytest.raises(ConversionError, match="does not split into 5 experts"):
        layer_1.forward_shapes([(E * 2 * WIDTH + 1, H)])


@pytest.mark.parametrize("k", [1, K])
def test_fast_llm_top_k_routing_is_qwen3_next_with_normalised_top_k(k):
    weights = _fast_llm_weights()
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    config = Qwen3NextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=WIDTH,
                             shared_expert_intermediate_size=4, norm_topk_prob=True, hidden_act="silu")
    config._experts_implementation = "eager"
    block = Qwen3NextSparseMoeBlock(config).double()
    with torch.no_grad():
        block.gate.weight.copy_(weights["router"])
        block.experts.gate_up_proj.copy_(StackedExperts(False, E).forward([weights["layer_1"]])[0])
        block.experts.down_proj.copy_(StackedExperts(True, E).forward([weights["layer_2"]])[0])
        block.shared_expert.down_proj.weight.zero_()  # no shared expert: sigmoid(gate) * 0 = 0
        ours = block(x[None])[0]
        normalised = ours.clone()
        block.gate.norm_topk_prob = False
        unnormalised = block(x[None])[0]
    reference = _fast_llm_moe(x, weights, k)
    # float64 weights and inputs; the routing weights pass through float32 in both (Fast-LLM's softmax over the top
    # logits, Qwen3-Next's softmax over all then division), so they agree to float32 rounding of the weights
    # (measured 6e-8 with k = 2, 7e-16 with k = 1 where both weights are exactly 1) on outputs of size ~2
    torch.testing.assert_close(normalised, reference, rtol=1e-6, atol=1e-6)
    assert reference.abs().max() > 0.1
    if k > 1:  # negative control: without the normalisation the weights are p_j, not p_j / sum(p)
        assert (unnormalised - reference).abs().max() > 1e-2


BLOCK = "config.base_model.decoder.blocks.moe.mlp"
_MOE = {"type": "moe", "experts": 8, "experts_per_token": 2, "intermediate_size": 32, "gated": True,
        "add_linear_biases": False, "auxiliary_loss_coefficient": 0.01, "z_loss_coefficient": 0.001,
        "jitter_eps": 0.01, "implementation": "dropless", "router": {"weight": {"initialization": {"type": "normal"}}}}


def test_the_moe_config_maps_to_our_sparse_moe_fields():
    fields = read(MetadataFields(dict(_MOE), BLOCK))
    assert fields == {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "shared_expert_intermediate_size": 0, "norm_topk_prob": True, "hidden_act": "silu"}


@pytest.mark.parametrize("edit, fragments", [
    ({"shared_experts": 1}, ("blocks.moe.mlp.shared_experts = 1 is not supported", "ungated")),
    ({"routing": "sinkhorn"}, ("blocks.moe.mlp.routing = 'sinkhorn' is not supported",)),
    ({"gated": False}, ("blocks.moe.mlp.gated = False",)),
    ({"add_linear_biases": None}, ("blocks.moe.mlp.add_linear_biases = True", "set it to false")),
    ({"layer_2": {"bias": {"enabled": True}}}, ("blocks.moe.mlp.layer_2.bias.enabled = True",)),
    ({"router_normalization": {"type": "rms_norm"}}, ("blocks.moe.mlp.router_normalization",)),
    ({"router_input_scale": 0.25}, ("blocks.moe.mlp.router_input_scale = 0.25",)),
    ({"router_scale": {"enabled": True}}, ("blocks.moe.mlp.router_scale.enabled = True",)),
    ({"router_per_expert_scale": {"enabled": True}}, ("blocks.moe.mlp.router_per_expert_scale.enabled",)),
    ({"pre_norm": {"type": "rms_norm"}}, ("blocks.moe.mlp.pre_norm",)),
    ({"experts_per_token": 9}, ("blocks.moe.mlp.experts_per_token is 9, more than the 8 experts",)),
    ({"intermediate_size": None}, ("does not give config.base_model.decoder.blocks.moe.mlp.intermediate_size",)),
    ({"router": {"bias": {"enabled": True}}}, ("blocks.moe.mlp.router.bias",)),
])
def test_moe_settings_ours_cannot_express_are_refused_naming_block_and_field(edit, fragments):
    mlp = {**_MOE, **edit}
    mlp = {key: value for key, value in mlp.items() if value is not None}
    with pytest.raises(ConversionError) as caught:
        read(MetadataFields(mlp, BLOCK))
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize("record, layer", [
    ("dense", {"intermediate_size": 48, "hidden_act": "gelu_pytorch_tanh", "mlp_bias": True}),
    ("sparse_moe", {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 12,
                    "shared_expert_intermediate_size": 0, "norm_topk_prob": True, "hidden_act": "relu2"}),
])
def test_each_fast_llm_mlp_record_reads_back_what_it_writes(record, layer):
    """Each Fast-LLM MLP is one record (mlps.py): its writer's mlp config, read by its reader, gives back every field
    it carries."""
    from types import SimpleNamespace

    from hybrid_linear_models.conversion.fast_llm.mlp_dense import DENSE_MLP
    from hybrid_linear_models.conversion.fast_llm.mlp_moe import SPARSE_MOE_MLP

    mlp = {"dense": DENSE_MLP, "sparse_moe": SPARSE_MOE_MLP}[record]
    settings = SimpleNamespace(**layer)
    assert mlp.unsupported(settings) == []
    written = mlp.write(settings)
    assert written["type"] == mlp.type_name
    assert mlp.read(MetadataFields(written, BLOCK)) == layer
    assert set(mlp.field_sources) <= set(layer)


def test_what_fast_llm_moe_cannot_express_is_refused_when_writing():
    from types import SimpleNamespace

    from hybrid_linear_models.conversion.fast_llm.mlp_moe import unsupported

    layer = SimpleNamespace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, hidden_act="silu",
                            shared_expert_intermediate_size=16, norm_topk_prob=False)
    problems = unsupported(layer)
    assert any("norm_topk_prob=False" in p for p in problems)
    assert any("shared_expert_intermediate_size=16" in p and "sigmoid-gated" in p for p in problems)

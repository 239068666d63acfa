"""Fast-LLM's MoE MLP (`mlp.type: moe`) against our sparse MoE (Qwen3-Next's): the weight layout converters, the math
they must preserve, the config reader's mapping and refusals (conversion/fast_llm/mlp_moe.py), and whole checkpoints
with MoE blocks laid out as Fast-LLM writes them (fast_llm_layout.py), both formats, both ways.

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


def _fast_llm_moe(x: torch.Tensor, weights: dict[str, torch.Tensor], k: int, experts: int = E,
                  activation=F.silu) -> torch.Tensor:
    """Fast-LLM's top-k MoE (mixture_of_experts.py `_topk_routing` and `mlp_autograd_looped`), per token."""
    logits = x @ weights["router"].t()
    top_logits, top_experts = torch.topk(logits, k=k, dim=-1)
    scores = torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
    layer_1 = weights["layer_1"].chunk(experts)  # expert e: rows [gate | up]
    layer_2 = weights["layer_2"].chunk(experts)  # expert e: its down projection, transposed (width, H)
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(k):
            expert = int(top_experts[token, slot])
            gate, up = (layer_1[expert] @ x[token]).chunk(2)
            out[token] += scores[token, slot] * (layer_2[expert].t() @ (activation(gate) * up))
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


# ------------------------------------------------------------------------ whole checkpoints with MoE blocks


def _moe_blocks() -> dict:
    """The heterogeneous blocks of fast_llm_layout plus two MoE blocks of different expert settings, in Fast-LLM's
    config shape (MoEMLPConfig: add_linear_biases false, as Fast-LLM's MoE asserts)."""
    import copy

    from fast_llm_layout import heterogeneous_blocks

    blocks = heterogeneous_blocks()
    gdn_moe, kda_moe = copy.deepcopy(blocks["gdn"]), copy.deepcopy(blocks["kda"])
    gdn_moe["mlp"] = {"type": "moe", "experts": 4, "experts_per_token": 2, "intermediate_size": 16, "gated": True,
                      "add_linear_biases": False, "auxiliary_loss_coefficient": 0.01}
    kda_moe["mlp"] = {"type": "moe", "experts": 3, "intermediate_size": 24, "gated": True, "activation": "gelu",
                      "add_linear_biases": False}  # experts_per_token: Fast-LLM's default, 1
    return {**blocks, "gdn_moe": gdn_moe, "kda_moe": kda_moe}


MOE_PATTERN = ["attn", "gdn_moe", "sliding", "kda_moe", "gdn_moe"]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from fast_llm_layout import converted_pattern_checkpoint

    root, blocks = tmp_path_factory.mktemp("moe"), _moe_blocks()
    return root, blocks, converted_pattern_checkpoint(root, blocks, MOE_PATTERN)


class _FastLlmMoeReference(torch.nn.Module):
    """A block's MLP computed from the Fast-LLM tensors themselves with Fast-LLM's math (`_fast_llm_moe`)."""

    def __init__(self, tensors: dict, index: int, experts: int, k: int, activation):
        super().__init__()
        self.weights = {name: tensors[f"decoder.{index}.mlp.{name}.weight"] for name in ("layer_1", "layer_2",
                                                                                         "router")}
        self.experts, self.k, self.activation = experts, k, activation

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        return _fast_llm_moe(flat, self.weights, self.k, self.experts, self.activation).reshape(x.shape)


def test_moe_blocks_convert_with_fast_llm_logits(moe_checkpoint):
    """Each converted MoE layer equals Fast-LLM's MoE math run on the checkpoint's own tensors: the model's logits with
    its MoE MLPs replaced by that reference are its logits."""
    from fast_llm_layout import VOCAB

    from hybrid_linear_models import HybridLinearForCausalLM

    root, blocks, tensors = moe_checkpoint
    model = HybridLinearForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32).eval()
    config = model.config
    assert config.mlp_types == ["dense", "sparse_moe", "dense", "sparse_moe", "sparse_moe"]
    layers = config.per_layer_config
    assert [(layers[i].num_experts, layers[i].num_experts_per_tok, layers[i].moe_intermediate_size)
            for i in (1, 3, 4)] == [(4, 2, 16), (3, 1, 24), (4, 2, 16)]
    assert all(layers[i].shared_expert_intermediate_size == 0 and layers[i].norm_topk_prob for i in (1, 3, 4))
    assert layers[3].hidden_act == "gelu_pytorch_tanh" and layers[1].hidden_act == "silu"
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids).logits
        for index in (1, 3, 4):
            mlp = blocks[MOE_PATTERN[index]]["mlp"]
            activation = torch.nn.functional.silu if mlp.get("activation", "silu") == "silu" else (
                lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
            model.model.layers[index].mlp = _FastLlmMoeReference(tensors, index, mlp["experts"],
                                                                 mlp.get("experts_per_token", 1), activation)
        reference = model(input_ids).logits
    # float32; the routing weights are rounded differently (Fast-LLM: softmax over the top logits; ours: softmax over
    # all, then divided by the top-k sum), ~1e-7 relative, and the experts' sums run in another order: measured 5e-7
    # (gate and up rows swapped in the reference: 6e-2)
    assert (logits - reference).abs().max().item() <= 1e-4
    assert logits.abs().max().item() > 0.1


def test_moe_round_trips_are_bit_exact_and_distributed_reads_the_same(moe_checkpoint, tmp_path):
    from pathlib import Path

    import yaml
    from safetensors import safe_open
    from safetensors.torch import load_file

    from hybrid_linear_models.conversion import convert_checkpoint

    root, _, tensors = moe_checkpoint
    back = Path(convert_checkpoint(root / "hf", tmp_path / "back", from_format="hf", to_format="fast_llm").destination)
    stored = {}
    for file in back.glob("*.safetensors"):
        with safe_open(file, "pt") as opened:
            stored.update({key.removesuffix("/weights"): opened.get_tensor(key) for key in opened.keys()})
    assert stored.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(stored[name], tensor), name
    blocks = yaml.safe_load((back / "metadata.yaml").read_text())["config"]["base_model"]["decoder"]["blocks"]
    moe = [block["mlp"] for block in blocks.values() if block["mlp"]["type"] == "moe"]
    assert sorted((m["experts"], m["experts_per_token"], m["intermediate_size"]) for m in moe) == [(3, 1, 24),
                                                                                                  (4, 2, 16)]
    # the distributed layout (router sorted before layer_1 and layer_2 in each MoE block's stage) reads the same
    convert_checkpoint(root / "distributed", tmp_path / "from_distributed", from_format="fast_llm_distributed",
                       to_format="hf")
    first = {}
    for folder in (root / "hf", tmp_path / "from_distributed"):
        loaded = {}
        for file in folder.glob("*.safetensors"):
            loaded.update(load_file(file))
        first = first or loaded
        assert loaded.keys() == first.keys() and all(torch.equal(loaded[k], first[k]) for k in first)


def test_the_moe_stage_order_is_pinned(moe_checkpoint, tmp_path):
    """Negative control: the router (weight decay, not tensor-parallel) sorts before layer_1 and layer_2; a buffer in
    plain definition order reads other tensors into the experts."""
    from fast_llm_layout import pattern_decoder, write_fast_llm_checkpoint
    from safetensors.torch import load_file

    from hybrid_linear_models.conversion import convert_checkpoint

    root, blocks, tensors = moe_checkpoint
    decoder = pattern_decoder(blocks, MOE_PATTERN)
    write_fast_llm_checkpoint(tmp_path / "unsorted", blocks, MOE_PATTERN, decoder, tensors, sort_stages=False)
    convert_checkpoint(tmp_path / "unsorted" / "distributed", tmp_path / "hf", from_format="fast_llm_distributed",
                       to_format="hf")
    wrong, right = load_file(tmp_path / "hf" / "model.safetensors"), load_file(root / "hf" / "model.safetensors")
    assert not torch.equal(wrong["model.layers.1.mlp.gate.weight"], right["model.layers.1.mlp.gate.weight"])


def test_what_fast_llm_moe_cannot_express_is_refused_naming_the_layer():
    from model_helpers import tiny_config

    from hybrid_linear_models.conversion.fast_llm.config import hybrid_config_to_fast_llm

    config = tiny_config(["gated_deltanet", "gated_deltanet"], mlp_types=["dense", "sparse_moe"], num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                         zero_centered_norms=False, per_layer_config={1: {"norm_topk_prob": False}})
    with pytest.raises(ConversionError) as caught:
        hybrid_config_to_fast_llm(config)
    message = str(caught.value)
    assert "layer 1 (gated_deltanet): norm_topk_prob=False" in message, message
    assert "layer 1 (gated_deltanet): shared_expert_intermediate_size=16" in message, message

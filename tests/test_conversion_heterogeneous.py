"""Fast-LLM pattern decoders whose blocks differ, on checkpoints laid out as Fast-LLM writes them.

The checkpoints come from `fast_llm_layout.py`: the real fixture's metadata (written by Fast-LLM) with blocks added
in Fast-LLM's own config shape: a sliding-window block with fewer KV groups, other rotary theta and attention biases; a
second, narrower GDN block with another conv size, norm epsilon, MLP size and MLP biases; a KDA block with a gelu MLP.
The tensors are random, with the shapes of Fast-LLM's parameter definitions, in the `fast_llm` and the `distributed`
layouts.

The logits reference is composed layer by layer from homogeneous one-block models: each block alone, as a
`decoder.type: fixed` Fast-LLM checkpoint with the same weights, converted by the homogeneous path that the real
fixtures pin against Fast-LLM's own logits.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from fast_llm_layout import (
    FIXTURE,
    PATTERN,
    VOCAB,
    converted_pattern_checkpoint,
    heterogeneous_blocks,
    pattern_decoder,
    write_fast_llm_checkpoint,
)
from safetensors import safe_open
from safetensors.torch import load_file

import hybrid_linear_models  # noqa: F401
from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.fast_llm.config import fast_llm_to_hybrid_config

@pytest.fixture(scope="module")
def heterogeneous(tmp_path_factory) -> tuple[Path, dict, dict]:
    root, blocks = tmp_path_factory.mktemp("heterogeneous"), heterogeneous_blocks()
    return root, blocks, converted_pattern_checkpoint(root, blocks, PATTERN)


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_blocks_that_differ_become_defaults_plus_per_layer_overrides(heterogeneous):
    root, _, _ = heterogeneous
    model = HybridLinearForCausalLM.from_pretrained(root / "hf")
    config = model.config
    assert config.mixer_types == ["full_attention", "sliding_attention", "gated_deltanet", "kimi_delta_attention",
                                  "gated_deltanet", "sliding_attention"]
    layers = config.per_layer_config
    assert [layers[i].num_key_value_heads for i in (0, 1, 5)] == [2, 1, 1]
    assert layers[1].sliding_window == 3 and layers[1].attention_bias and not layers[0].attention_bias
    assert layers[1].rope_parameters["rope_theta"] == 500.0 and layers[0].rope_parameters["rope_theta"] == 10000.0
    assert (layers[2].gdn_num_value_heads, layers[4].gdn_num_value_heads) == (4, 2)
    assert (layers[4].gdn_value_head_dim, layers[4].gdn_conv_kernel_size, layers[4].gdn_norm_eps) == (24, 3, 1e-6)
    assert [layers[i].intermediate_size for i in range(6)] == [48, 32, 48, 48, 80, 32]
    assert layers[4].mlp_bias and not layers[2].mlp_bias and layers[3].hidden_act == "gelu_pytorch_tanh"
    assert (layers[4].rms_norm_eps, layers[2].rms_norm_eps) == (1e-6, 1e-5)
    # the converted tensors are exactly the model's own parameters, names and shapes
    stored = _hf_tensors(root / "hf")
    assert {k: tuple(v.shape) for k, v in stored.items()} == {k: tuple(v.shape) for k, v in
                                                             model.state_dict().items()}


def _one_block_model(root: Path, blocks: dict, name: str, index: int, tensors: dict) -> HybridLinearForCausalLM:
    """Block `index` alone, as a `fixed` one-block Fast-LLM checkpoint with its weights, converted and loaded."""
    prefix = f"decoder.{index}."
    alone = {k.replace(prefix, "decoder.0.", 1): v for k, v in tensors.items()
             if k.startswith(prefix) or not k.startswith("decoder.")}
    folder = root / f"alone_{index}"
    write_fast_llm_checkpoint(folder, blocks, [name], {"type": "fixed", "block": blocks[name], "num_blocks": 1},
                              alone)
    convert_checkpoint(folder / "fast_llm", folder / "hf", from_format="fast_llm", to_format="hf")
    return HybridLinearForCausalLM.from_pretrained(folder / "hf", torch_dtype=torch.float32).eval()


def test_logits_equal_a_composition_of_homogeneous_one_block_models(heterogeneous, tmp_path):
    root, blocks, tensors = heterogeneous
    model = HybridLinearForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32).eval()
    input_ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    alone = [_one_block_model(tmp_path, blocks, name, i, tensors) for i, name in enumerate(PATTERN)]
    with torch.no_grad():
        logits = model(input_ids).logits
        hidden = alone[0].model.embed_tokens(input_ids)
        for one in alone:
            one.model.norm = torch.nn.Identity()  # the block's output itself
            hidden = one.model(inputs_embeds=hidden).last_hidden_state
        reference = model.lm_head(model.model.norm(hidden))
    # float32, the same kernels on the same shapes layer by layer (measured: 0.0); 1e-4 is the bound
    assert (logits - reference).abs().max().item() <= 1e-4
    assert logits.abs().max().item() > 0.1  # not trivially zero


def test_distributed_reads_the_same_tensors_as_fast_llm(heterogeneous, tmp_path):
    root, _, _ = heterogeneous
    convert_checkpoint(root / "distributed", tmp_path / "hf", from_format="fast_llm_distributed", to_format="hf")
    from_distributed, from_fast_llm = _hf_tensors(tmp_path / "hf"), _hf_tensors(root / "hf")
    assert from_distributed.keys() == from_fast_llm.keys()
    for name, tensor in from_fast_llm.items():
        assert torch.equal(from_distributed[name], tensor), name


def test_the_distributed_order_is_pinned(heterogeneous, tmp_path):
    """Negative control: a buffer laid out in plain definition order (no sort) reads as other tensors, so the
    comparison above really pins Fast-LLM's order for blocks of different shapes."""
    root, blocks, tensors = heterogeneous
    decoder = pattern_decoder(blocks, PATTERN)
    write_fast_llm_checkpoint(tmp_path / "unsorted", blocks, PATTERN, decoder, tensors, sort_stages=False)
    convert_checkpoint(tmp_path / "unsorted" / "distributed", tmp_path / "hf", from_format="fast_llm_distributed",
                       to_format="hf")
    wrong, right = _hf_tensors(tmp_path / "hf"), _hf_tensors(root / "hf")
    assert not torch.equal(wrong["model.layers.4.linear_attn.dt_bias"], right["model.layers.4.linear_attn.dt_bias"])


def test_round_trips_are_bit_exact(heterogeneous, tmp_path):
    root, _, tensors = heterogeneous
    back = convert_checkpoint(root / "hf", tmp_path / "fast_llm", from_format="hf", to_format="fast_llm").destination
    stored = {}
    for file in Path(back).glob("*.safetensors"):
        with safe_open(file, "pt") as opened:
            stored.update({key.removesuffix("/weights"): opened.get_tensor(key) for key in opened.keys()})
    assert stored.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(stored[name], tensor), name
    metadata = yaml.safe_load((Path(back) / "metadata.yaml").read_text())
    decoder = metadata["config"]["base_model"]["decoder"]
    assert len(decoder["blocks"]) == 5 and len(decoder["pattern"]) == 6  # one block per distinct layer setting
    again = convert_checkpoint(back, tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    first, second = _hf_tensors(root / "hf"), _hf_tensors(Path(again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    a = HybridLinearForCausalLM.from_pretrained(root / "hf").config.to_dict()
    b = HybridLinearForCausalLM.from_pretrained(again).config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        a.pop(key, None), b.pop(key, None)
    assert a == b


@pytest.mark.parametrize("edit, fragments", [
    (lambda blocks: blocks["sliding"]["mixer"].setdefault("query_layer", {}).update(bias={"enabled": False}),
     ("blocks.sliding.mixer gives its query and key layers different biases", "query_layer: no bias")),
    (lambda blocks: blocks["gdn_narrow"]["mixer"].update(value_heads=3),
     ("gdn_narrow", "value_heads")),
])
def test_what_is_refused_names_the_block_and_the_field(tmp_path, edit, fragments):
    blocks = heterogeneous_blocks()
    edit(blocks)
    decoder = pattern_decoder(blocks, PATTERN)
    # the tensors of the unedited blocks
    write_fast_llm_checkpoint(tmp_path / "src", heterogeneous_blocks(), PATTERN, decoder)
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(tmp_path / "src" / "fast_llm", tmp_path / "dst", from_format="fast_llm", to_format="hf")
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


def test_defaults_are_one_layers_setting_so_they_validate_together():
    """Heads 4/2, 3/3, 3/1: the most common value of each field alone (3 heads, 2 KV heads) is no valid setting;
    each group of related fields takes the defaults of one layer."""
    blocks = heterogeneous_blocks()
    attention = {}
    for name, heads, groups in (("a", 4, 2), ("b", 3, 3), ("c", 3, 1)):
        attention[name] = copy.deepcopy(blocks["attn"])
        attention[name]["mixer"].update(heads=heads, head_groups=groups)
    base = yaml.safe_load((FIXTURE / "fast_llm" / "metadata.yaml").read_text())["config"]["base_model"]
    base["decoder"] = {"type": "pattern", "blocks": attention, "pattern": ["a", "b", "c"], "num_blocks": 3}
    config = fast_llm_to_hybrid_config(base)
    layers = config.per_layer_config
    assert [(layers[i].num_attention_heads, layers[i].num_key_value_heads) for i in range(3)] == [(4, 2), (3, 3),
                                                                                                  (3, 1)]
    assert config.to_dict()["num_attention_heads"] % config.to_dict()["num_key_value_heads"] == 0


def test_the_layout_builds_one_meta_layer_per_distinct_setting(monkeypatch):
    """Canonical shapes come from the model built on the meta device, one layer per distinct layer setting: 300
    layers of 2 settings build 2 layers (and a one-layer model for the embeddings and head), no 300-entry list."""
    from hybrid_linear_models import HybridLinearConfig
    from hybrid_linear_models.conversion import hf_layout
    from hybrid_linear_models.modeling_hybrid_linear import HybridLinearDecoderLayer

    built = []

    class Counting(HybridLinearDecoderLayer):
        def __init__(self, config, index):
            built.append(index)
            super().__init__(config, index)

    monkeypatch.setattr("hybrid_linear_models.modeling_hybrid_linear.HybridLinearDecoderLayer", Counting)
    config = HybridLinearConfig(layer_types=["gated_deltanet"] * 300, hidden_size=32, vocab_size=16,
                                intermediate_size=8, gdn_num_key_heads=2, gdn_num_value_heads=2,
                                per_layer_config={i: {"intermediate_size": 16} for i in range(1, 300, 2)})
    shapes = hf_layout.hf_tensor_shapes(config)
    assert sorted(built) == [0, 0, 1]  # layers 0 and 1, and the one-layer model's layer
    assert shapes["model.layers.299.mlp.up_proj.weight"] == (16, 32)
    assert shapes["model.layers.298.mlp.up_proj.weight"] == (8, 32)


def test_sizes_beyond_the_stored_weights_are_refused_before_any_data_is_read():
    """A config whose one layer needs 4e9 elements against a 1e6-element checkpoint: refused from meta shapes,
    naming the tensor, without allocating it."""
    from hybrid_linear_models import HybridLinearConfig
    from hybrid_linear_models.conversion.pipeline import TensorCensus, check_tensor_sizes

    config = HybridLinearConfig(layer_types=["kimi_delta_attention"] * 3, hidden_size=2**14, kda_num_heads=2**8,
                                kda_head_dim=2**10, vocab_size=8, intermediate_size=8,
                                per_layer_config={1: {"kda_num_heads": 2**7}})
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.linear_attn\.q_proj\.weight of shape \[262144, "
                                              r"16384\].*more than the 1000000 weight elements"):
        check_tensor_sizes(config, TensorCensus(10**6), "x")


@pytest.mark.parametrize("layer_type, settings", [
    ("full_attention", {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8, "attention_bias": True,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                            "partial_rotary_factor": 1.0}}),
    ("sliding_attention", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 7,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 1.0}}),
    ("gated_deltanet", {"gdn_num_key_heads": 2, "gdn_num_value_heads": 6, "gdn_key_head_dim": 8,
                        "gdn_value_head_dim": 12, "gdn_conv_kernel_size": 3, "gdn_norm_eps": 1e-6,
                        "gdn_gate_activation": "sigmoid"}),
    ("kimi_delta_attention", {"kda_num_heads": 3, "kda_head_dim": 8, "kda_conv_kernel_size": 2, "kda_norm_eps": 1e-4,
                              "kda_gate_activation": "sigmoid"}),
])
def test_each_fast_llm_mixer_record_reads_back_what_it_writes(layer_type, settings):
    """Each Fast-LLM mixer is one record (`mixers.py`): its writer's mixer config, read by its reader, gives back the
    layer type and every one of the layer's mixer fields that the reader sets (all of MIXER_FIELDS except the
    attention switches Fast-LLM's attention does not have, which are always off)."""
    from hybrid_linear_models import HybridLinearConfig
    from hybrid_linear_models.configuration_hybrid_linear import MIXER_FIELDS
    from hybrid_linear_models.conversion.fast_llm.metadata_fields import MetadataFields
    from hybrid_linear_models.conversion.fast_llm.mixers import FAST_LLM_MIXERS, mixer_of_layer_type

    config = HybridLinearConfig(layer_types=[layer_type], hidden_size=32, vocab_size=16, intermediate_size=8,
                                attention_output_gate=False, attention_qk_norm=False, **settings)
    layer = config.per_layer_config[0]
    record = mixer_of_layer_type(layer_type)
    written = record.write(layer, layer_type)
    assert FAST_LLM_MIXERS[written["type"]] is record
    read_type, read = record.read(MetadataFields(written, "mixer"))
    assert read_type == layer_type
    assert set(read) <= set(MIXER_FIELDS[layer_type])
    assert set(MIXER_FIELDS[layer_type]) - set(read) <= {"attention_output_gate", "attention_qk_norm",
                                                         "sliding_window"}
    assert read == {field: getattr(layer, field) for field in read}
    assert {field: read[field] for field in settings} == settings  # the non-default values themselves


def _set(path: tuple[str, ...], value):
    def edit(blocks: dict) -> None:
        node = blocks
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return edit


_GDN_LAYERS = ("qkv_projection_layer", "ba_projection_layer", "output_layer", "convolution_layer")
_KDA_LAYERS = tuple(f"{n}_projection_layer" for n in ("q", "k", "v", "f_a", "f_b", "g_a", "g_b", "beta", "output")
                    ) + ("convolution_layer",)
_REFUSALS = [
    # Fast-LLM's GDN and KDA layers may have biases (AffineLinearConfig `bias.enabled`); ours have none
    *[(_set(("gdn_narrow", "mixer", layer, "bias", "enabled"), True),
       (f"blocks.gdn_narrow.mixer.{layer} has a bias", f"blocks.gdn_narrow.mixer.{layer}.bias.enabled is true"))
      for layer in _GDN_LAYERS],
    *[(_set(("kda", "mixer", layer, "bias", "enabled"), True),
       (f"blocks.kda.mixer.{layer} has a bias", f"blocks.kda.mixer.{layer}.bias.enabled is true"))
      for layer in _KDA_LAYERS],
    # Fast-LLM's GDN mixer has no add_linear_biases: an unknown field, named
    (_set(("gdn", "mixer", "add_linear_biases"), True), ("blocks.gdn.mixer.add_linear_biases not supported",)),
    # attention biases per linear layer: our attention_bias switches q, k and v together (the dense layer has its
    # own switch, attention_output_bias: tests/test_attention_biases.py)
    (_set(("attn", "mixer", "query_layer", "bias", "enabled"), True),
     ("blocks.attn.mixer gives its query and key layers different biases", "query_layer: bias",
      "attention_bias")),
    (_set(("sliding", "mixer", "key_layer", "bias", "enabled"), False),
     ("blocks.sliding.mixer gives its query and key layers different biases", "key_layer: no bias")),
    (_set(("gdn", "mlp", "layer_2", "bias", "enabled"), True),
     ("blocks.gdn.mlp mixes linear layers with and without biases", "layer_2: bias", "mlp_bias")),
    # invalid head counts in the block the flat defaults come from, and in a block that is a per-layer override
    (_set(("gdn", "mixer", "value_heads"), 3),
     ("Fast-LLM block config.base_model.decoder.blocks.gdn (layer 2)", "blocks.gdn.mixer.value_heads",
      "blocks.gdn.mixer.key_heads")),
    (_set(("sliding", "mixer", "head_groups"), 3),
     ("Fast-LLM block config.base_model.decoder.blocks.sliding (layer 1)", "blocks.sliding.mixer.head_groups")),
    (_set(("gdn_narrow", "mixer", "value_heads"), 3),
     ("Fast-LLM block config.base_model.decoder.blocks.gdn_narrow (layer 4)", "blocks.gdn_narrow.mixer.value_heads")),
    (_set(("kda", "mlp", "type"), "hybrid_moe"), ("blocks.kda.mlp.type = 'hybrid_moe' is not supported",)),
    (lambda blocks: blocks["kda"]["mlp"].update(type="moe", experts=4, shared_experts=1, add_linear_biases=False),
     ("blocks.kda.mlp.shared_experts = 1 is not supported", "ungated")),
    (_set(("attn", "mixer", "query_norm"), {"type": "rms_norm"}), ("blocks.attn.mixer.query_norm",)),
]


@pytest.mark.parametrize("edit, fragments", _REFUSALS)
def test_every_refusal_names_the_fast_llm_block_and_field(edit, fragments):
    blocks = heterogeneous_blocks()
    edit(blocks)
    base = yaml.safe_load((FIXTURE / "fast_llm" / "metadata.yaml").read_text())["config"]["base_model"]
    base["decoder"] = pattern_decoder(blocks, PATTERN)
    with pytest.raises(ConversionError) as caught:
        fast_llm_to_hybrid_config(base)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("block, edit, fragments", [
    ("gdn_narrow", {"key_heads": 1, "value_heads": 2}, ("blocks.gdn_narrow (layer 4)", "mixer.key_heads")),
    ("kda", {"heads": 1}, ("blocks.kda (layer 3)", "mixer.heads is 1")),
])
def test_unverified_distributed_layouts_name_the_block_and_field(tmp_path, block, edit, fragments):
    blocks = heterogeneous_blocks()
    blocks[block]["mixer"].update(edit)
    decoder = pattern_decoder(blocks, PATTERN)
    write_fast_llm_checkpoint(tmp_path, blocks, PATTERN, decoder)
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(tmp_path / "distributed", tmp_path / "hf", from_format="fast_llm_distributed",
                           to_format="hf")
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)

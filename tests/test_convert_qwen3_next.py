"""The qwen3_next format: folders written by transformers' own Qwen3NextForCausalLM.save_pretrained (random
tiny models) convert to our format with the logits and greedy tokens of transformers' model, back bit for bit, and our
models that fit Qwen3-Next convert to folders transformers loads with our logits; those that do not fit are refused
by the first layer or setting.

Tolerance: logits within 1e-4 (float32, logits of order 1). Both models compute the same math in float32 through
different kernels (transformers' reference chunked delta rule and its attention vs our chunked kernel and sdpa), so
they differ only by summation order: ~1e-7 per op (float32 eps 1.2e-7), a few ops deep in 3-4 layers; measured
differences are below 1e-6. A mapping mistake (a norm taken as w instead of 1 + w, a permuted head, a swapped gate
and up) moves logits by 1e-2 or more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import randomize, tiny_model
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.converters import StackedExperts
from hybrid_linear_models.conversion.extra_tensors import EXTRA_TENSORS_FILE
from hybrid_linear_models.conversion.formats import FORMATS
from hybrid_linear_models.conversion.qwen3_next.checkpoint import qwen3_next_rows
from hybrid_linear_models.conversion.qwen3_next.config import (
    IRRELEVANT,
    QWEN3_NEXT_DEFAULTS,
    qwen3_next_to_hybrid_config,
)
from hybrid_linear_models.conversion.safetensors_io import SafetensorsFile, write_files, plan_files, TensorInfo

LOGITS_TOLERANCE = 1e-4  # see the module docstring


def tiny_qwen3_next_config(**overrides) -> Qwen3NextConfig:
    settings = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0, max_position_embeddings=256)
    settings.update(overrides)
    return Qwen3NextConfig(**settings)


def save_qwen3_next(folder: Path, seed: int = 0, **overrides) -> Qwen3NextForCausalLM:
    """A tiny Qwen3NextForCausalLM with random weights everywhere (norms included), saved by transformers."""
    torch.manual_seed(seed)
    model = randomize(Qwen3NextForCausalLM(tiny_qwen3_next_config(**overrides)), seed).eval()
    model.save_pretrained(folder)
    return model


def tensors_of(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """Every tensor of every safetensors file in `folder`: dtype, shape and raw bytes."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        file = SafetensorsFile(path)
        for key in file.keys():
            tensor = file.read(key)
            found[key] = (tensor.dtype, tuple(tensor.shape), tensor.contiguous().view(-1).view(torch.uint8)
                          .numpy().tobytes())
    return found


def assert_same_predictions(theirs: torch.nn.Module, ours: torch.nn.Module, vocab: int) -> None:
    """Logits within LOGITS_TOLERANCE over a batch without padding, and the same 4 greedy tokens (cached
    decoding)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (2, 13), generator=generator)  # no 0: generate would take it for padding
    with torch.no_grad():
        expected, got = theirs(tokens).logits, ours(tokens).logits
        difference = (expected - got).abs().max().item()
        assert difference <= LOGITS_TOLERANCE, difference
        assert expected.abs().max() > 0.1  # logits of a real size: the comparison means something
        greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(tokens))
        assert torch.equal(theirs.generate(tokens, **greedy), ours.generate(tokens, **greedy))


# --------------------------------------------------------------------------------------------- qwen3_next -> hf

DENSE_CASES = {
    # every layer dense through mlp_only_layers (num_experts > 0 but unused), 2 value heads per key head
    "mlp_only_layers": dict(num_experts=4, mlp_only_layers=[0, 1, 2, 3], num_experts_per_tok=2,
                            moe_intermediate_size=16),
    # num_experts 0, 1 value head per key head, dk != dv, kernel 3, tied, other eps and rotary fraction, biases
    "ratio_1": dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
                    linear_conv_kernel_dim=3, tie_word_embeddings=True, rms_norm_eps=1e-5, attention_bias=True,
                    partial_rotary_factor=0.5, rope_theta=5000.0),
    # 4 value heads per key head, attention first and last
    "ratio_4": dict(linear_num_key_heads=1, linear_num_value_heads=4,
                    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_dense_qwen3_next_converts_with_transformers_logits(tmp_path, case):
    theirs = save_qwen3_next(tmp_path / "qwen3_next", **DENSE_CASES[case])
    convert_checkpoint(tmp_path / "qwen3_next", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert_same_predictions(theirs, ours.eval(), theirs.config.vocab_size)


def test_round_trip_is_bit_identical(tmp_path):
    """qwen3_next -> hf -> qwen3_next: the same tensors byte for byte, a config transformers reads as the source's,
    and the source's logits from transformers' own model."""
    theirs = save_qwen3_next(tmp_path / "source", **DENSE_CASES["ratio_1"])
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="qwen3_next")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "source")
    again = Qwen3NextForCausalLM.from_pretrained(tmp_path / "back").eval()
    source_config, back_config = theirs.config.to_dict(), again.config.to_dict()
    for field in ("transformers_version", "mlp_only_layers", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "_name_or_path"):  # dense either way: the expert fields describe nothing
        source_config.pop(field, None), back_config.pop(field, None)
    assert back_config == source_config
    assert_same_predictions(theirs, again, theirs.config.vocab_size)


def test_sharded_source_and_output(tmp_path):
    theirs = save_qwen3_next(tmp_path / "source", **DENSE_CASES["ratio_4"])
    shutil.rmtree(tmp_path / "source")
    theirs.save_pretrained(tmp_path / "source", max_shard_size="20KB")
    assert (tmp_path / "source" / "model.safetensors.index.json").is_file()
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="qwen3_next",
                       max_shard_size="30KB")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "source")  # the same model, bit for bit


def test_defaults_are_transformers_own():
    """An absent field means what it means to transformers' Qwen3NextConfig."""
    defaults = Qwen3NextConfig().to_dict()
    assert {name: defaults[name] for name in QWEN3_NEXT_DEFAULTS} == QWEN3_NEXT_DEFAULTS
    config, _ = qwen3_next_to_hybrid_config({"model_type": "qwen3_next", "num_hidden_layers": 8, "num_experts": 0},
                                            "config.json")
    assert config.mixer_types == ["gated_deltanet"] * 3 + ["full_attention"] + ["gated_deltanet"] * 3 + [
        "full_attention"]  # full_attention_interval 4
    assert config.rope_parameters["partial_rotary_factor"] == 0.25 and config.gdn_norm_eps == config.rms_norm_eps
    assert set(IRRELEVANT) >= {"architectures", "transformers_version", "dtype"}


# --------------------------------------------------------------------------------------------- mtp.* carried


def add_mtp_tensors(folder: Path, config_fields: dict) -> dict[str, torch.Tensor]:
    """Adds a multi-token-prediction head's tensors (as the hub layout names them) in a file of the index, and its
    config fields."""
    generator = torch.Generator().manual_seed(7)
    mtp = {"mtp.fc.weight": torch.randn(32, 64, generator=generator),
           "mtp.norm.weight": torch.randn(32, generator=generator),
           "mtp.layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=generator)}
    shard = "model-mtp.safetensors"
    plans = plan_files([(k, TensorInfo(tuple(t.shape), t.dtype)) for k, t in mtp.items()], 10**9, lambda i, n: shard)
    write_files(folder, plans, mtp.items(), {"format": "pt"})
    model = SafetensorsFile(folder / "model.safetensors")
    (folder / "model.safetensors").rename(folder / "model-main.safetensors")
    weight_map = {**dict.fromkeys(model.keys(), "model-main.safetensors"), **dict.fromkeys(mtp, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_fields}))
    return mtp


def test_mtp_tensors_survive_every_hop(tmp_path):
    """In a config that declares no MTP layers, stored mtp.* tensors ride along in extra_tensors.safetensors, which
    from_pretrained never reads (no warning, nothing unexpected), survive hf -> hf, and come back byte for byte with
    their config fields; a format that cannot keep them refuses the source by name. (A declared head becomes the
    model's own: tests/test_convert_qwen3_next_mtp.py.)"""
    theirs = save_qwen3_next(tmp_path / "source", **DENSE_CASES["mlp_only_layers"])
    fields = {"mtp_use_dedicated_embeddings": False}
    mtp = add_mtp_tensors(tmp_path / "source", fields)
    convert_checkpoint(tmp_path / "source", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    assert (tmp_path / "hf" / EXTRA_TENSORS_FILE).is_file()
    assert all(FORMATS["hf"].output.writes(path.name) for path in (tmp_path / "hf").iterdir())  # --force may replace
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_predictions(Qwen3NextForCausalLM.from_pretrained(tmp_path / "source").eval(), ours.eval(), 96)
    convert_checkpoint(tmp_path / "hf", tmp_path / "hf2", from_format="hf", to_format="hf", max_shard_size="20KB")
    assert (tmp_path / "hf2" / EXTRA_TENSORS_FILE).is_file()
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    assert not any(key.startswith("mtp.") for key in index["weight_map"])  # the model's index does not list them
    convert_checkpoint(tmp_path / "hf2", tmp_path / "back", from_format="hf", to_format="qwen3_next")
    back = tensors_of(tmp_path / "back")
    assert back == tensors_of(tmp_path / "source") and set(mtp) < set(back)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {name: config[name] for name in fields} == fields
    again, info = Qwen3NextForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"]
    assert_same_predictions(theirs, again.eval(), 96)
    # (a model built with an MTP head leaves these three tensors: they are not a whole head; see
    # test_convert_qwen3_next_mtp.py for a carried whole head, which it loads)
    with_head = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf2", num_mtp_layers=1)
    assert not torch.equal(with_head.state_dict()["mtp.fc.weight"], mtp["mtp.fc.weight"].to(torch.float32))
    with pytest.raises(ConversionError, match=r"holds 3 tensor\(s\) beside the model's \(mtp\.fc\.weight.*fast_llm"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "fast_llm", from_format="hf", to_format="fast_llm")
    assert not (tmp_path / "fast_llm").exists()


# --------------------------------------------------------------------------------------------- hf -> qwen3_next


def test_our_model_that_fits_converts_to_transformers_qwen3_next(tmp_path):
    ours = tiny_model(["gated_deltanet", "full_attention", "gated_deltanet"], rms_norm_eps=1e-5,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
    ours.save_pretrained(tmp_path / "ours")
    convert_checkpoint(tmp_path / "ours", tmp_path / "qwen3_next", from_format="hf", to_format="qwen3_next")
    assert sorted(p.name for p in (tmp_path / "qwen3_next").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    theirs, info = Qwen3NextForCausalLM.from_pretrained(tmp_path / "qwen3_next", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_predictions(theirs.eval(), ours, ours.config.vocab_size)


@pytest.mark.parametrize("layer_types, overrides, fragments", [
    (["gated_deltanet", "kimi_delta_attention"], {}, ("layer 1 is 'kimi_delta_attention'",)),
    (["sliding_attention", "gated_deltanet"], {}, ("layer 0 is 'sliding_attention'",)),
    (["gated_deltanet", "full_attention"], {"zero_centered_norms": False}, ("zero_centered_norms is False",)),
    (["gated_deltanet", "full_attention"], {"attention_output_gate": False}, ("attention_output_gate is False",)),
    (["gated_deltanet", "full_attention"], {"attention_qk_norm": False}, ("attention_qk_norm is False",)),
    (["gated_deltanet", "full_attention"], {"gdn_gate_activation": "sigmoid"}, ("gdn_gate_activation is 'sigmoid'",)),
    (["gated_deltanet", "full_attention"], {"gdn_norm_eps": 1e-3}, ("gdn_norm_eps (0.001) differs",)),
    (["gated_deltanet", "full_attention"], {"hidden_act": "gelu"}, ("hidden_act is 'gelu'",)),
    (["gated_deltanet", "full_attention"], {"mlp_bias": True}, ("mlp_bias is True",)),
    (["gated_deltanet", "full_attention", "gated_deltanet"],
     {"per_layer_config": {2: {"gdn_num_value_heads": 2}}}, ("layer 2 has its own gdn_num_value_heads",)),
])
def test_models_that_do_not_fit_are_refused_by_name(tmp_path, layer_types, overrides, fragments):
    from model_helpers import tiny_config

    config = tiny_config(layer_types, **overrides)
    with pytest.raises(ConversionError) as caught:
        qwen3_next_rows(config)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("this model does not fit Qwen3-Next: ")
    assert all(fragment in message for fragment in fragments), message
    assert "convert it to the hf format instead" in message


def test_refusal_comes_before_any_output(tmp_path):
    tiny_model(["gated_deltanet", "kimi_delta_attention"]).save_pretrained(tmp_path / "ours")
    with pytest.raises(ConversionError, match="layer 1 is 'kimi_delta_attention'"):
        convert_checkpoint(tmp_path / "ours", tmp_path / "out", from_format="hf", to_format="qwen3_next")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- experts


def test_stacked_experts_match_transformers_fusion():
    """Our stacking is transformers' (conversion_mapping "qwen2_moe": MergeModulelist then Concatenate(dim=1)):
    expert e of gate_up_proj is [gate_e; up_e], and the inverse splits it back exactly."""
    generator = torch.Generator().manual_seed(0)
    gates = [torch.randn(5, 3, generator=generator) for _ in range(4)]
    ups = [torch.randn(5, 3, generator=generator) for _ in range(4)]
    converter = StackedExperts(4, 2)
    interleaved = [t for pair in zip(gates, ups) for t in pair]
    (fused,) = converter.forward(interleaved)
    assert torch.equal(fused, torch.cat([torch.stack(gates), torch.stack(ups)], dim=1))
    assert all(torch.equal(a, b) for a, b in zip(converter.inverse([fused]), interleaved))
    assert converter.forward_shapes([(5, 3)] * 8) == [(4, 10, 3)]
    assert converter.inverse_shapes([(4, 10, 3)]) == [(5, 3)] * 8
    with pytest.raises(ValueError):
        converter.inverse_shapes([(3, 10, 3)])


def test_catalogue_entry():
    fmt = FORMATS["qwen3_next"]
    assert fmt.can_read and fmt.can_write and fmt.keeps_extra_tensors
    assert fmt.output.marker_fields == {"model_type": "qwen3_next"} and fmt.output.writes("model.safetensors")
    assert FORMATS["hf"].output.writes(EXTRA_TENSORS_FILE) and not FORMATS["fast_llm"].keeps_extra_tensors


# --------------------------------------------------------------------------------------------- sparse MoE layers

MOE_CASES = {
    # layer 1 dense, the others sparse with a shared expert; 2 of 4 experts per token
    "mixed": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  mlp_only_layers=[1]),
    # every second layer sparse (decoder_sparse_step 2), top-k weights not renormalised, 1 value head per key head
    "sparse_step": dict(num_experts=3, num_experts_per_tok=1, moe_intermediate_size=8,
                        shared_expert_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=False,
                        linear_num_key_heads=2, linear_num_value_heads=2),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_qwen3_next_converts_with_transformers_logits(tmp_path, case):
    theirs = save_qwen3_next(tmp_path / "qwen3_next", **MOE_CASES[case])
    assert (tmp_path / "qwen3_next" / "model.safetensors").is_file()
    assert any(key.endswith("mlp.experts.0.gate_proj.weight") for key in tensors_of(tmp_path / "qwen3_next"))  # hub
    convert_checkpoint(tmp_path / "qwen3_next", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    ours, info = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_predictions(theirs, ours.eval(), theirs.config.vocab_size)
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", from_format="hf", to_format="qwen3_next")
    assert tensors_of(tmp_path / "back") == tensors_of(tmp_path / "qwen3_next")  # per expert again, bit for bit
    assert_same_predictions(theirs, Qwen3NextForCausalLM.from_pretrained(tmp_path / "back").eval(), 96)


def test_hub_layouts_built_by_hand_and_fused_read_the_same(tmp_path):
    """The per-expert hub layout written here from the in-memory (fused) weights, independently of transformers'
    save_pretrained, and a folder saved fused (save_original_format=False) convert to the same tensors."""
    theirs = save_qwen3_next(tmp_path / "saved", **MOE_CASES["mixed"])
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(tmp_path / "saved" / "config.json", hub / "config.json")
    tensors, size = {}, 16
    for name, tensor in theirs.state_dict().items():
        if name == "lm_head.weight" and theirs.config.tie_word_embeddings:
            continue
        prefix, _, leaf = name.rpartition("experts.")
        if leaf == "gate_up_proj":
            for e, expert in enumerate(tensor):
                tensors[f"{prefix}experts.{e}.gate_proj.weight"] = expert[:size].clone()
                tensors[f"{prefix}experts.{e}.up_proj.weight"] = expert[size:].clone()
        elif leaf == "down_proj":
            tensors.update({f"{prefix}experts.{e}.down_proj.weight": expert.clone() for e, expert in enumerate(tensor)})
        else:
            tensors[name] = tensor.clone()
    from safetensors.torch import save_file

    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    theirs.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors_of(tmp_path / "fused")
    converted = {}
    for source in ("saved", "hub", "fused"):
        convert_checkpoint(tmp_path / source, tmp_path / f"{source}-hf", from_format="qwen3_next", to_format="hf")
        converted[source] = tensors_of(tmp_path / f"{source}-hf")
    assert converted["hub"] == converted["saved"] == converted["fused"]
    assert_same_predictions(theirs, HybridLinearForCausalLM.from_pretrained(tmp_path / "hub-hf").eval(), 96)


def test_our_moe_model_converts_to_transformers_qwen3_next(tmp_path):
    ours = tiny_model(["gated_deltanet", "full_attention", "gated_deltanet"],
                      mlp_types=["sparse_moe", "dense", "sparse_moe"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=24)
    ours.save_pretrained(tmp_path / "ours")
    convert_checkpoint(tmp_path / "ours", tmp_path / "qwen3_next", from_format="hf", to_format="qwen3_next")
    config = json.loads((tmp_path / "qwen3_next" / "config.json").read_text())
    assert (config["num_experts"], config["mlp_only_layers"], config["decoder_sparse_step"]) == (4, [1], 1)
    theirs, info = Qwen3NextForCausalLM.from_pretrained(tmp_path / "qwen3_next", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_predictions(theirs.eval(), ours, ours.config.vocab_size)


def test_moe_without_shared_expert_does_not_fit(tmp_path):
    from model_helpers import tiny_config

    config = tiny_config(["gated_deltanet", "full_attention"], mlp_types=["sparse_moe", "sparse_moe"],
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=0)
    with pytest.raises(ConversionError, match="no shared expert"):
        qwen3_next_rows(config)


def test_bfloat16_loading_keeps_the_stored_float32_decay_parameters(tmp_path):
    """from_pretrained(dtype=torch.bfloat16) of a converted float32 Qwen3-Next checkpoint: the GDN layers' A_log and
    dt_bias (they set the decay, which the recurrence compounds over every token) stay float32 with the stored values
    bit for bit, as the KDA mixer's; every other tensor is bf16. (transformers' Qwen3NextForCausalLM rounds both to
    bf16.)"""
    from safetensors.torch import load_file

    save_qwen3_next(tmp_path / "qwen", **DENSE_CASES[sorted(DENSE_CASES)[0]])
    convert_checkpoint(tmp_path / "qwen", tmp_path / "hf", from_format="qwen3_next", to_format="hf")
    ours = HybridLinearForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    decay = [name for name in stored if name.endswith(("A_log", "dt_bias"))]
    assert len(decay) >= 2
    held = ours.state_dict()
    for name in decay:
        assert held[name].dtype == torch.float32 and torch.equal(held[name], stored[name]), name
    assert all(t.dtype == torch.bfloat16 for n, t in held.items() if n not in decay and "gate.weight" not in n)


def test_an_unconverted_folder_is_refused_by_from_pretrained_in_one_line(tmp_path):
    """A folder of another family (transformers' Qwen3-Next, as the hub has it) is not built as this family's
    default model and then failed on its weights: refused, naming the converter."""
    save_qwen3_next(tmp_path / "source")
    with pytest.raises(ValueError) as raised:
        HybridLinearForCausalLM.from_pretrained(tmp_path / "source")
    message = str(raised.value)
    assert "\n" not in message and "'qwen3_next'" in message and "hybrid-linear-convert" in message, message

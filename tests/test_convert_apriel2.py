"""`--from apriel2`: Fast-LLM's own Hugging Face export (model_type "apriel2_text") converted to our format.

- The real fixtures (written by Fast-LLM's Apriel2 exporter) reproduce Fast-LLM's reference logits, and convert to
  the very same tensors, bit for bit, as the same models saved in Fast-LLM's `fast_llm` format.
- Heterogeneous Apriel2 configs (blocks differing in heads, KV heads, head size, window, GDN widths, conv sizes, KDA
  gate, MLP sizes and activations), built here from a tiny model of ours with a name map and GDN row layout written
  from Apriel2's documented layout (not the converter's tables), convert back to exactly our model: same settings
  per layer, same tensors, same logits.
- Stochastic (supernet) mixers convert their main mixer, skip the others by name, and are refused without one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conversion_helpers import FAST_LLM_FIXTURES as FIXTURES
from conversion_helpers import FIXTURE_LOGITS_TOLERANCE as TOLERANCE
from conversion_helpers import FIXTURE_NAMES, load_tensors
import torch
from model_helpers import randomize
from safetensors.torch import load_file, save_file

import hybrid_linear_models  # noqa: F401  (registers the Auto classes)
from hybrid_linear_cli import convert as front_end
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.configuration_hybrid_linear import BLOCK_FIELDS, MIXER_FIELDS
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.apriel2 import read_apriel2
from transformers import AutoModelForCausalLM

def logits_of(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each fixture converted from apriel2_text and from fast_llm, once for the tests below."""
    root = tmp_path_factory.mktemp("apriel2")
    return {name: tuple(convert_checkpoint(FIXTURES / name / source, root / f"{name}-{source}", from_format=fmt,
                                           to_format="hf").destination
                        for source, fmt in (("apriel2_text", "apriel2"), ("fast_llm", "fast_llm")))
            for name in FIXTURE_NAMES}


# --------------------------------------------------------------------------------------------- the real fixtures


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_apriel2_fixture_reproduces_reference_logits(converted, fixture):
    reference = load_file(FIXTURES / fixture / "reference_logits.safetensors")
    logits = logits_of(converted[fixture][0], reference["input_ids"])
    assert logits.dtype == reference["logits"].dtype == torch.float32
    assert (logits - reference["logits"]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_apriel2_and_fast_llm_convert_to_identical_folders(converted, fixture):
    from_apriel2, from_fast_llm = (load_tensors(folder) for folder in converted[fixture])
    assert sorted(from_apriel2) == sorted(from_fast_llm)
    for name, tensor in from_apriel2.items():
        assert tensor.dtype == from_fast_llm[name].dtype and torch.equal(tensor, from_fast_llm[name]), name
    configs = [json.loads((folder / "config.json").read_text()) for folder in converted[fixture]]
    # Fields only Apriel2's config.json records (Fast-LLM's metadata has no token ids and omits the default
    # num_position_embeddings): taken from config.json; every other field is the same.
    apriel2_only = {"bos_token_id": (1, None), "eos_token_id": (2, None), "max_position_embeddings": (2048, 32768)}
    for field in sorted(set(configs[0]) | set(configs[1])):
        values = (configs[0].get(field), configs[1].get(field))
        assert values == apriel2_only.get(field, (values[1], values[1])), field


def test_cli_converts_apriel2_and_lists_it(tmp_path, capsys):
    assert "apriel2" in front_end.build_parser().format_help()
    status = front_end.main(["--from", "apriel2", "--to", "hf", str(FIXTURES / "kda_attn" / "apriel2_text"),
                             str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert status in (0, None) and "from apriel2 to hf" in out and "skipped" not in out
    assert (tmp_path / "out" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------- heterogeneous blocks

# Our heterogeneous model: every setting that an Apriel2 block can vary, varied by some layer. The pattern repeats
# (6 blocks over 5 names), so layer 5 is block "attn" again.
LAYER_TYPES = ["full_attention", "gated_deltanet", "kimi_delta_attention", "sliding_attention", "gated_deltanet",
               "full_attention"]
PATTERN = ["attn", "gdn", "kda", "swa", "gdn_wide"]
FLAT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, gdn_num_key_heads=2, gdn_num_value_heads=2, gdn_key_head_dim=8, gdn_value_head_dim=8,
            gdn_conv_kernel_size=4, gdn_norm_eps=1e-5, gdn_gate_activation="silu", kda_num_heads=2, kda_head_dim=8,
            kda_conv_kernel_size=4, kda_norm_eps=1e-5, kda_gate_activation="silu", rms_norm_eps=1e-5,
            attention_output_gate=False, attention_qk_norm=False, zero_centered_norms=False, attention_bias=False,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 1.0})
PER_LAYER = {
    2: {"kda_num_heads": 4, "kda_head_dim": 4, "kda_gate_activation": "sigmoid", "kda_norm_eps": 1e-6,
        "kda_conv_kernel_size": 3, "hidden_act": "gelu_pytorch_tanh"},
    3: {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
        "attention_bias": True, "intermediate_size": 40},
    4: {"gdn_num_key_heads": 1, "gdn_num_value_heads": 4, "gdn_value_head_dim": 4, "gdn_conv_kernel_size": 2,
        "gdn_norm_eps": 1e-6, "intermediate_size": 24},
}
MLP = {"type": "mlp", "gated": True, "activation": "silu", "add_linear_biases": False, "intermediate_size": 48}


def _attention(heads, groups, size, theta, **extra):
    return {"type": "attention", "heads": heads, "head_groups": groups, "head_size": size, "add_linear_biases": False,
            "rotary": {"type": "mistral_1d", "theta": theta}, **extra}


def _block(mixer, **mlp):
    return {"mixer": mixer, "mlp": {**MLP, **mlp}, "normalization": {"type": "rms_norm", "epsilon": 1e-5}}


# The same model in Apriel2's spelling, written by hand.
BLOCKS = {
    "attn": _block(_attention(4, 2, 8, 10000.0)),
    "gdn": _block({"type": "gdn", "value_heads": 2, "key_heads": 2, "key_head_dim": 8, "value_head_dim": 8,
                   "convolution_layer": {"kernel_size": 4}}),
    "kda": _block({"type": "kda", "heads": 4, "head_dim": 4, "convolution_layer": {"kernel_size": 3},
                   "normalization": {"epsilon": 1e-6, "activation": "sigmoid"}}, activation="gelu_pytorch_tanh"),
    "swa": _block({**_attention(2, 1, 16, 500.0, window_size=3), "add_linear_biases": True}, intermediate_size=40),
    "gdn_wide": _block({"type": "gdn", "value_heads": 4, "key_heads": 1, "key_head_dim": 8, "value_head_dim": 4,
                        "convolution_layer": {"kernel_size": 2}, "norm_eps": 1e-6}, intermediate_size=24),
}

# canonical (our) name fragment -> Apriel2's, inside a block
_RENAMES = [("self_attn.", "mixer."), ("linear_attn.conv1d.", "mixer.convolution."),
            ("linear_attn.b_proj.", "mixer.beta_proj."), ("linear_attn.o_norm.", "mixer.norm."),
            ("_conv1d.", "_conv."), ("linear_attn.", "mixer.")]


def flat_rows(weight: torch.Tensor, key_heads: int, sizes: list[int]) -> torch.Tensor:
    """Qwen3-Next's rows grouped per key head, [h: s0 | s1 | ...], to Apriel2's (Fast-LLM's) flat sections
    [s0 of all heads | s1 of all heads | ...]."""
    grouped = weight.reshape(key_heads, sum(sizes), weight.shape[-1])
    return torch.cat([section.reshape(-1, weight.shape[-1]) for section in grouped.split(sizes, dim=1)])


def apriel2_tensors(model: HybridLinearForCausalLM, mixer_prefix=lambda index: "mixer.") -> dict[str, torch.Tensor]:
    config = model.config
    tensors = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.layers."):
            tensors[name] = tensor.clone()
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        layer = config.per_layer_config[int(index)]
        ratio = layer.gdn_num_value_heads // layer.gdn_num_key_heads
        if rest == "linear_attn.in_proj_qkvz.weight" and config.mixer_types[int(index)] == "gated_deltanet":
            dk, dv = layer.gdn_key_head_dim, layer.gdn_value_head_dim
            tensor = flat_rows(tensor, layer.gdn_num_key_heads, [dk, dk, ratio * dv, ratio * dv])
        elif rest == "linear_attn.in_proj_ba.weight":
            tensor = flat_rows(tensor, layer.gdn_num_key_heads, [ratio, ratio])
        for ours, theirs in _RENAMES:
            rest = rest.replace(ours, theirs, 1)
        rest = rest.replace("mixer.", mixer_prefix(int(index)), 1)
        tensors[f"model.decoder.blocks.{index}.{rest}"] = tensor.clone()
    return tensors


def write_apriel2(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """An Apriel2 folder as Fast-LLM's exporter writes it: config.json, an index and model_0.safetensors."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, folder / "model_0.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model_0.safetensors")}))
    return folder


def apriel2_config(decoder: dict, vocab_size: int, hidden_size: int, tied: bool = False) -> dict:
    return {"architectures": ["Apriel2ForCausalLM"], "model_type": "apriel2_text", "decoder": decoder,
            "embeddings": {"max_position_embeddings": 2048}, "head": {"normalization": {"type": "rms_norm",
                                                                                        "epsilon": 1e-5}},
            "hidden_size": hidden_size, "vocab_size": vocab_size, "tie_word_embeddings": tied, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": None, "use_cache": True, "transformers_version": "5.24.0"}


@pytest.fixture(scope="module")
def heterogeneous_model() -> HybridLinearForCausalLM:
    config = HybridLinearConfig(layer_types=LAYER_TYPES, sliding_window=3, per_layer_config=PER_LAYER, **FLAT)
    torch.manual_seed(0)
    return randomize(HybridLinearForCausalLM(config), seed=1).eval()


def assert_same_model(folder: Path, model: HybridLinearForCausalLM) -> None:
    """The converted folder is `model`: every layer's settings, every tensor bit for bit, and so the logits."""
    converted = HybridLinearForCausalLM.from_pretrained(folder).eval()
    ours, theirs = model.config, converted.config
    assert theirs.mixer_types == ours.mixer_types
    for index, layer_type in enumerate(ours.mixer_types):
        for field in (*MIXER_FIELDS[layer_type], *BLOCK_FIELDS):
            assert getattr(theirs.per_layer_config[index], field) == getattr(ours.per_layer_config[index], field), (
                index, field)
    state = model.state_dict()
    assert sorted(converted.state_dict()) == sorted(state)
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    input_ids = torch.randint(0, ours.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # the same weights through the same code: equal (the tensors above are bit-identical)
        assert torch.equal(converted(input_ids).logits, model(input_ids).logits)


def test_heterogeneous_pattern_converts_to_our_model(tmp_path, heterogeneous_model):
    decoder = {"type": "pattern", "blocks": BLOCKS, "pattern": PATTERN, "num_blocks": len(LAYER_TYPES)}
    source = write_apriel2(tmp_path / "apriel2", apriel2_config(decoder, FLAT["vocab_size"], FLAT["hidden_size"]),
                           apriel2_tensors(heterogeneous_model))
    converted = convert_checkpoint(source, tmp_path / "hf", from_format="apriel2", to_format="hf")
    assert converted.skipped == 0
    assert_same_model(converted.destination, heterogeneous_model)


def test_fixed_decoder_with_tied_embeddings_converts(tmp_path):
    config = HybridLinearConfig(layer_types=["gated_deltanet"] * 3, **{**FLAT, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = randomize(HybridLinearForCausalLM(config), seed=2).eval()
    decoder = {"type": "fixed", "block": BLOCKS["gdn"], "num_blocks": 3}
    tensors = apriel2_tensors(model)
    del tensors["lm_head.weight"]  # tied: Apriel2 stores only the embeddings
    source = write_apriel2(tmp_path / "apriel2", apriel2_config(decoder, FLAT["vocab_size"], FLAT["hidden_size"],
                                                                tied=True), tensors)
    assert_same_model(convert_checkpoint(source, tmp_path / "hf", from_format="apriel2", to_format="hf").destination,
                      model)


# --------------------------------------------------------------------------------------------- stochastic mixers


def _supernet(tmp_path: Path, heterogeneous_model, **stochastic) -> tuple[Path, list[str]]:
    """The heterogeneous model with block "swa" (layers 3) a supernet: its attention is mixer "swa" among a GDN and a
    Mamba that are trained but not used at inference. Returns the folder and the unused mixers' tensor names."""
    blocks = json.loads(json.dumps(BLOCKS))
    blocks["swa"]["mixer"] = {"type": "stochastic", "sampling_strategy": "uniform", **stochastic, "mixers": {
        "gdn": BLOCKS["gdn"]["mixer"], "swa": BLOCKS["swa"]["mixer"], "mamba": {"type": "mamba", "d_inner": 64}}}
    decoder = {"type": "pattern", "blocks": blocks, "pattern": PATTERN, "num_blocks": len(LAYER_TYPES)}
    tensors = apriel2_tensors(heterogeneous_model, lambda index: "mixer.mixers.swa." if index == 3 else "mixer.")
    generator = torch.Generator().manual_seed(5)
    unused = {"model.decoder.blocks.3.mixer.mixers.gdn.in_proj_qkvz.weight": (64, 32),
              "model.decoder.blocks.3.mixer.mixers.gdn.A_log": (2,),
              "model.decoder.blocks.3.mixer.mixers.mamba.in_proj.weight": (128, 32)}
    tensors.update({name: torch.randn(shape, generator=generator) for name, shape in unused.items()})
    config = apriel2_config(decoder, FLAT["vocab_size"], FLAT["hidden_size"])
    return write_apriel2(tmp_path / "supernet", config, tensors), sorted(unused)


def test_stochastic_mixer_converts_its_main_mixer(tmp_path, heterogeneous_model):
    source, unused = _supernet(tmp_path, heterogeneous_model, main_mixer_name="swa")
    assert read_apriel2(source).skipped == unused
    converted = convert_checkpoint(source, tmp_path / "hf", from_format="apriel2", to_format="hf")
    assert converted.skipped == len(unused)
    assert_same_model(converted.destination, heterogeneous_model)


@pytest.mark.parametrize("stochastic, fragments", [
    ({}, ("decoder.blocks.swa.mixer.main_mixer_name", "gdn, swa, mamba", "undefined")),
    ({"main_mixer_name": "absent"}, ("decoder.blocks.swa.mixer.main_mixer_name = 'absent'", "names none")),
    ({"main_mixer_name": "mamba"}, ("decoder.blocks.swa.mixer.mixers.mamba.type = 'mamba'", "Mamba")),
])
def test_stochastic_mixer_without_a_usable_main_mixer_is_refused(tmp_path, heterogeneous_model, stochastic,
                                                                  fragments):
    source, _ = _supernet(tmp_path, heterogeneous_model, **stochastic)
    with pytest.raises(ConversionError) as caught:
        read_apriel2(source)
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_cli_reports_skipped_supernet_tensors(tmp_path, heterogeneous_model, capsys):
    source, unused = _supernet(tmp_path, heterogeneous_model, main_mixer_name="swa")
    assert front_end.main(["--from", "apriel2", "--to", "hf", str(source), str(tmp_path / "out")]) in (0, None)
    assert f"skipped {len(unused)} " in capsys.readouterr().out



# --------------------------------------------------------------------------------------------- --to apriel2


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_apriel2_hf_apriel2_round_trip_is_bit_identical(tmp_path, converted, fixture):
    original_folder = FIXTURES / fixture / "apriel2_text"
    back = convert_checkpoint(converted[fixture][0], tmp_path / "back", from_format="hf", to_format="apriel2")
    original, returned = load_tensors(original_folder), load_tensors(back.destination)
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        assert tensor.dtype == returned[name].dtype and torch.equal(tensor, returned[name]), name
    # config.json: the same, but for the block names (ours are named after their layer type, as in the fast_llm
    # writer); the blocks, matched through the pattern, are equal field for field
    first, again = (json.loads((folder / "config.json").read_text()) for folder in (original_folder,
                                                                                    back.destination))
    renamed = dict(zip(first["decoder"]["pattern"], again["decoder"]["pattern"]))
    assert {renamed[name]: block for name, block in first["decoder"]["blocks"].items()} == again["decoder"]["blocks"]
    for config in (first, again):
        del config["decoder"]["blocks"], config["decoder"]["pattern"]
    assert first == again


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fast_llm_to_apriel2_equals_fast_llms_own_export(tmp_path, fixture):
    """Fast-LLM wrote the fixture's apriel2_text folder from the same model: our writer must write the same
    tensors from the fast_llm checkpoint."""
    ours = convert_checkpoint(FIXTURES / fixture / "fast_llm", tmp_path / "ours", from_format="fast_llm",
                              to_format="apriel2").destination
    theirs, written = load_tensors(FIXTURES / fixture / "apriel2_text"), load_tensors(ours)
    assert sorted(theirs) == sorted(written)
    assert all(torch.equal(tensor, written[name]) for name, tensor in theirs.items())


def test_heterogeneous_model_writes_apriel2s_layout(tmp_path, heterogeneous_model):
    """Our heterogeneous model written --to apriel2 has the tensors of the hand-written Apriel2 layout above, and
    converts back to our model exactly."""
    heterogeneous_model.save_pretrained(tmp_path / "ours")
    written = convert_checkpoint(tmp_path / "ours", tmp_path / "apriel2", from_format="hf", to_format="apriel2")
    expected, tensors = apriel2_tensors(heterogeneous_model), load_tensors(written.destination)
    assert sorted(expected) == sorted(tensors)
    assert all(torch.equal(tensor, tensors[name]) for name, tensor in expected.items())
    blocks = json.loads((written.destination / "config.json").read_text())["decoder"]["blocks"]
    assert blocks["gdn_2"]["mixer"]["norm_eps"] == 1e-6 and "norm_eps" not in blocks["gdn"]["mixer"]
    assert blocks["kda"]["mixer"]["normalization"] == {"epsilon": 1e-6, "activation": "sigmoid"}
    back = convert_checkpoint(written.destination, tmp_path / "back", from_format="apriel2", to_format="hf")
    assert_same_model(back.destination, heterogeneous_model)


@pytest.mark.parametrize("overrides, fragments", [
    ({"attention_output_gate": True, "attention_qk_norm": True},
     ("layer 0 (full_attention): attention_output_gate=True", "attention_qk_norm=True")),
    ({"per_layer_config": {1: {"rms_norm_eps": 1e-6}}}, ("layer 1 (gated_deltanet): rms_norm_eps=1e-06 differs",)),
    ({"gdn_gate_activation": "sigmoid"}, ("gdn_gate_activation='sigmoid'",)),
    ({"mlp_bias": True, "hidden_act": "tanh"}, ("mlp_bias=True", "hidden_act='tanh'")),
    ({"zero_centered_norms": True}, ("zero_centered_norms=True",)),
    ({"mlp_types": ["dense", "sparse_moe", "dense"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, "shared_expert_intermediate_size": 0}, ("layer 1 (gated_deltanet): mlp_types[1]",)),
    ({"kda_gate_bias": True}, ("layer 2 (kimi_delta_attention): kda_gate_bias=True",)),
])
def test_what_apriel2_cannot_express_is_refused(tmp_path, overrides, fragments):
    settings = {**FLAT, **overrides}
    model = HybridLinearForCausalLM(HybridLinearConfig(layer_types=LAYER_TYPES[:3], **settings))
    model.save_pretrained(tmp_path / "ours")
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(tmp_path / "ours", tmp_path / "apriel2", from_format="hf", to_format="apriel2")
    message = str(caught.value)
    assert "\n" not in message and "cannot be expressed as an Apriel2 model" in message, message
    assert all(fragment in message for fragment in fragments), message
    assert not (tmp_path / "apriel2").exists()


def test_force_replaces_an_apriel2_folder_only(tmp_path, converted):
    destination = tmp_path / "apriel2"
    convert_checkpoint(converted["kda_attn"][0], destination, from_format="hf", to_format="apriel2")
    convert_checkpoint(converted["kda_attn"][0], destination, from_format="hf", to_format="apriel2", force=True)
    (destination / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="notes.txt"):
        convert_checkpoint(converted["kda_attn"][0], destination, from_format="hf", to_format="apriel2", force=True)

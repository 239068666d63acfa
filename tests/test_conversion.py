"""End-to-end checks of the converters on real Fast-LLM checkpoints (tests/fixtures/fast_llm): exact logits after
conversion, bit-identical round trips, the streaming distributed reader, sharding, dtype casts, and loading the
exported folder with trust_remote_code where the package is not importable."""

from __future__ import annotations

import dataclasses

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conversion_helpers import FAST_LLM_FIXTURES as FIXTURES
from conversion_helpers import FIXTURE_LOGITS_TOLERANCE as TOLERANCE
from conversion_helpers import FIXTURE_NAMES, load_tensors
import torch
from distributed_helpers import SUBPROCESS_TIMEOUT
from model_helpers import WITHOUT_THE_PACKAGE_PRELUDE, run_without_the_package
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

import hybrid_linear_models  # noqa: F401  (registers the Auto classes)
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.conversion import convert_checkpoint
from hybrid_linear_models.conversion.fast_llm import mixers as fast_llm_mixers
from hybrid_linear_models.conversion.converters import IDENTITY
from hybrid_linear_models.conversion.hf_layout import hf_tensor_shapes
from hybrid_linear_models.conversion.synthetic import write_random_checkpoint
from transformers import AutoModelForCausalLM

def reference(fixture: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / fixture / "reference_logits.safetensors")


def logits_of(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """Each fixture's fast_llm checkpoint converted to our HF format once, shared by the tests below."""
    root = tmp_path_factory.mktemp("exported")
    return {name: convert_checkpoint(FIXTURES / name / "fast_llm", root / name, from_format="fast_llm",
                                     to_format="hf").destination for name in FIXTURE_NAMES}


# --------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fast_llm_to_hf_reproduces_reference_logits(exported, fixture):
    ref = reference(fixture)
    logits = logits_of(exported[fixture], ref["input_ids"])
    assert logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_distributed_to_hf_reproduces_reference_logits(tmp_path, fixture):
    dst = convert_checkpoint(FIXTURES / fixture / "distributed", tmp_path / "hf", from_format="fast_llm_distributed",
                             to_format="hf").destination
    ref = reference(fixture)
    assert (logits_of(dst, ref["input_ids"]) - ref["logits"]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_distributed_and_fast_llm_give_identical_tensors(tmp_path, exported, fixture):
    dst = convert_checkpoint(FIXTURES / fixture / "distributed", tmp_path / "hf", from_format="fast_llm_distributed",
                             to_format="hf").destination
    from_distributed, from_fast_llm = load_tensors(dst), load_tensors(exported[fixture])
    assert sorted(from_distributed) == sorted(from_fast_llm)
    for name, tensor in from_fast_llm.items():
        assert torch.equal(from_distributed[name], tensor), name


def test_gdn_row_permutation_is_pinned_by_the_logits(tmp_path, monkeypatch):
    """Negative control: keeping Fast-LLM's flat GDN layout (no regrouping) must break the logits, so the reference
    comparison above really pins the permutation (the fixture has 2 value heads per key head)."""
    gdn = fast_llm_mixers.FAST_LLM_MIXERS["gdn"]
    flat = tuple(dataclasses.replace(p, converter=IDENTITY) for p in gdn.parameters)
    monkeypatch.setitem(fast_llm_mixers.FAST_LLM_MIXERS, "gdn", dataclasses.replace(gdn, parameters=flat))
    dst = convert_checkpoint(FIXTURES / "hybrid_attn_gdn_kda" / "fast_llm", tmp_path / "flat", from_format="fast_llm",
                             to_format="hf").destination
    ref = reference("hybrid_attn_gdn_kda")
    assert (logits_of(dst, ref["input_ids"]) - ref["logits"]).abs().max().item() > 1e-2


# --------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fast_llm_hf_fast_llm_round_trip_is_bit_identical(tmp_path, exported, fixture):
    back = convert_checkpoint(exported[fixture], tmp_path / "back", from_format="hf", to_format="fast_llm").destination
    original, returned = load_tensors(FIXTURES / fixture / "fast_llm"), load_tensors(back)
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        assert returned[name].dtype == tensor.dtype and torch.equal(returned[name], tensor), name
    # Same model config (Fast-LLM's spelling may differ: block names, defaults written out).
    metadata = yaml.safe_load((back / "metadata.yaml").read_text())
    assert metadata["format"] == "fast_llm" and metadata["shards"] == ["weights"]
    assert set(metadata["metadata"]["state_index"]) == set(returned)
    again = convert_checkpoint(back, tmp_path / "again", from_format="fast_llm", to_format="hf").destination
    first_config = json.loads((exported[fixture] / "config.json").read_text())
    assert json.loads((again / "config.json").read_text()) == first_config


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_hf_fast_llm_hf_round_trip_is_bit_identical(tmp_path, exported, fixture):
    fast_llm = convert_checkpoint(exported[fixture], tmp_path / "fl", from_format="hf", to_format="fast_llm")
    back = convert_checkpoint(fast_llm.destination, tmp_path / "hf", from_format="fast_llm", to_format="hf")
    original, returned = load_tensors(exported[fixture]), load_tensors(back.destination)
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        assert torch.equal(returned[name], tensor), name


def _synthetic_config(**overrides) -> HybridLinearConfig:
    settings = dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "gated_deltanet", "kimi_delta_attention", "full_attention"],
        sliding_window=5, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        gdn_num_key_heads=2, gdn_num_value_heads=6, gdn_key_head_dim=8, gdn_value_head_dim=4,
        gdn_norm_eps=1e-5, kda_num_heads=2, kda_head_dim=8, kda_norm_eps=1e-5, kda_gate_activation="sigmoid",
        tie_word_embeddings=True, attention_output_gate=False, attention_qk_norm=False, zero_centered_norms=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0},
    )
    settings.update(overrides)
    return HybridLinearConfig(**settings)


def test_save_pretrained_folder_round_trips_through_fast_llm(tmp_path):
    """A folder written by our own model's save_pretrained (tied embeddings, sliding window, GVA ratio 3, sigmoid KDA
    gate) converts to Fast-LLM and back with identical tensors and config, and the same logits."""
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(_synthetic_config()).eval()
    model.save_pretrained(tmp_path / "saved")
    fast_llm = convert_checkpoint(tmp_path / "saved", tmp_path / "fl", from_format="hf", to_format="fast_llm")
    mixers = yaml.safe_load((fast_llm.destination / "metadata.yaml").read_text())["config"]["base_model"]["decoder"]
    assert mixers["blocks"]["sliding_attention"]["mixer"]["window_size"] == 5
    assert mixers["blocks"]["kda"]["mixer"]["normalization"]["activation"] == "sigmoid"
    back = convert_checkpoint(fast_llm.destination, tmp_path / "hf", from_format="fast_llm", to_format="hf")
    saved, returned = load_tensors(tmp_path / "saved"), load_tensors(back.destination)
    assert "lm_head.weight" not in returned and sorted(saved) == sorted(returned)
    assert all(torch.equal(saved[name], returned[name]) for name in saved)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.equal(logits_of(back.destination, ids), expected)
    config = json.loads((back.destination / "config.json").read_text())
    for field in ("sliding_window", "gdn_num_value_heads", "kda_gate_activation", "tie_word_embeddings"):
        assert config[field] == getattr(model.config, field)


def test_canonical_layout_matches_the_model_state_dict():
    for config in (_synthetic_config(), _synthetic_config(tie_word_embeddings=False, attention_output_gate=True,
                                                          attention_qk_norm=True, attention_bias=True,
                                                          mlp_bias=True)):
        model = HybridLinearForCausalLM(config)
        state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight")
        assert hf_tensor_shapes(config) == state


# --------------------------------------------------------------------------------------------- output folder


def test_hf_output_folder(exported):
    folder = exported["hybrid_attn_gdn_kda"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "hybrid_linear"
    assert config["architectures"] == ["HybridLinearForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_hybrid_linear.HybridLinearConfig",
        "AutoModel": "modeling_hybrid_linear.HybridLinearModel",
        "AutoModelForCausalLM": "modeling_hybrid_linear.HybridLinearForCausalLM",
    }
    # Every math switch is written explicitly.
    for field, value in {"zero_centered_norms": False, "attention_output_gate": False, "attention_qk_norm": False,
                         "gdn_gate_activation": "silu", "kda_gate_activation": "silu", "gdn_norm_eps": 1e-5,
                         "kda_norm_eps": 1e-5, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 1.0}}.items():
        assert config[field] == value, field
    assert config["mixer_types"] == ["full_attention", "gated_deltanet", "kimi_delta_attention", "gated_deltanet"]
    assert config["layer_types"] == ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    assert (folder / "generation_config.json").is_file()
    for name in ("configuration_hybrid_linear.py", "modeling_hybrid_linear.py"):
        assert (folder / name).is_file()
    with safe_open(folder / "model.safetensors", "pt") as file:
        assert file.metadata() == {"format": "pt"}
    card = (folder / "README.md").read_text()
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["library_name"] == "transformers" and front_matter["pipeline_tag"] == "text-generation"
    assert {"hybrid", "gated-deltanet", "kimi-delta-attention", "linear-attention", "fast-llm"} <= set(
        front_matter["tags"])
    assert "| 2 | Kimi Delta Attention (`kimi_delta_attention`) |" in card
    assert "trust_remote_code=True" in card and "fast_llm" in card
    assert f"{sum(t.numel() for t in load_tensors(folder).values()):,}" in card
    assert "{{" not in card
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_sharded_output_loads_and_matches(tmp_path):
    dst = convert_checkpoint(FIXTURES / "kda_attn" / "fast_llm", tmp_path / "sharded", from_format="fast_llm",
                             to_format="hf", max_shard_size="100KB").destination
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (dst / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in load_tensors(dst).values())
    for shard in shards[:-1]:  # every shard but a lone oversized tensor stays under the limit
        with safe_open(dst / shard, "pt") as file:
            sizes = [file.get_slice(k).get_shape() for k in file.keys()]
        assert len(sizes) == 1 or sum(torch.Size(s).numel() * 4 for s in sizes) <= 100_000
    ref = reference("kda_attn")
    assert (logits_of(dst, ref["input_ids"]) - ref["logits"]).abs().max().item() <= TOLERANCE


def test_dtype_cast(tmp_path, exported):
    dst = convert_checkpoint(FIXTURES / "kda_attn" / "fast_llm", tmp_path / "bf16", from_format="fast_llm",
                             to_format="hf", dtype="bfloat16").destination
    cast, full = load_tensors(dst), load_tensors(exported["kda_attn"])
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, full[n].to(torch.bfloat16)) for n, t in cast.items())
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow  # the converter's CLI in subprocesses
def test_cli_converts_and_reports(tmp_path):
    script = Path(__file__).parents[1] / "conversion_scripts" / "convert.py"
    result = subprocess.run([sys.executable, str(script), "--from", "fast_llm", "--to", "hf",
                             str(FIXTURES / "kda_attn" / "fast_llm"), str(tmp_path / "out"), "--quiet"],
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and (tmp_path / "out" / "model.safetensors").is_file()
    help_text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                               timeout=SUBPROCESS_TIMEOUT).stdout
    for name in ("fast_llm", "fast_llm_distributed", "hf", "--max-shard-size", "--dtype", "--force"):
        assert name in help_text


# --------------------------------------------------------------------------------------------- remote code

_ISOLATED_LOAD = WITHOUT_THE_PACKAGE_PRELUDE + textwrap.dedent("""

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, reference = sys.argv[1], load_file(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert "hybrid_linear_models" not in sys.modules
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    print("MAXDIFF", (logits - reference["logits"]).abs().max().item())
""")


@pytest.mark.slow  # a subprocess that loads the model without the package
def test_loads_with_trust_remote_code_without_the_package(tmp_path, exported):
    script = tmp_path / "load.py"
    script.write_text(_ISOLATED_LOAD)
    result = run_without_the_package(script, exported["hybrid_attn_gdn_kda"],
                                     FIXTURES / "hybrid_attn_gdn_kda" / "reference_logits.safetensors", cwd=tmp_path)
    max_diff = float(result.stdout.split("MAXDIFF")[1])
    assert max_diff <= TOLERANCE


def test_random_checkpoint_builder_round_trip(tmp_path):
    """The synthetic checkpoint writer used by the benchmark produces loadable checkpoints in both formats."""
    config = _synthetic_config(tie_word_embeddings=False)
    fast_llm = write_random_checkpoint(tmp_path / "fl", config, "fast_llm", dtype=torch.bfloat16)
    hf = write_random_checkpoint(tmp_path / "hf", config, "hf", dtype=torch.bfloat16)
    converted = convert_checkpoint(fast_llm, tmp_path / "converted", from_format="fast_llm", to_format="hf")
    direct, via = load_tensors(hf), load_tensors(converted.destination)
    assert sorted(direct) == sorted(via) and all(torch.equal(direct[n], via[n]) for n in direct)
    AutoModelForCausalLM.from_pretrained(hf)


def test_a_block_the_pattern_never_uses_is_skipped_as_fast_llm_skips_it(tmp_path):
    """Fast-LLM builds only the blocks its pattern names over num_blocks (it warns about the others and stores no
    weights for them): such a block converts, whatever its type, to the same model as without it."""
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "hybrid_attn_gdn_kda" / "fast_llm", source)
    metadata = yaml.safe_load((source / "metadata.yaml").read_text())
    metadata["config"]["base_model"]["decoder"]["blocks"]["unused"] = {"type": "decoder", "mixer": {"type": "mamba"}}
    (source / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    converted = convert_checkpoint(source, tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    ref = reference("hybrid_attn_gdn_kda")
    assert (logits_of(converted, ref["input_ids"]) - ref["logits"]).abs().max().item() <= TOLERANCE

"""Bad inputs and refused outputs: each gives one clear message naming the problem and the fix, the CLI exits
non-zero without a traceback, and DST does not exist afterwards (or, with --force, still holds the old output)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from distributed_helpers import SUBPROCESS_TIMEOUT
from safetensors.torch import load_file, save_file

from hybrid_linear_models import HybridLinearConfig
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion import api as conversion_api
from hybrid_linear_models.conversion.cli import main
from hybrid_linear_models.conversion.synthetic import write_random_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "fast_llm"
HYBRID = FIXTURES / "hybrid_attn_gdn_kda"


@pytest.fixture
def fast_llm_copy(tmp_path) -> Path:
    """A writable copy of the hybrid fixture's fast_llm checkpoint."""
    return Path(shutil.copytree(HYBRID / "fast_llm", tmp_path / "src"))


def edit_metadata(folder: Path, edit) -> None:
    path = folder / "metadata.yaml"
    metadata = yaml.safe_load(path.read_text())
    edit(metadata)
    path.write_text(yaml.safe_dump(metadata))


def rewrite_tensors(folder: Path, edit) -> None:
    """Rewrites model_0.safetensors (and the state index) after `edit(tensors)`."""
    path = folder / "model_0.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    edit_metadata(folder, lambda m: m["metadata"].__setitem__("state_index", dict.fromkeys(tensors, path.name)))


def expect_failure(src: Path, dst: Path, *fragments: str, from_format: str = "fast_llm", to_format: str = "hf",
                   **options) -> str:
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(src, dst, from_format=from_format, to_format=to_format, **options)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")], "staging folder left"
    return message


# --------------------------------------------------------------------------------------------- SRC problems


def test_src_missing(tmp_path):
    expect_failure(tmp_path / "nowhere", tmp_path / "dst", "does not exist")


def test_src_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_failure(tmp_path / "empty", tmp_path / "dst", "not a Fast-LLM checkpoint", "no metadata.yaml")
    expect_failure(tmp_path / "empty", tmp_path / "dst", "not a Hugging Face checkpoint", "no config.json",
                   from_format="hf")


def test_src_of_another_format_gets_a_hint(tmp_path):
    expect_failure(HYBRID / "distributed", tmp_path / "dst", "format 'distributed'", "--from fast_llm_distributed")
    expect_failure(HYBRID / "fast_llm", tmp_path / "dst", "--from fast_llm", from_format="hf")
    expect_failure(HYBRID / "fast_llm", tmp_path / "dst", "'fast_llm'", "--from fast_llm",
                   from_format="fast_llm_distributed")
    expect_failure(HYBRID / "apriel2_text", tmp_path / "dst", "model_type 'apriel2_text'", from_format="hf")


def test_metadata_unreadable(fast_llm_copy, tmp_path):
    (fast_llm_copy / "metadata.yaml").write_text("config: [unclosed\n  : : garbage {{{")
    expect_failure(fast_llm_copy, tmp_path / "dst", "metadata.yaml is not readable YAML", "corrupt")


def test_metadata_without_model_config(fast_llm_copy, tmp_path):
    (fast_llm_copy / "metadata.yaml").write_text("just a string\n")
    expect_failure(fast_llm_copy, tmp_path / "dst", "config.base_model")


def test_unknown_mixer_type(fast_llm_copy, tmp_path):
    edit_metadata(fast_llm_copy, lambda m: m["config"]["base_model"]["decoder"]["blocks"]["gdn"]["mixer"].__setitem__(
        "type", "mamba"))
    expect_failure(fast_llm_copy, tmp_path / "dst", "config.base_model.decoder.blocks.gdn.mixer.type", "'mamba'",
                   "unknown mixer type", "attention, gdn, kda")


def test_truncated_safetensors(fast_llm_copy, tmp_path):
    path = fast_llm_copy / "model_0.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_failure(fast_llm_copy, tmp_path / "dst", "model_0.safetensors is not a valid safetensors file",
                   "truncated or corrupt")


@pytest.mark.parametrize("position", [0, 3, 7, 20, 200])
def test_corrupt_safetensors_header(fast_llm_copy, tmp_path, position):
    path = fast_llm_copy / "model_0.safetensors"
    data = bytearray(path.read_bytes())
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))
    expect_failure(fast_llm_copy, tmp_path / "dst", "model_0.safetensors is not a valid safetensors file")


def test_truncated_hf_shard(tmp_path):
    src = convert_checkpoint(HYBRID / "fast_llm", tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    expect_failure(src, tmp_path / "dst", "model.safetensors is not a valid safetensors file", from_format="hf",
                   to_format="fast_llm")


def test_shape_contradicts_config(fast_llm_copy, tmp_path):
    blocks = ("attn", "gdn", "kda")
    edit_metadata(fast_llm_copy, lambda m: [m["config"]["base_model"]["decoder"]["blocks"][b]["mlp"].__setitem__(
        "intermediate_size", 40) for b in blocks])
    expect_failure(fast_llm_copy, tmp_path / "dst", "decoder.0.mlp.layer_1.weight/weights has shape [96, 64]",
                   "implies [80, 64]", "config does not match the weights")


def test_tensor_shape_corrupted(fast_llm_copy, tmp_path):
    rewrite_tensors(fast_llm_copy, lambda t: t.__setitem__("decoder.1.mixer.in_proj_ba.weight/weights",
                                                           torch.zeros(6, 64)))
    expect_failure(fast_llm_copy, tmp_path / "dst", "decoder.1.mixer.in_proj_ba.weight/weights has shape [6, 64]",
                   "implies [8, 64]")


def test_missing_tensor(fast_llm_copy, tmp_path):
    rewrite_tensors(fast_llm_copy, lambda t: t.pop("decoder.2.mixer.q_conv.weight/weights"))
    expect_failure(fast_llm_copy, tmp_path / "dst", "missing tensor(s) decoder.2.mixer.q_conv.weight/weights",
                   "incomplete")


def test_missing_file_listed_in_state_index(fast_llm_copy, tmp_path):
    edit_metadata(fast_llm_copy, lambda m: m["metadata"]["state_index"].__setitem__(
        "decoder.0.mixer.query.weight/weights", "model_1.safetensors"))
    expect_failure(fast_llm_copy, tmp_path / "dst", "model_1.safetensors", "missing")


def test_extra_tensor(fast_llm_copy, tmp_path):
    rewrite_tensors(fast_llm_copy, lambda t: t.__setitem__("decoder.0.mixer.query.bias/weights", torch.zeros(64)))
    expect_failure(fast_llm_copy, tmp_path / "dst", "decoder.0.mixer.query.bias/weights",
                   "does not account for")


def test_extra_tensor_in_hf_folder(tmp_path):
    src = convert_checkpoint(HYBRID / "fast_llm", tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    expect_failure(src, tmp_path / "dst", "model.layers.0.self_attn.q_norm.weight", from_format="hf",
                   to_format="fast_llm")


def test_optimizer_state_is_skipped_not_extra(fast_llm_copy, tmp_path):
    """Tensors of other state shards (optimizer moments) are not weights: skipped, not an error."""
    rewrite_tensors(fast_llm_copy, lambda t: t.__setitem__("decoder.0.norm_1.weight/exp_avg", torch.zeros(64)))
    edit_metadata(fast_llm_copy, lambda m: m.__setitem__("shards", ["weights", "exp_avg"]))
    result = convert_checkpoint(fast_llm_copy, tmp_path / "dst", from_format="fast_llm", to_format="hf")
    assert result.skipped == 1
    assert "model.layers.0.input_layernorm.weight" in load_file(tmp_path / "dst" / "model.safetensors")


def test_tensor_stored_twice(fast_llm_copy, tmp_path):
    tensors = load_file(fast_llm_copy / "model_0.safetensors")
    save_file({"decoder.0.norm_1.weight/weights": tensors["decoder.0.norm_1.weight/weights"]},
              fast_llm_copy / "model_1.safetensors")
    edit_metadata(fast_llm_copy, lambda m: m["metadata"].pop("state_index"))
    expect_failure(fast_llm_copy, tmp_path / "dst", "decoder.0.norm_1.weight/weights is stored twice")


# --------------------------------------------------------------------------------------------- config problems


def _edit_block(block: str, path: tuple[str, ...], value):
    def edit(metadata):
        node = metadata["config"]["base_model"]["decoder"]["blocks"][block]
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return edit


@pytest.mark.parametrize("block, path, value, fragments", [
    # Biases and per-block settings convert (the dense layer's bias on its own through attention_output_bias); what
    # is refused is a mix our switches cannot express: q apart from k/v.
    ("attn", ("mixer", "query_layer", "bias", "enabled"), True,
     ("blocks.attn.mixer gives its query and key layers different biases", "query_layer: bias",
      "attention_bias")),
    ("gdn", ("mixer", "output_layer", "bias", "enabled"), True, ("blocks.gdn.mixer.output_layer has a bias",)),
    ("gdn", ("mlp", "gated"), False, ("blocks.gdn.mlp.gated", "non-gated")),
    ("kda", ("mlp", "activation"), "identity", ("blocks.kda.mlp.activation", "'identity'")),
    ("attn", ("mixer", "rotary", "type"), "yarn", ("mixer.rotary.type", "'yarn'")),
    ("attn", ("mixer", "causal"), False, ("mixer.causal",)),
    ("gdn", ("mixer", "convolution_layer", "activation"), "identity", ("convolution_layer.activation",)),
    ("kda", ("mixer", "zero_centered_output"), True, ("blocks.kda.mixer.zero_centered_output", "not supported")),
    ("attn", ("normalization", "type"), "layer_norm", ("normalization.type", "RMSNorm")),
])
def test_config_our_model_cannot_express(fast_llm_copy, tmp_path, block, path, value, fragments):
    edit_metadata(fast_llm_copy, _edit_block(block, path, value))
    expect_failure(fast_llm_copy, tmp_path / "dst", *fragments)


def test_a_block_whose_settings_contradict_its_tensors(fast_llm_copy, tmp_path):
    """Blocks may differ; a block claiming more GDN heads than its stored tensors have is refused by the tensor that
    does not fit."""
    def edit(metadata):
        decoder = metadata["config"]["base_model"]["decoder"]
        decoder["blocks"]["gdn_wide"] = yaml.safe_load(yaml.safe_dump(decoder["blocks"]["gdn"]))
        decoder["blocks"]["gdn_wide"]["mixer"]["value_heads"] = 8
        decoder["pattern"] = ["attn", "gdn", "kda", "gdn_wide"]
    edit_metadata(fast_llm_copy, edit)
    expect_failure(fast_llm_copy, tmp_path / "dst", "decoder.3.mixer", "has shape", "the config implies")


def test_missing_size_without_a_safe_default(fast_llm_copy, tmp_path):
    edit_metadata(fast_llm_copy, lambda m: m["config"]["base_model"]["decoder"]["blocks"]["kda"]["mixer"].pop(
        "head_dim"))
    expect_failure(fast_llm_copy, tmp_path / "dst", "blocks.kda.mixer.head_dim", "add the value")


def test_missing_tied_embedding_flag_gets_a_hint(fast_llm_copy, tmp_path):
    edit_metadata(fast_llm_copy, lambda m: m["config"]["base_model"].pop("tied_embedding_weight"))
    expect_failure(fast_llm_copy, tmp_path / "dst", "tied_embedding_weight", "has head.output_weights/weights",
                   "probably false")


def _as_fixed_decoder(block: str):
    def edit(metadata):
        decoder = metadata["config"]["base_model"]["decoder"]
        metadata["config"]["base_model"]["decoder"] = {"type": "fixed", "block": decoder["blocks"][block],
                                                        "num_blocks": decoder["num_blocks"]}
    return edit


def test_fixed_decoder(tmp_path):
    """A fixed (non-pattern) decoder: one block config for every layer."""
    config = HybridLinearConfig(vocab_size=64, hidden_size=16, intermediate_size=24, rms_norm_eps=1e-5,
                                layer_types=["kimi_delta_attention"] * 3, kda_num_heads=2, kda_head_dim=8,
                                kda_norm_eps=1e-5, kda_gate_activation="silu", zero_centered_norms=False,
                                attention_output_gate=False, attention_qk_norm=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 1.0})
    src = write_random_checkpoint(tmp_path / "src", config, "fast_llm")
    edit_metadata(src, _as_fixed_decoder("kda"))
    dst = convert_checkpoint(src, tmp_path / "dst", from_format="fast_llm", to_format="hf").destination
    expected = write_random_checkpoint(tmp_path / "expected", config, "hf")
    assert (dst / "config.json").read_text() == (expected / "config.json").read_text()
    converted, direct = load_file(dst / "model.safetensors"), load_file(expected / "model.safetensors")
    assert sorted(converted) == sorted(direct) and all(torch.equal(converted[k], direct[k]) for k in direct)
    # A fixed decoder whose block does not match the stored tensors: they are reported by name.
    mismatched = Path(shutil.copytree(FIXTURES / "kda_attn" / "fast_llm", tmp_path / "mismatched"))
    edit_metadata(mismatched, _as_fixed_decoder("kda"))
    expect_failure(mismatched, tmp_path / "dst2", "missing tensor(s) decoder.1.mixer.")


def test_hf_config_fast_llm_cannot_express(tmp_path):
    config = HybridLinearConfig(vocab_size=64, hidden_size=16, intermediate_size=24, layer_types=["full_attention"],
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # Qwen3-Next defaults
    src = write_random_checkpoint(tmp_path / "hf", config, "hf")
    expect_failure(src, tmp_path / "dst", "cannot be expressed as a Fast-LLM model", "zero_centered_norms=True",
                   "attention_output_gate=True", "partial_rotary_factor", from_format="hf", to_format="fast_llm")


def test_hf_pickle_weights_refused(tmp_path):
    src = convert_checkpoint(HYBRID / "fast_llm", tmp_path / "hf", from_format="fast_llm", to_format="hf").destination
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    expect_failure(src, tmp_path / "dst", "pytorch_model.bin", "only safetensors", from_format="hf",
                   to_format="fast_llm")


def test_distributed_layout_mismatch(tmp_path):
    src = Path(shutil.copytree(HYBRID / "distributed", tmp_path / "src"))
    path = src / "rank_0.safetensors"
    buffer = load_file(path)["weights_shard"]
    padded = buffer.clone()
    padded[46208 + 26776] = 1.0  # stage 2 ends at 46208 + 26776 and is padded to 46208 + 26784
    save_file({"weights_shard": padded}, path)
    expect_failure(src, tmp_path / "dst", "stage padding", "not zero", from_format="fast_llm_distributed")
    save_file({"weights_shard": buffer[:-32]}, path)
    expect_failure(src, tmp_path / "dst", "weights_shard has shape [155328]", "implies [155360]",
                   from_format="fast_llm_distributed")


# --------------------------------------------------------------------------------------------- DST safety


def test_existing_dst_refused_without_force(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    with pytest.raises(ConversionError, match="already exists.*--force"):
        convert_checkpoint(HYBRID / "fast_llm", dst, from_format="fast_llm", to_format="hf")
    assert (dst / "keep.txt").read_text() == "old"


def test_force_replaces_only_when_complete(tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    convert_checkpoint(HYBRID / "fast_llm", dst, from_format="fast_llm", to_format="hf")  # the old output
    old = {p.name: p.read_bytes() for p in dst.iterdir()}

    def broken_stream(plan, quiet, label):
        yield from list(conversion_api.stream_tensors(plan))[:5]
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing

    monkeypatch.setattr(conversion_api, "_with_progress", broken_stream)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(HYBRID / "fast_llm", dst, from_format="fast_llm", to_format="hf", force=True,
                           dtype="bfloat16")
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == old  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no staging folder or lock file left
    monkeypatch.undo()
    convert_checkpoint(HYBRID / "fast_llm", dst, from_format="fast_llm", to_format="hf", force=True,
                       dtype="bfloat16")
    assert (dst / "model.safetensors").read_bytes() != old["model.safetensors"]
    assert '"dtype": "bfloat16"' in (dst / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_interrupted_conversion_leaves_no_dst(tmp_path, monkeypatch):
    def broken_stream(plan, quiet, label):
        yield from list(conversion_api.stream_tensors(plan))[:3]
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion_api, "_with_progress", broken_stream)
    assert main(["--from", "fast_llm", "--to", "hf", str(HYBRID / "fast_llm"), str(tmp_path / "dst"),
                 "--quiet"]) == 130
    assert list(tmp_path.iterdir()) == []


def test_dst_inside_src_refused(fast_llm_copy):
    with pytest.raises(ConversionError, match="overlaps SRC"):
        convert_checkpoint(fast_llm_copy, fast_llm_copy / "out", from_format="fast_llm", to_format="hf")


# --------------------------------------------------------------------------------------------- CLI boundary


@pytest.mark.slow  # the converter's CLI in a subprocess
def test_cli_error_is_one_line_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hybrid_linear_models.conversion.cli", "--from", "fast_llm",
                             "--to", "hf", str(tmp_path / "missing"), str(tmp_path / "dst")],
                            check=False, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybrid-linear-convert: error: SRC") and "does not exist" in lines[0]
    assert not (tmp_path / "dst").exists()


def test_cli_rejects_unknown_format_and_bad_size(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--from", "no_such_format", "--to", "hf", "a", "b"])
    assert caught.value.code == 2 and "invalid choice: 'no_such_format'" in capsys.readouterr().err
    assert main(["--from", "fast_llm", "--to", "hf", str(HYBRID / "fast_llm"), str(tmp_path / "dst"),
                 "--max-shard-size", "lots"]) == 1
    assert "cannot read size 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()

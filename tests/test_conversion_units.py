"""Unit checks of the conversion building blocks: converters, the GDN row permutation, safetensors I/O, the
Fast-LLM distributed stage layout, the config maps, sizes, remote-code discovery and the model card."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_linear_models import HybridLinearConfig
from hybrid_linear_models.conversion import ConversionError, parse_size
from hybrid_linear_models.conversion.fast_llm.config import fast_llm_to_hybrid_config, hybrid_config_to_fast_llm
from hybrid_linear_models.conversion.converters import (
    IDENTITY, SPLIT_HALVES, TRANSPOSE, GdnKeyHeadGrouping, RowPermutation, flat_to_grouped_order,
)
from hybrid_linear_models.conversion.fast_llm.distributed import stage_layout
from hybrid_linear_models.conversion.model_card import load_template, render_model_card
from hybrid_linear_models.conversion.fast_llm.parameters import build_fast_llm_rows
from hybrid_linear_models.conversion.remote_code import relative_imports, remote_code_files
from hybrid_linear_models.conversion.safetensors_io import (
    SafetensorsFile, TensorInfo, plan_files, write_files,
)

FIXTURES = Path(__file__).parent / "fixtures" / "fast_llm"


def fixture_base_model(name: str) -> dict:
    return yaml.safe_load((FIXTURES / name / "fast_llm" / "metadata.yaml").read_text())["config"]["base_model"]


# --------------------------------------------------------------------------------------------- converters


@pytest.mark.parametrize("converter, shapes", [
    (IDENTITY, [(3, 4)]), (TRANSPOSE, [(3, 5)]), (SPLIT_HALVES, [(6, 4)]),
    (RowPermutation((2, 0, 3, 1)), [(4, 3)]),
])
def test_converters_round_trip_exactly(converter, shapes):
    tensors = [torch.randn(shape) for shape in shapes]
    forward = converter.forward(tensors)
    assert [tuple(t.shape) for t in forward] == converter.forward_shapes(shapes)
    assert converter.inverse_shapes(converter.forward_shapes(shapes)) == shapes
    back = converter.inverse(forward)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_flat_to_grouped_order():
    # Two groups, sections of sizes (1, 2): flat rows [A0 | A1 | B0 B0 | B1 B1] -> [A0 B0 B0 | A1 B1 B1].
    assert flat_to_grouped_order(2, (1, 2)) == (0, 2, 3, 1, 4, 5)


def test_gdn_grouping_follows_qwen3_next_layout():
    config = HybridLinearConfig(layer_types=["gated_deltanet"], gdn_num_key_heads=2, gdn_num_value_heads=4,
                                gdn_key_head_dim=3, gdn_value_head_dim=2)
    hk, hv, dk, dv, r = 2, 4, 3, 2, 2
    # Label every flat row with (section, head, index in head).
    flat = [("q", h, i) for h in range(hk) for i in range(dk)] + [("k", h, i) for h in range(hk) for i in range(dk)]
    flat += [("v", h, i) for h in range(hv) for i in range(dv)] + [("z", h, i) for h in range(hv) for i in range(dv)]
    order = GdnKeyHeadGrouping("qkvz").bind(config).order
    grouped = [flat[i] for i in order]
    expected = []
    for h in range(hk):  # key head h: [q_h | k_h | v of value heads h*r..h*r+r-1 | z of the same]
        expected += [("q", h, i) for i in range(dk)] + [("k", h, i) for i in range(dk)]
        expected += [("v", j, i) for j in range(h * r, (h + 1) * r) for i in range(dv)]
        expected += [("z", j, i) for j in range(h * r, (h + 1) * r) for i in range(dv)]
    assert grouped == expected
    ba = [("b", j) for j in range(hv)] + [("a", j) for j in range(hv)]
    grouped_ba = [ba[i] for i in GdnKeyHeadGrouping("ba").bind(config).order]
    assert grouped_ba == [("b", 0), ("b", 1), ("a", 0), ("a", 1), ("b", 2), ("b", 3), ("a", 2), ("a", 3)]


# --------------------------------------------------------------------------------------------- safetensors I/O


def test_reader_matches_the_safetensors_library(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(10, dtype=torch.int64),
               "c": torch.randn(2, 2).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    file = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(file.keys()) == sorted(tensors) and file.metadata == {"k": "v"}
    for name, tensor in tensors.items():
        assert file.info(name) == TensorInfo(tuple(tensor.shape), tensor.dtype)
        assert torch.equal(file.read(name), tensor)
    assert torch.equal(file.read("b", 3, (2, 2)), torch.arange(3, 7).reshape(2, 2))
    with pytest.raises(ConversionError, match="outside"):
        file.read("b", 8, (4,))


def test_writer_output_is_read_by_the_safetensors_library(tmp_path):
    tensors = [("x", torch.randn(5, 3)), ("y", torch.randn(7).to(torch.float16)), ("z", torch.randn(2, 2, 2))]
    infos = [(name, TensorInfo(tuple(t.shape), t.dtype)) for name, t in tensors]
    plans = plan_files(infos, 64, lambda index, count: f"part-{index}-of-{count}.safetensors")
    assert [[name for name, _ in plan.tensors] for plan in plans] == [["x"], ["y", "z"]]  # x alone exceeds 64 bytes
    write_files(tmp_path, plans, iter(tensors), {"format": "pt"})
    for plan in plans:
        with safe_open(tmp_path / plan.name, "pt") as file:
            assert file.metadata() == {"format": "pt"}
            for name, _ in plan.tensors:
                assert torch.equal(file.get_tensor(name), dict(tensors)[name])
        header_length = struct.unpack("<Q", (tmp_path / plan.name).read_bytes()[:8])[0]
        assert header_length % 8 == 0


def test_writer_refuses_a_stream_out_of_plan(tmp_path):
    plans = plan_files([("x", TensorInfo((2,), torch.float32))], 100, lambda i, n: "f.safetensors")
    with pytest.raises(RuntimeError, match="out of plan"):
        write_files(tmp_path, plans, iter([("y", torch.zeros(2))]))


def test_reader_rejects_overlapping_offsets(tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(ConversionError, match="gap or overlap"):
        SafetensorsFile(tmp_path / "bad.safetensors")


# --------------------------------------------------------------------------------------------- Fast-LLM layouts


def test_distributed_stage_layout_matches_the_fixture_tables():
    config = fast_llm_to_hybrid_config(fixture_base_model("kda_attn"))
    stages = stage_layout(config)
    assert [len(s) for s in stages] == [1, 19, 7, 2]
    assert stages[1][:7] == [f"decoder.0.{name}" for name in (
        "mixer.dt_bias", "mixer.A_log", "norm_1.weight", "norm_2.weight", "mixer.norm.weight", "mixer.f_a_proj.weight",
        "mixer.g_a_proj.weight")]
    # MQA: key_value is not tensor-parallel and sorts before query.
    assert stages[2][2:4] == ["decoder.1.mixer.key_value.weight", "decoder.1.mixer.query.weight"]
    hybrid = stage_layout(fast_llm_to_hybrid_config(fixture_base_model("hybrid_attn_gdn_kda")))
    assert hybrid[1][2:4] == ["decoder.0.mixer.query.weight", "decoder.0.mixer.key_value.weight"]  # GQA
    assert hybrid[2][:5] == ["decoder.1.mixer.dt_bias", "decoder.1.mixer.A_log", "decoder.1.norm_1.weight",
                             "decoder.1.norm_2.weight", "decoder.1.mixer.norm.weight"]


def test_fast_llm_rows_cover_every_fixture_tensor():
    for name in ("hybrid_attn_gdn_kda", "kda_attn"):
        config = fast_llm_to_hybrid_config(fixture_base_model(name))
        stored = set(yaml.safe_load((FIXTURES / name / "fast_llm" / "metadata.yaml").read_text())["metadata"][
            "state_index"])
        mapped = {f"{key}/weights" for row in build_fast_llm_rows(config) for key in row.format_keys}
        assert mapped == stored


# --------------------------------------------------------------------------------------------- config maps


def test_fixture_configs_map_to_hybrid_config():
    config = fast_llm_to_hybrid_config(fixture_base_model("hybrid_attn_gdn_kda"))
    assert config.mixer_types == ["full_attention", "gated_deltanet", "kimi_delta_attention", "gated_deltanet"]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.gdn_num_key_heads, config.gdn_num_value_heads, config.gdn_key_head_dim,
            config.gdn_value_head_dim, config.gdn_conv_kernel_size) == (2, 4, 16, 16, 4)
    assert (config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel_size) == (4, 16, 4)
    assert (config.gdn_gate_activation, config.kda_gate_activation) == ("silu", "silu")
    assert config.rms_norm_eps == config.gdn_norm_eps == config.kda_norm_eps == 1e-5
    assert not (config.zero_centered_norms or config.attention_output_gate or config.attention_qk_norm)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
    assert (config.intermediate_size, config.vocab_size, config.hidden_size) == (48, 384, 64)
    assert config.tie_word_embeddings is False
    mqa = fast_llm_to_hybrid_config(fixture_base_model("kda_attn"))
    assert mqa.mixer_types == ["kimi_delta_attention", "full_attention"] and mqa.num_key_value_heads == 1


def test_config_round_trip_and_windows():
    base = fixture_base_model("hybrid_attn_gdn_kda")
    base["decoder"]["blocks"]["attn"]["mixer"]["window_size"] = 128
    base["decoder"]["blocks"]["kda"]["mixer"]["normalization"]["activation"] = "sigmoid"
    config = fast_llm_to_hybrid_config(base)
    assert config.layer_types[0] == "sliding_attention" and config.sliding_window == 128
    assert config.kda_gate_activation == "sigmoid"
    again = fast_llm_to_hybrid_config(hybrid_config_to_fast_llm(config))
    assert again.to_dict() == config.to_dict()


# --------------------------------------------------------------------------------------------- small helpers


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                        ("1.5G", 15 * 10**8), ("100KB", 10**5), ("4096", 4096), (123, 123)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "five", "-1GB", "0", "3XB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConversionError):
        parse_size(text)


def test_relative_imports():
    source = "from .a import x\nfrom . import b, c\nimport d\nfrom e import f\ndef g():\n    from .h import i\n"
    assert relative_imports(source) == ["a", "b", "c", "h"]
    with pytest.raises(ConversionError, match="outside the package"):
        relative_imports("from ..up import x")


def test_remote_code_files_are_closed_under_relative_imports():
    files = remote_code_files()
    names = {path.stem for path in files}
    assert {"configuration_hybrid_linear", "modeling_hybrid_linear"} <= names
    for path in files:
        assert set(relative_imports(path.read_text())) <= names


def test_model_card_template_and_rendering():
    template = load_template()
    assert template.startswith("---\n") and "{{layer_rows}}" in template
    config = HybridLinearConfig(layer_types=["gated_deltanet", "full_attention"])
    card = render_model_card(config, name="demo", parameter_count=1_234_567, dtype="bfloat16",
                             source_format="fast_llm", source_format_description="Fast-LLM export",
                             source_path="/ckpt")
    assert "| 0 | Gated DeltaNet (`gated_deltanet`) |\n| 1 | full attention (`full_attention`) |" in card
    assert "1.23M (1,234,567)" in card and "`/ckpt`" in card and "{{" not in card
    with pytest.raises(ConversionError, match="unknown placeholders"):
        render_model_card(config, name="x", parameter_count=1, dtype="f", source_format="s",
                          source_format_description="d", source_path="p", template="{{nope}}")

"""Every Hugging Face style writer (a folder with config.json: hf, qwen3_next, kimi_linear, fla, apriel2) copies the
tokenizer the same way: the folder `--tokenizer` names, else the one found beside SRC; `AutoTokenizer` then loads the
output and encodes as the original does. Only Fast-LLM's own format, which keeps its tokenizer apart, refuses one."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_helpers import tiny_model, word_tokenizer
from transformers import AutoTokenizer

from hybrid_linear_cli.conversion_catalogue import FORMAT_CATALOGUE
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint

WORDS = ["the", "cat", "sat", "on", "mat"]
TEXT = "the cat sat on the mat"
FAST_LLM = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"
_FULL_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}

# a model of this family that each writer can hold (each peer format holds a subset of the family)
MODELS = {
    "hf": lambda: tiny_model(["gated_deltanet", "full_attention"]),
    "qwen3_next": lambda: tiny_model(["gated_deltanet", "full_attention"], rms_norm_eps=1e-5,
                                     rope_parameters={**_FULL_ROTARY, "partial_rotary_factor": 0.5}),
    "kimi_linear": lambda: tiny_model(["kimi_delta_attention"] * 2, hidden_size=32, kda_num_heads=2, kda_head_dim=8,
                                      rms_norm_eps=1e-5, zero_centered_norms=False),
    "fla": lambda: tiny_model(["gated_deltanet", "full_attention"], rms_norm_eps=1e-5, zero_centered_norms=False,
                              attention_output_gate=False, attention_qk_norm=False, attention_output_bias=False,
                              rope_parameters=_FULL_ROTARY),
    "apriel2": None,  # the Fast-LLM fixture, converted to hf first
}


def _hf_source(fmt: str, folder: Path) -> Path:
    if MODELS[fmt] is None:
        convert_checkpoint(FAST_LLM, folder, from_format="fast_llm", to_format="hf")
    else:
        MODELS[fmt]().save_pretrained(folder)
    return folder


def test_every_hf_style_writer_takes_a_tokenizer():
    hf_style = {entry.name for entry in FORMAT_CATALOGUE if entry.can_write and entry.output.marker == "config.json"}
    with_tokenizer = {entry.name for entry in FORMAT_CATALOGUE if entry.can_write and entry.output.tokenizer}
    assert hf_style == with_tokenizer == set(MODELS)


@pytest.mark.parametrize("fmt", list(MODELS))
@pytest.mark.parametrize("where", ["--tokenizer", "beside SRC"])
def test_the_writer_copies_the_tokenizer_and_auto_tokenizer_loads_it(tmp_path, fmt, where):
    tokenizer = word_tokenizer(WORDS)
    source = _hf_source(fmt, tmp_path / "src")
    if where == "--tokenizer":
        tokenizer.save_pretrained(tmp_path / "tokenizer")
        named = tmp_path / "tokenizer"
    else:
        tokenizer.save_pretrained(source)
        named = None
    result = convert_checkpoint(source, tmp_path / "out", from_format="hf", to_format=fmt, tokenizer=named)
    assert "tokenizer.json" in result.tokenizer_files
    for name in result.tokenizer_files:
        assert (tmp_path / "out" / name).read_bytes() == ((named or source) / name).read_bytes()
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded(TEXT).input_ids == tokenizer(TEXT).input_ids


def test_fast_llm_refuses_a_tokenizer_in_one_line(tmp_path):
    word_tokenizer(WORDS).save_pretrained(tmp_path / "tokenizer")
    source = _hf_source("apriel2", tmp_path / "src")  # a model Fast-LLM can hold
    with pytest.raises(ConversionError, match="--to fast_llm") as caught:
        convert_checkpoint(source, tmp_path / "out", from_format="hf", to_format="fast_llm",
                           tokenizer=tmp_path / "tokenizer")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()

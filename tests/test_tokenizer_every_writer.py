"""Every Hugging Face style writer (a folder with config.json: hf, qwen3_next, kimi_linear, fla, apriel2) copies the
tokenizer the same way: the folder `--tokenizer` names, else the one found beside SRC; `AutoTokenizer` then loads the
output and encodes as the original does, also where this package is not installed. Only Fast-LLM's own format, which
keeps its tokenizer apart, refuses one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_helpers import (
    WITHOUT_THE_PACKAGE_PRELUDE,
    run_without_the_package,
    tiny_model,
    word_tokenizer,
)
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


# One process loads every folder in turn, its output (stdout and stderr as one stream) cut at a line per folder.
AUTO_TOKENIZER_WITHOUT_THE_PACKAGE = WITHOUT_THE_PACKAGE_PRELUDE + """
import os
os.dup2(1, 2)  # transformers' warnings and questions in the one stream, in order
sys.stdout.reconfigure(line_buffering=True)
from transformers import AutoTokenizer

text, folders = sys.argv[1], sys.argv[2:]
ids = {}
for folder in folders:
    print(f"== {Path(folder).name}")
    ids[Path(folder).name] = AutoTokenizer.from_pretrained(folder)(text).input_ids
assert "hybrid_linear_models" not in sys.modules
print("== ids " + json.dumps(ids))
"""

# The formats whose model type transformers knows. transformers 5.24's AutoTokenizer reads config.json through
# AutoConfig before it reads tokenizer_config.json, whatever the latter names: a folder whose model type it does not
# know (fla's without fla installed) is read with its generic config after a warning, and one that carries remote code
# (hf's auto_map, for loading with trust_remote_code; apriel2's, Fast-LLM's) is asked transformers' remote-code
# question first (answered no when stdin is closed or after its 15 s timeout). Nothing in the folder's tokenizer files
# changes that order.
SILENT_WITHOUT_THE_PACKAGE = ("qwen3_next", "kimi_linear")


@pytest.mark.slow  # a subprocess that imports transformers' tokenizers
def test_auto_tokenizer_loads_every_writer_output_without_the_package(tmp_path):
    tokenizer = word_tokenizer(WORDS)
    for fmt in MODELS:
        source = _hf_source(fmt, tmp_path / "src" / fmt)
        tokenizer.save_pretrained(source)
        convert_checkpoint(source, tmp_path / fmt, from_format="hf", to_format=fmt)
    script = tmp_path / "auto_tokenizer.py"
    script.write_text(AUTO_TOKENIZER_WITHOUT_THE_PACKAGE)
    result = run_without_the_package(script, TEXT, *(tmp_path / fmt for fmt in MODELS), cwd=tmp_path)  # stdin closed
    output, _, ids = result.stdout.rpartition("== ids ")
    assert json.loads(ids) == {fmt: tokenizer(TEXT).input_ids for fmt in MODELS}
    sections = dict(section.partition("\n")[::2] for section in output.split("== ")[1:])  # {folder: its output}
    assert list(sections) == list(MODELS) and not result.stderr
    for fmt in SILENT_WITHOUT_THE_PACKAGE:
        assert sections[fmt] == "", (fmt, sections[fmt])  # no question, no warning


def test_fast_llm_refuses_a_tokenizer_in_one_line(tmp_path):
    word_tokenizer(WORDS).save_pretrained(tmp_path / "tokenizer")
    source = _hf_source("apriel2", tmp_path / "src")  # a model Fast-LLM can hold
    with pytest.raises(ConversionError, match="--to fast_llm") as caught:
        convert_checkpoint(source, tmp_path / "out", from_format="hf", to_format="fast_llm",
                           tokenizer=tmp_path / "tokenizer")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()

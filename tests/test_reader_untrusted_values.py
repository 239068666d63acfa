"""Values in untrusted files that Python's own parsers accept but no checkpoint holds: NaN, infinity and numbers
beyond a float's range in JSON (config.json, index files, safetensors metadata, tokenizer.json), token ids that are
not ids, nesting deep enough to exhaust the recursion limit. Each is refused with one ConversionError line naming the
file and where, before anything is written, so no writer ever carries such a value into an output."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_convert_qwen3_next import DENSE_CASES, add_mtp_tensors, save_qwen3_next

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.conversion import ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.extra_tensors import EXTRA_TENSORS_FILE
from hybrid_linear_models.conversion.qwen3_next.checkpoint import (
    check_config_reads_back,
    qwen3_next_config_text,
    read_qwen3_next,
)
from hybrid_linear_models.conversion.tokenizer_files import check_fits_vocabulary, largest_token_id
from hybrid_linear_models.conversion.untrusted import brief, parse_json


def one_line(caught: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(caught.value)
    assert message and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --------------------------------------------------------------------------------------------- JSON numbers


@pytest.mark.parametrize("text, fragment", [
    ("NaN", "config.json: the top level is nan"),
    ('{"rms_norm_eps": Infinity}', "config.json: rms_norm_eps is inf"),
    ('{"a": {"b": [1, -Infinity]}}', "config.json: a.b[1] is -inf"),
    ('{"router_aux_loss_coef": 1e999}', "config.json: router_aux_loss_coef is inf"),
    ("[0, -1.5e400]", "config.json: [1] is -inf"),
    ('{"mtp_loss": {"__float__": "NaN"}}', "mtp_loss is {'__float__': 'NaN'} (transformers' writing of NaN)"),
    ('[{"__float__": "-Infinity"}]', "[0] is {'__float__': '-Infinity'} (transformers' writing of -Infinity)"),
])
def test_json_without_finite_numbers_is_refused(text, fragment):
    with pytest.raises(ConversionError) as caught:
        parse_json(text, "config.json")
    one_line(caught, fragment, "JSON has no NaN or infinity")


def test_finite_json_numbers_read_as_python_does():
    assert parse_json('{"a": [1e308, -2.5e-320, 0.1, 3], "__float__": 1}', "f") == {
        "a": [1e308, -2.5e-320, 0.1, 3], "__float__": 1}


@pytest.fixture(scope="module")
def mtp_source(tmp_path_factory) -> Path:
    """A Qwen3-Next folder with mtp.* tensors carried beside the model (its config declares no MTP layers) and an
    mtp config field."""
    folder = tmp_path_factory.mktemp("mtp") / "source"
    save_qwen3_next(folder, **DENSE_CASES["mlp_only_layers"])
    add_mtp_tensors(folder, {"mtp_use_dedicated_embeddings": False})
    return folder


@pytest.mark.parametrize("value, fragment", [(math.nan, "config.json: mtp_num_hidden_layers is nan"),
                                             ({"__float__": "NaN"}, "transformers' writing of NaN")])
def test_a_nan_config_field_never_reaches_an_output(tmp_path, mtp_source, value, fragment):
    """A NaN among the carried mtp fields (which the reader carries unread): refused when read, so --to qwen3_next
    cannot write it on, and --to hf does not meet it either."""
    source = Path(shutil.copytree(mtp_source, tmp_path / "source"))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": value}))
    for to_format in ("qwen3_next", "hf"):
        with pytest.raises(ConversionError) as caught:
            convert_checkpoint(source, tmp_path / to_format, from_format="qwen3_next", to_format=to_format)
        one_line(caught, fragment)
        assert not (tmp_path / to_format).exists()


def test_a_nan_in_the_extra_tensors_metadata_is_refused(tmp_path, mtp_source):
    ours = convert_checkpoint(mtp_source, tmp_path / "hf", from_format="qwen3_next", to_format="hf").destination
    path = ours / EXTRA_TENSORS_FILE
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    save_file(load_file(path), path, metadata={**metadata, "carried_fields": '{"mtp_num_hidden_layers": NaN}'})
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(ours, tmp_path / "back", from_format="hf", to_format="qwen3_next")
    one_line(caught, EXTRA_TENSORS_FILE, "mtp_num_hidden_layers is nan")
    assert not (tmp_path / "back").exists()


def test_the_qwen3_next_writer_refuses_to_write_a_non_finite_field(mtp_source):
    """The writer's read-back parses what it is about to write as strictly as the reader: a non-finite value in it
    (whatever put it there) is refused before anything is written."""
    config = read_qwen3_next(mtp_source).config
    text = qwen3_next_config_text(config, torch.float32, {"mtp_num_hidden_layers": math.inf})
    assert '"__float__": "Infinity"' in text  # transformers' own serialisation writes it so
    with pytest.raises(ConversionError) as caught:
        check_config_reads_back(config, text)
    one_line(caught, "refusing to write config.json", "transformers' writing of Infinity")


# --------------------------------------------------------------------------------------------- tokenizer.json

VOCAB = {"<pad>": 0, "a": 1, "b": 2}


def tokenizer_json(folder: Path, document: object = None, text: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    path.write_text(text if text is not None else json.dumps(document))
    return path


def bpe(vocab: object = None, added: object = None) -> dict:
    return {"version": "1.0", "added_tokens": [] if added is None else added,
            "model": {"type": "BPE", "vocab": VOCAB if vocab is None else vocab, "merges": []}}


def test_a_sound_tokenizer_json_gives_its_largest_id(tmp_path):
    assert largest_token_id(tokenizer_json(tmp_path / "a", bpe(added=[{"id": 7, "content": "<x>"}]))) == 7
    assert largest_token_id(tokenizer_json(tmp_path / "b", {"model": {"type": "Unigram",
                                                                       "vocab": [["a", -1.0], ["b", -2.0]]}})) == 1


@pytest.mark.parametrize("document, text, fragments", [
    (None, '{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1e999}]}', ("added_tokens[0].id is inf",)),
    (None, "[" * 100_000 + "]" * 100_000, ("nests deeper than 64 levels",)),
    (None, '{"model": {"vocab": {"a": NaN}}}', ("model.vocab.a is nan",)),
    (bpe(vocab={"a": 0, "b": "5"}), None, ("model.vocab['b'] should be a token id (an integer >= 0)",
                                           "got a string '5'")),
    (bpe(vocab={"a": 0, "b": -1}), None, ("model.vocab['b'] should be a token id", "got an integer -1")),
    (bpe(vocab={"a": True}), None, ("model.vocab['a'] should be a token id", "got a boolean True")),
    (bpe(vocab={"a": 2.0}), None, ("model.vocab['a'] should be a token id", "got a number 2.0")),
    (bpe(vocab=5), None, ("model.vocab should be a mapping of tokens to ids or a list", "got an integer 5")),
    (bpe(added=[{"content": "<x>"}]), None, ("does not give added_tokens[0].id",)),
    (bpe(added=["<x>"]), None, ("added_tokens[0] should be a mapping",)),
    (bpe(added={"id": 3}), None, ("added_tokens should be a list",)),
    ({"added_tokens": []}, None, ("does not give model",)),
    ([1, 2], None, ("its top level should be a mapping",)),
])
def test_malformed_tokenizer_json_is_one_line(tmp_path, document, text, fragments):
    path = tokenizer_json(tmp_path / "tok", document, text)
    with pytest.raises(ConversionError) as caught:
        check_fits_vocabulary([path], 96)
    one_line(caught, "tokenizer.json", *fragments)


def test_a_malformed_tokenizer_is_refused_before_any_output(tmp_path, mtp_source):
    tokenizer = tmp_path / "tokenizer"
    tokenizer_json(tokenizer, text='{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1e999}]}')
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(mtp_source, tmp_path / "out", from_format="qwen3_next", to_format="hf",
                           tokenizer=tokenizer)
    one_line(caught, "tokenizer.json: added_tokens[0].id is inf")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- config.json dtype

SAVED = Path(__file__).parent / "fixtures" / "saved_models" / "tiny_hybrid_v0_1"


@pytest.mark.parametrize("dtype", ["float99", "auto", 5])
def test_a_dtype_that_names_no_torch_dtype_is_one_line(tmp_path, dtype):
    """transformers' base config looks a dtype name up in torch (an AttributeError otherwise): the converter's
    reader and from_pretrained both name the field instead."""
    folder = Path(shutil.copytree(SAVED, tmp_path / "saved"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
    with pytest.raises(ConversionError) as caught:
        convert_checkpoint(folder, tmp_path / "out", from_format="hf", to_format="hf")
    one_line(caught, "config.json: dtype should be")
    for load in (HybridLinearConfig.from_pretrained, HybridLinearForCausalLM.from_pretrained):
        with pytest.raises(ValueError) as caught:
            load(folder)
        one_line(caught, "dtype must be the name of a torch dtype", brief(dtype))

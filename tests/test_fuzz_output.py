"""Property-based fuzzing of the converter's output side: existing output folders holding foreign entries (files of
any name, folders, symbolic links, FIFOs) under --force, and processes killed at any step of a commit and of the
recovery after it. Properties: --force replaces DST exactly when it holds only regular files of names the writer
writes, and otherwise refuses in one line naming a foreign entry, with DST untouched; after any kills, DST holds an
output that some run completed (the old or a new one), byte for byte, and nothing is left beside it.

Each example writes small outputs through `atomic_output_dir` (what a conversion's writer does inside it); the
layout's names come from a real hf conversion with every tokenizer file, made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fuzz_strategies import FUZZ_SETTINGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_output_commit import KillPoints, Killed, leftovers, listing, run, write_output

from hybrid_linear_cli.conversion_catalogue import TOKENIZER_FILES
from hybrid_linear_models.conversion import FORMATS, ConversionError, convert_checkpoint
from hybrid_linear_models.shown_values import clip

FIXTURE = Path(__file__).parent / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"
HF = FORMATS["hf"]
# monkeypatch: each example patches within its own `monkeypatch.context()`
_FEWER = settings(FUZZ_SETTINGS, max_examples=60,
                  suppress_health_check=[*FUZZ_SETTINGS.suppress_health_check, HealthCheck.function_scoped_fixture])

_CONVERTER_NAMES = st.sampled_from(sorted({*HF.output.files, *TOKENIZER_FILES, "model-00001-of-00003.safetensors"}))
_LOOKALIKES = st.one_of(
    st.from_regex(r"[a-z_][a-z0-9_]{0,12}\.py", fullmatch=True),  # a user's module beside the shipped ones
    st.sampled_from(["model.safetensors.bak", "Config.json", "model-1-of-3.safetensors", "model_0.safetensors",
                     "metadata.yaml", ".hidden", "notes.txt", "tokenizer.json~", "README.MD", "x" * 200]),
    st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=["Cs"]), min_size=1, max_size=30),
)
_KINDS = st.sampled_from(["file", "file", "folder", "symbolic link", "special file"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A real hf conversion holding every tokenizer file."""
    root = tmp_path_factory.mktemp("fuzz_output")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        (tokenizer / name).write_text("{}")
    (tokenizer / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": []}))
    return convert_checkpoint(FIXTURE, root / "hf", from_format="fast_llm", to_format="hf",
                              tokenizer=tokenizer).destination


def snapshot(folder: Path) -> dict[str, object]:
    """Every entry of `folder` (one level): file bytes, link targets, or the kind."""
    entries = {}
    for entry in os.scandir(folder):
        if entry.is_symlink():
            entries[entry.name] = ("link", os.readlink(entry.path))
        elif entry.is_file(follow_symlinks=False):
            entries[entry.name] = Path(entry.path).read_bytes()
        else:
            entries[entry.name] = "folder" if entry.is_dir(follow_symlinks=False) else "special"
    return entries


def add_entry(folder: Path, name: str, kind: str, outside: Path) -> None:
    path = folder / name
    if kind == "file":
        path.write_bytes(b"a user's " + name.encode("utf-8", "surrogateescape"))
    elif kind == "folder":
        path.mkdir()
        (path / "inside.txt").write_text("keep")
    elif kind == "symbolic link":
        path.symlink_to(outside)
    else:
        os.mkfifo(path)


@_FEWER
@given(entries=st.lists(st.tuples(st.one_of(_CONVERTER_NAMES, _LOOKALIKES), _KINDS), min_size=1, max_size=4,
                        unique_by=lambda entry: entry[0]))
def test_fuzz_force_over_foreign_entries(converted, tmp_path_factory, entries):
    root = tmp_path_factory.mktemp("dst")
    dst = Path(shutil.copytree(converted, root / "dst"))
    (root / "elsewhere").mkdir()
    outside = root / "elsewhere" / "outside.txt"
    outside.write_text("keep")
    added = []
    for name, kind in entries:
        if name in (".", "..") or len(name.encode("utf-8", "surrogateescape")) > 200 or (dst / name).exists():
            continue
        add_entry(dst, name, kind, outside)
        added.append((name, kind))
    before = snapshot(dst)
    foreign = [name for name, kind in added if kind != "file" or not HF.output.writes(name)]
    try:
        run(dst, "new")
    except ConversionError as error:
        message = str(error)
        assert foreign and "\n" not in message and any(repr(clip(name)) in message for name in foreign), (
            message, foreign)
        assert snapshot(dst) == before and outside.read_text() == "keep"
    else:
        assert not foreign, foreign
        assert set(snapshot(dst)) == {"config.json", "model.safetensors", "README.md"}
        assert leftovers(dst) == ["elsewhere"] and outside.read_text() == "keep"
    shutil.rmtree(root)


@_FEWER
@given(old=st.booleans(), first=st.integers(0, 5), second=st.one_of(st.none(), st.integers(0, 5)),
       last_fails=st.booleans(), name=st.sampled_from(["dst", "d" * 237, "d" * 250, "é" * 127]))
def test_fuzz_kills_inside_the_commit(tmp_path_factory, monkeypatch, old, first, second, last_fails, name):
    """A commit killed at step `first`, the next run killed at step `second` of its recovery or commit (None: not
    killed), then a last run that fails or writes a third output; DST's name short or long enough that the names
    beside it are shortened."""
    root = tmp_path_factory.mktemp("kills")
    expected = {}
    for label in ("old", "new", "third"):
        (root / label).mkdir()
        write_output(root / label, label)
        expected[label] = listing(root / label)
    dst = root / "out" / name
    if old:
        run(dst, "old")
    for point in (first, second):
        with monkeypatch.context() as patch:
            KillPoints(patch, point)
            try:
                run(dst, "new")
            except Killed:
                pass
    completed = ["old", "new"] if old else ["new"]
    try:
        run(dst, "third", fails=last_fails)
    except ConversionError as error:
        assert last_fails and "bad source" in str(error)
        got = listing(dst) if dst.exists() else None
        assert got in [expected[label] for label in completed] or (got is None and not old), got
    else:
        assert not last_fails and listing(dst) == expected["third"]
    assert leftovers(dst) == []
    shutil.rmtree(root)

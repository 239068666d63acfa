"""Source folders holding something other than a regular file under a name a reader opens: a FIFO (whose open()
would block until another process writes to it), a folder, a device, a symbolic link to nothing or in a loop. Each is
refused with one ConversionError line naming the file and what it is, never waited on; a symbolic link to a regular
file is followed (the Hugging Face cache links a snapshot's files into its blob store) and reads as the file itself.

A SIGALRM bounds every read: a reader that opened a FIFO would otherwise hang the test run instead of failing it.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conversion_helpers import FAST_LLM_FIXTURES, Reading
from fuzz_strategies import FUZZ_SETTINGS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conversion_mixed_dtypes import build_sources

from hybrid_linear_models.conversion import convert_checkpoint

SECONDS = 20  # a read of these tiny folders takes well under a second, even on a loaded machine
FIXTURE = FAST_LLM_FIXTURES / "hybrid_attn_gdn_kda"
READ_AS = {"fast_llm": "fast_llm", "distributed": "fast_llm_distributed", "hf": "hf", "hf_sharded": "hf",
           "apriel2": "apriel2", "fla": "fla", "qwen3_next": "qwen3_next", "kimi_linear": "kimi_linear"}
# names a reader may look for that a folder does not hold: the hf reader's extra tensors, one shard more
ABSENT_NAMES = {"hf": ("extra_tensors.safetensors",), "fast_llm": ("model_7.safetensors",),
                "distributed": ("rank_1.safetensors",), "hf_sharded": ("extra_tensors.safetensors",)}
KINDS = ("fifo", "folder", "device", "dangling link", "link loop", "link to a fifo", "link to the file")


@contextmanager
def time_limit(seconds: int = SECONDS) -> Iterator[None]:
    def expire(signum, frame):
        raise TimeoutError(f"the read blocked for {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def plant(path: Path, kind: str, scratch: Path) -> None:
    """Puts a `kind` of thing at `path` (whose regular file, if any, was moved to `scratch / path.name`)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "dangling link":
        path.symlink_to(scratch / "nothing here")
    elif kind == "link loop":
        path.symlink_to(path.name)
    elif kind == "link to a fifo":
        fifo = scratch / f"{path.name}.fifo"
        if not fifo.exists():
            os.mkfifo(fifo)
        path.symlink_to(fifo)
    else:  # "link to the file": the file itself, moved away
        path.symlink_to(scratch / path.name)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("special")
    found = build_sources(root / "sources")
    found["distributed"] = Path(shutil.copytree(FIXTURE / "distributed", root / "distributed"))
    found["hf_sharded"] = convert_checkpoint(FIXTURE / "fast_llm", root / "hf_sharded", from_format="fast_llm",
                                             to_format="hf", max_shard_size="100KB").destination
    return found


def outcome_with(folder: Path, fmt: str, name: str, kind: str, scratch: Path) -> str:
    """Reading `folder` as `fmt` with a `kind` planted under `name`: "read" or "refused" (one line naming `name`);
    the folder is put back as it was afterwards."""
    path, moved = folder / name, scratch / name
    had_file = path.is_file()
    if had_file:
        shutil.move(path, moved)
    try:
        plant(path, kind, scratch)
        messages: list[str] = []
        with time_limit():
            result = Reading(READ_AS[fmt]).outcome(folder, messages)
        if result == "refused":  # the folder reads unchanged, so the refusal is about what was planted
            assert name in messages[0], messages[0]
        return result
    finally:
        remove(path)
        if had_file:
            shutil.move(moved, path)


def test_a_fifo_named_extra_tensors_is_refused_not_waited_on(folders, tmp_path):
    """The hf reader looks for extra_tensors.safetensors beside the model's files: a FIFO of that name is named."""
    os.mkfifo(folders["hf"] / "extra_tensors.safetensors")
    try:
        with time_limit():
            message = Reading("hf").refused(folders["hf"], "extra_tensors.safetensors is a FIFO (named pipe), "
                                                           "not a regular file")
    finally:
        (folders["hf"] / "extra_tensors.safetensors").unlink()
    assert "replace it with the file it should be" in message


@pytest.mark.parametrize("kind, what", [
    ("fifo", "is a FIFO (named pipe)"), ("folder", "is a folder"), ("device", "is a character device"),
    ("dangling link", "is a symbolic link that leads to no file"), ("link loop", "leads to no file"),
    ("link to a fifo", "is a FIFO (named pipe)"),
])
def test_special_files_in_place_of_the_weights_are_named(folders, tmp_path, kind, what):
    for fmt, name in (("hf", "model.safetensors"), ("distributed", "rank_0.safetensors"),
                      ("fast_llm", "metadata.yaml"), ("qwen3_next", "config.json")):
        scratch = tmp_path / fmt
        scratch.mkdir()
        path = folders[fmt] / name
        shutil.move(path, scratch / name)
        try:
            plant(path, kind, scratch)
            with time_limit():
                Reading(READ_AS[fmt]).refused(folders[fmt], name, what, "not a regular file")
        finally:
            remove(path)
            shutil.move(scratch / name, path)


def test_a_link_to_each_file_reads_as_the_file(folders, tmp_path):
    for fmt, folder in folders.items():
        for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.endswith(".py")):
            scratch = tmp_path / f"{fmt}_{path.name}"
            scratch.mkdir()
            assert outcome_with(folder, fmt, path.name, "link to the file", scratch) == "read", (fmt, path.name)


@settings(FUZZ_SETTINGS, max_examples=40)
@given(data=st.data())
def test_fuzz_special_files_in_every_format(folders, tmp_path_factory, data):
    """Any readable format, any of its files (or a name it looks for), any kind of special file: the correct result
    or one line naming the file; never a hang, never another exception."""
    fmt = data.draw(st.sampled_from(sorted(folders)))
    folder = folders[fmt]
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.endswith(".py"))
    name = data.draw(st.sampled_from(names + list(ABSENT_NAMES.get(fmt, ()))))
    kind = data.draw(st.sampled_from(KINDS))
    result = outcome_with(folder, fmt, name, kind, tmp_path_factory.mktemp("scratch"))
    if kind == "link to the file" and name in names:
        assert result == "read", (fmt, name)

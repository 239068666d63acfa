"""Opening the files of a source checkpoint: regular files only.

A folder being converted may hold, under a name a reader expects (config.json, a shard, extra_tensors.safetensors),
something that is not a file: a FIFO, whose open() blocks until another process writes to it (the conversion would
hang forever); a device, which reads endless data or acts when opened; a folder; a symbolic link to nothing or in a
loop. So a source file is looked up (`is_source_file`) and opened (`open_source_file`) only as a regular file: a
symbolic link to one is followed (the Hugging Face cache stores a snapshot's files as links into its blob store),
anything else is refused with one line naming the file and what it is. The open itself never blocks (O_NONBLOCK) and
checks the opened file again (fstat), so a file swapped for a FIFO between the look-up and the open is refused too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..shown_values import clip
from .errors import ConversionError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_a_file(path: Path, what: str) -> ConversionError:
    return ConversionError(f"{clip(str(path))} is {what}, not a regular file; a checkpoint's files are regular files "
                           "(or links to them): replace it with the file it should be.")


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise _not_a_file(path, _kind(mode))


def is_source_file(path: Path) -> bool:
    """True when `path` is a regular file (or a link to one), False when nothing has that name; anything else of
    that name is refused (`ConversionError`), never skipped: a reader would otherwise drop or misname it."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as error:  # a parent that is not a folder, no permission
        raise ConversionError(f"cannot look at {clip(str(path))}: {error.strerror}.") from None
    try:
        mode = os.stat(path).st_mode
    except OSError as error:  # a link to nothing, a loop of links
        raise _not_a_file(path, f"a symbolic link that leads to no file ({error.strerror})") from None
    _check_regular(path, mode)
    return True


def open_source_file(path: Path, buffering: int = -1) -> BinaryIO:
    """`path` opened for reading in binary mode, if it is a regular file (or a link to one); refused otherwise,
    before and after opening, without ever blocking."""
    if not is_source_file(path):
        raise ConversionError(f"{clip(str(path))} is missing; the checkpoint is incomplete.")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        raise ConversionError(f"cannot read {clip(str(path))}: {error.strerror}.") from None
    try:
        _check_regular(path, os.fstat(descriptor).st_mode)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb", buffering=buffering)
    except BaseException:
        os.close(descriptor)
        raise


__all__ = ["is_source_file", "open_source_file"]

"""The output folder under hostile input: DST is replaced as a whole, so what it may be is checked first.

- DST is never a place the user keeps other things in: the working directory or one of its ancestors, the home
  folder, the filesystem root, SRC or anything overlapping it, an existing file or symlink; an empty DST string (an
  unset shell variable) is refused with its own message. No flag overrides this.
- An existing DST is replaced only with --force, and only when it looks like a checkpoint the converter wrote: it has
  the target format's marker and holds nothing but file names that format writes (declared with the format, in
  `hybrid_linear_cli.conversion_catalogue`). An empty folder is replaced too: it holds nothing to lose.
- Everything is written into `.DST.partial-*` beside DST and renamed to DST only once complete; a failure, Ctrl-C,
  SIGTERM or SIGHUP removes it and leaves DST as it was (absent, or the old output).
- A lock file `.DST.lock` beside DST, held with flock from before the source is read until the rename is done, keeps
  two conversions from writing one DST. While holding it a run removes the `.DST.partial-*` and `.DST.old-*` folders
  that a killed run (kill -9 cannot be caught) left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..shown_values import clip
from .errors import ConversionError
from .interrupts import signals_deferred

if TYPE_CHECKING:
    from hybrid_linear_cli.conversion_catalogue import OutputLayout

    from .formats import CheckpointFormat

_MARKER_READ_LIMIT = 10**7  # bytes of a marker file read to check its fields (a config.json is a few kB)
_TOKEN_CHARS = 8  # random characters in a staging or retired folder's name


# --------------------------------------------------------------------------------------------- where DST may be


def _protected_places() -> dict[Path, str]:
    """Folders DST must never be, each with the words that name it."""
    cwd = Path.cwd().resolve()
    places = dict.fromkeys(cwd.parents, "an ancestor of the working directory")
    homes = [os.environ.get("HOME")]
    with contextlib.suppress(RuntimeError, KeyError):  # no home directory to be found
        homes.append(str(Path.home()))
    places.update((Path(home).resolve(), "your home folder") for home in homes if home)
    places[cwd] = "the working directory"
    places[Path(cwd.anchor)] = "the filesystem root"
    return places


def check_destination(dst: str | Path) -> Path:
    """DST as an absolute path, after refusing what it must never be (whatever the flags)."""
    if not str(dst).strip():
        raise ConversionError("DST is an empty string (an unset shell variable?); give the path of a new folder for "
                              "the output.")
    path = Path(os.path.abspath(dst))  # absolute, ".." folded, symlinks kept (DST itself must not be one)
    if path.is_symlink():
        raise ConversionError(f"DST {clip(path)} is a symbolic link; give the path of a new folder for the output.")
    if path.exists() and not path.is_dir():
        raise ConversionError(f"DST {clip(path)} exists and is not a folder; give the path of a new folder for the "
                              "output.")
    resolved = path.resolve()
    what = _protected_places().get(resolved)
    if what is not None:
        raise ConversionError(f"DST {clip(dst)} is {what} ({clip(resolved)}), which the output would replace as a "
                              "whole; give the path of a new folder, e.g. my-model-hf.")
    return path


def check_paths(src: str | Path, dst: str | Path) -> Path:
    """`check_destination`, plus SRC must exist and not overlap DST. Returns DST as an absolute path."""
    path = check_destination(dst)
    src_resolved, dst_resolved = Path(src).resolve(), path.resolve()
    if not src_resolved.exists():
        raise ConversionError(f"SRC {clip(src_resolved)} does not exist; give the path of the checkpoint folder to "
                              "convert.")
    if dst_resolved == src_resolved or src_resolved in dst_resolved.parents or dst_resolved in src_resolved.parents:
        raise ConversionError(f"DST {clip(dst_resolved)} overlaps SRC {clip(src_resolved)}; choose an output folder "
                              "outside the checkpoint.")
    return path


# --------------------------------------------------------------------------------------------- what --force replaces


def _has_marker(folder: Path, layout: OutputLayout) -> bool:
    marker = folder / layout.marker
    if not marker.is_file():
        return False
    if not layout.marker_fields:
        return True
    try:
        with marker.open("rb") as file:
            data = json.loads(file.read(_MARKER_READ_LIMIT))
    except (OSError, ValueError):  # unreadable, too long or not JSON: not a file this converter wrote
        return False
    return isinstance(data, dict) and all(data.get(key) == value for key, value in layout.marker_fields.items())


def _describe_marker(layout: OutputLayout) -> str:
    fields = ", ".join(f"{key} {value!r}" for key, value in layout.marker_fields.items())
    return layout.marker + (f" with {fields}" if fields else "")


def check_replaceable(dst: Path, fmt: CheckpointFormat) -> None:
    """Refuses to replace an existing DST unless it is empty or holds a checkpoint of `fmt` and nothing else."""
    layout = fmt.output
    entries = sorted(os.scandir(dst), key=lambda entry: entry.name)
    if not entries:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) or not layout.writes(entry.name):
            kind = "folder" if entry.is_dir(follow_symlinks=False) else "file"
            raise ConversionError(f"--force replaces only a folder the converter wrote, and DST {clip(dst)} holds "
                                  f"{clip(entry.name)!r}, a {kind} that a {fmt.name} checkpoint does not have; "
                                  "delete it yourself or choose another DST.")
    if not _has_marker(dst, layout):
        raise ConversionError(f"--force replaces only a folder the converter wrote, and DST {clip(dst)} is not a "
                              f"{fmt.name} checkpoint (no {_describe_marker(layout)}); delete its contents yourself "
                              "or choose another DST.")


def check_existing(dst: Path, replace: CheckpointFormat | None) -> None:
    """An existing DST is refused, unless `replace` (--force) is the format of a checkpoint that may be replaced."""
    if not (dst.exists() or dst.is_symlink()):
        return
    if replace is None:
        raise ConversionError(f"DST {clip(dst)} already exists; choose another path or pass --force to replace it.")
    check_destination(dst)  # it may have become a file or a link since it was first checked
    check_replaceable(dst, replace)


# --------------------------------------------------------------------------------------------- lock and stale folders


def _lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.lock"


def _acquire(lock_path: Path, dst: Path) -> int:
    """An open descriptor of `lock_path`, exclusively flocked. A run that finds DST locked fails at once instead of
    waiting: two runs on one DST are almost always a mistake (a job started twice), and a waiting run would only go
    on to replace the output the first one just reported (with --force) or fail because it now exists."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as error:
            raise ConversionError(f"cannot create the lock file {clip(lock_path)}: {error.strerror}; check that "
                                  "the folder of DST is writable.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConversionError(f"another conversion is writing DST {clip(dst)} (it holds {lock_path.name}); wait "
                                  "for it to finish or choose another DST.") from None
        # The previous holder unlinks the lock file before it lets go: if ours is no longer the file at that path,
        # another run can lock the new one, so start again with it.
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_ino, current.st_dev) == (held.st_ino, held.st_dev):
            return fd
        os.close(fd)


@contextlib.contextmanager
def _destination_lock(dst: Path) -> Iterator[None]:
    lock_path, fd = _lock_path(dst), None
    try:
        with signals_deferred():
            fd = _acquire(lock_path, dst)
        yield
    finally:
        if fd is not None:
            with signals_deferred():
                with contextlib.suppress(FileNotFoundError):
                    lock_path.unlink()  # before closing, so no one locks a file that is about to disappear
                os.close(fd)


def _leftover_pattern(dst: Path) -> re.Pattern:
    """Names of the staging and retired folders of this DST only (not of `DST.x`, whose are `.DST.x.partial-*`)."""
    return re.compile(rf"\.{re.escape(dst.name)}\.(partial|old)-[a-z0-9_]{{{_TOKEN_CHARS}}}")


def remove_leftovers(dst: Path) -> list[str]:
    """Removes the staging and retired folders a killed run left beside `dst` (call it holding the lock)."""
    pattern = _leftover_pattern(dst)
    removed = []
    for entry in os.scandir(dst.parent):
        if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


# --------------------------------------------------------------------------------------------- atomic output


def _new_folder_name(dst: Path, kind: str) -> Path:
    token = secrets.token_hex(_TOKEN_CHARS // 2)
    return dst.parent / f".{dst.name}.{kind}-{token}"


def _make_staging(dst: Path) -> Path:
    while True:
        staging = _new_folder_name(dst, "partial")
        try:
            staging.mkdir()  # the usual permissions (umask), as DST should have
            return staging
        except FileExistsError:
            continue


def _make_parents(folder: Path) -> list[Path]:
    """Creates `folder` and its missing parents; returns those it created, deepest first."""
    missing = [folder, *folder.parents]
    missing = missing[:next(i for i, path in enumerate(missing) if path.exists())]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _commit(staging: Path, dst: Path) -> None:
    """Puts `staging` in place as `dst`, retiring an old `dst` (the caller holds the lock)."""
    retired = None
    if dst.exists() or dst.is_symlink():
        retired = _new_folder_name(dst, "old")
        os.replace(dst, retired)
    try:
        os.replace(staging, dst)
    except BaseException:
        if retired is not None:
            os.replace(retired, dst)  # put the old output back
        raise
    if retired is not None:
        _remove(retired)


@contextlib.contextmanager
def atomic_output_dir(dst: str | Path, replace: CheckpointFormat | None = None) -> Iterator[Path]:
    """Yields an empty staging folder beside `dst`, holding the lock on `dst` throughout; on normal exit the folder
    becomes `dst`. An existing `dst` is refused unless `replace` (--force) is the format being written and `dst` holds
    one of its checkpoints and nothing else (see `check_replaceable`); it is replaced only once the new output is
    complete."""
    dst = check_destination(dst)
    try:
        with signals_deferred():
            created = _make_parents(dst.parent)
    except OSError as error:
        raise ConversionError(f"cannot create the folder of DST {clip(dst)}: {error.strerror}.") from None
    try:
        with _destination_lock(dst):
            check_existing(dst, replace)  # again: DST may have changed before the lock was ours
            remove_leftovers(dst)
            staging = None
            try:
                with signals_deferred():
                    staging = _make_staging(dst)
                yield staging
                with signals_deferred():
                    _commit(staging, dst)
            except BaseException:
                if staging is not None:
                    _remove(staging)
                raise
    except BaseException:
        for folder in created:  # folders made for DST, when DST did not come
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


__all__ = [
    "atomic_output_dir",
    "check_destination",
    "check_existing",
    "check_paths",
    "check_replaceable",
    "remove_leftovers",
]

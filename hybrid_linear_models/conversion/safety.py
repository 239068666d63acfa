"""The output folder under hostile input: DST is replaced as a whole, so what it may be is checked first.

- DST is never a place the user keeps other things in: the working directory or one of its ancestors, the home
  folder, the filesystem root, SRC or anything overlapping it, an existing file or symlink; an empty DST string (an
  unset shell variable) is refused with its own message, and so is a name longer than the filesystem allows. No
  flag overrides this.
- An existing DST is replaced only with --force, and only when it looks like a checkpoint the converter wrote: it has
  the target format's marker and holds nothing but the file names that format's writer writes (its `OutputLayout`,
  declared with the format in `hybrid_linear_cli.conversion_catalogue`: exact names, numbered weight shards, the
  tokenizer files it copies, the modeling sources it ships). Any other file is named in the refusal and left alone.
  An empty folder is replaced too: it holds nothing to lose.
- Everything is written into `.DST.partial-*` beside DST; a failure, Ctrl-C, SIGTERM or SIGHUP removes it and leaves
  DST as it was (absent, or the old output).
- The commit is a sequence of renames, each atomic: the complete staging folder becomes `.DST.ready-T` (the record
  that the new output is complete), DST becomes `.DST.old-T`, `.DST.ready-T` becomes DST, and the old output is
  deleted (renamed to a `partial` name first). A run killed at any point (kill -9 cannot be caught) leaves a state
  that the next run on DST, before anything else, finishes or undoes (`recover`): it deletes unfinished outputs,
  puts a complete new output in place when DST is absent (or deletes it when DST still holds the old one), puts an
  old output back when DST is absent, and says in one line which it did. No output is ever lost in between.
- A lock file `.DST.lock` beside DST, held with flock from before the recovery until the commit is done, keeps two
  conversions from writing one DST; it is never opened through a symbolic link.
- The names beside DST fit the filesystem's limit whatever DST's name: a long name is shortened with a hash
  (`_Beside`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..shown_values import clip
from .errors import ConversionError
from .interrupts import signals_deferred

if TYPE_CHECKING:
    from hybrid_linear_cli.conversion_catalogue import OutputLayout

    from .formats import CheckpointFormat

logger = logging.getLogger(__name__)

_MARKER_READ_LIMIT = 10**7  # bytes of a marker file read to check its fields (a config.json is a few kB)
_TOKEN_CHARS = 8  # random characters in the name of a folder beside DST
_KINDS = ("partial", "ready", "old")  # the folders beside DST (`_Beside`)
_LONGEST_KIND = max(_KINDS, key=len)
_DIGEST_CHARS = 16  # hex characters of a shortened name's hash
_DEFAULT_NAME_MAX = 255  # when the filesystem does not say


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
    check_name_length(path)
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


def check_source(src: str | Path) -> None:
    """SRC must exist (checked once DST's lock is held: a killed run's output is recovered even by a run that then
    fails here)."""
    if not (Path(src).exists() or Path(src).is_symlink()):
        raise ConversionError(f"SRC {clip(Path(src).resolve())} does not exist; give the path of the checkpoint "
                              "folder to convert.")


def check_paths(src: str | Path, dst: str | Path) -> Path:
    """`check_destination`, plus SRC must not overlap DST. Returns DST as an absolute path."""
    path = check_destination(dst)
    src_resolved, dst_resolved = Path(src).resolve(), path.resolve()
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


def _entry_kind(entry: os.DirEntry) -> str:
    """"file" for a regular file (all the converter writes), else what the entry is, in words."""
    if entry.is_symlink():
        return "symbolic link"
    if entry.is_dir(follow_symlinks=False):
        return "folder"
    return "file" if entry.is_file(follow_symlinks=False) else "special file"


def check_replaceable(dst: Path, fmt: CheckpointFormat) -> None:
    """Refuses to replace an existing DST unless it is empty or holds a checkpoint of `fmt` and nothing else: only
    regular files, each of a name the format's writer writes, and the format's marker."""
    layout = fmt.output
    entries = sorted(os.scandir(dst), key=lambda entry: entry.name)
    if not entries:
        return
    for entry in entries:
        kind = _entry_kind(entry)
        if kind != "file" or not layout.writes(entry.name):
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


# --------------------------------------------------------------------------------------------- names beside DST


def _name_max(folder: Path) -> int:
    """The longest file name (in bytes) the filesystem of `folder` (or of its nearest existing ancestor) allows."""
    existing = next((path for path in (folder, *folder.parents) if path.exists()), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _DEFAULT_NAME_MAX


def check_name_length(dst: Path) -> None:
    """DST's own name must fit the filesystem's limit; the names beside it are shortened to fit (`_Beside`)."""
    size, limit = len(os.fsencode(dst.name)), _name_max(dst.parent)
    if size > limit:
        raise ConversionError(f"DST's name is {size} bytes long, more than the {limit} its filesystem allows in a "
                              f"name ({clip(dst.name)}); choose a shorter name.")


class _Beside:
    """The names a conversion uses beside DST: `.B.lock`, and folders `.B.KIND-TOKEN` of three kinds:

    - `partial`: being written, or to be deleted (a folder is renamed to this kind before it is deleted, so that a
      folder half deleted by a killed run is never taken for an output);
    - `ready`: a complete new output, to become DST (renaming the staging folder to it is the commit's first step);
    - `old`: the output that DST held, moved aside until the new one is in place (same TOKEN as its `ready`).

    B is DST's name, or, when `.B.partial-TOKEN` would pass the filesystem's name limit, its first bytes and a hash of
    the whole name (distinct per DST, whatever its length)."""

    def __init__(self, dst: Path):
        self.dst = dst
        encoded = os.fsencode(dst.name)
        room = _name_max(dst.parent) - len(f"..{_LONGEST_KIND}-") - _TOKEN_CHARS
        if len(encoded) <= room:
            self.base = dst.name
        else:
            digest = hashlib.sha256(encoded).hexdigest()[:_DIGEST_CHARS]
            self.base = encoded[:room - _DIGEST_CHARS - 1].decode("utf-8", "ignore") + "-" + digest
        self.lock = dst.parent / f".{self.base}.lock"
        self._pattern = re.compile(rf"\.{re.escape(self.base)}\.({'|'.join(_KINDS)})-([a-z0-9_]{{{_TOKEN_CHARS}}})")

    def folder(self, kind: str, token: str) -> Path:
        return self.dst.parent / f".{self.base}.{kind}-{token}"

    def new_folder(self, kind: str) -> Path:
        return self.folder(kind, secrets.token_hex(_TOKEN_CHARS // 2))

    def found(self) -> dict[str, dict[str, Path]]:
        """The folders of each kind beside DST (symbolic links and files with such names are not ours: skipped)."""
        found: dict[str, dict[str, Path]] = {kind: {} for kind in _KINDS}
        for entry in os.scandir(self.dst.parent):
            match = self._pattern.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found[match.group(1)][match.group(2)] = Path(entry.path)
        return found

    def kind(self, folder: Path) -> str | None:
        """The kind of a folder beside DST (None for any other name)."""
        match = self._pattern.fullmatch(folder.name)
        return match.group(1) if match else None

    def describe(self, folder: Path) -> str:
        return clip(folder.name)


# --------------------------------------------------------------------------------------------- filesystem steps
# Every change a commit or a recovery makes goes through these three, so a test can stop the process at each.


def _rename(source: Path, target: Path) -> None:
    os.replace(source, target)  # rename(2): atomic; the callers check that `target` is absent


def _remove_tree(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _sync(path: Path) -> None:
    """Flushes a file or a folder's entries to the disk (a folder: the renames done in it), where the filesystem
    can."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem without fsync for this kind of file
            raise
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            _sync(Path(entry.path))
    _sync(folder)


def _discard(beside: _Beside, folder: Path) -> None:
    """Deletes `folder`, renamed to a `partial` name first: a half-deleted folder is never taken for an output."""
    doomed = folder if beside.kind(folder) == "partial" else beside.new_folder("partial")
    if doomed != folder:
        _rename(folder, doomed)
    _remove_tree(doomed)


# --------------------------------------------------------------------------------------------- lock


def _acquire(lock_path: Path, dst: Path) -> int:
    """An open descriptor of `lock_path`, exclusively flocked. A run that finds DST locked fails at once instead of
    waiting: two runs on one DST are almost always a mistake (a job started twice), and a waiting run would only go
    on to replace the output the first one just reported (with --force) or fail because it now exists. The lock file
    is never opened through a symbolic link (one planted there would make the run create or open a file elsewhere)."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise ConversionError(f"the lock file {clip(lock_path)} is a symbolic link, which a conversion "
                                      "never follows; remove it (or choose another DST).") from None
            raise ConversionError(f"cannot create the lock file {clip(lock_path)}: {error.strerror}; check that "
                                  "the folder of DST is writable.") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConversionError(f"the lock file {clip(lock_path)} is not a regular file; remove it (or choose "
                                  "another DST).")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConversionError(f"another conversion is writing DST {clip(dst)} (it holds {clip(lock_path.name)}); "
                                  "wait for it to finish or choose another DST.") from None
        # The previous holder unlinks the lock file before it lets go: if ours is no longer the file at that path,
        # another run can lock the new one, so start again with it.
        if _same_file(lock_path, fd):
            return fd
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (current.st_ino, current.st_dev) == (held.st_ino, held.st_dev)


@contextlib.contextmanager
def _destination_lock(beside: _Beside) -> Iterator[None]:
    fd = None
    try:
        with signals_deferred():
            fd = _acquire(beside.lock, beside.dst)
        yield
    finally:
        if fd is not None:
            with signals_deferred():
                if _same_file(beside.lock, fd):  # before closing, so no one locks a file about to disappear
                    with contextlib.suppress(FileNotFoundError):
                        beside.lock.unlink()
                os.close(fd)


# --------------------------------------------------------------------------------------------- recovery


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def recover(dst: Path) -> str | None:
    """Puts DST in a finished state after a run killed at any point (call it holding the lock): a `partial` folder
    is deleted; a `ready` one becomes DST when DST is absent (the killed run had moved the old output aside: that
    one is then deleted), and is deleted when DST is still there (the old output stays); an `old` one is put back
    as DST when DST is absent, and deleted otherwise. Returns one line saying what was done, None if nothing."""
    beside = _Beside(dst)
    found = beside.found()
    done = []
    for folder in found["partial"].values():
        _remove_tree(folder)
    if found["partial"]:
        names = ", ".join(sorted(beside.describe(folder) for folder in found["partial"].values()))
        done.append(f"removed the unfinished output of a killed run ({names})")
    ready, old = found["ready"], found["old"]
    if len(ready) > 1:
        raise ConversionError(f"beside DST {clip(dst)} are {len(ready)} complete outputs of killed runs "
                              f"({', '.join(sorted(beside.describe(p) for p in ready.values()))}); move the one to "
                              "keep to DST and remove the others.")
    for token, folder in ready.items():
        if not _exists(dst):
            _rename(folder, dst)
            _sync(dst.parent)
            done.append("finished the replacement of DST that a killed run had begun: DST holds its new output")
        elif token not in old:
            _discard(beside, folder)
            done.append("kept DST's output: the new output of a killed run had not replaced it yet and was removed")
        else:
            raise ConversionError(f"DST {clip(dst)} exists beside a killed run's new output {beside.describe(folder)} "
                                  f"and the output it replaced {beside.describe(old[token])}; move what you want to "
                                  "keep, then remove the rest.")
    if old and not _exists(dst):
        token = max(old, key=lambda key: old[key].stat().st_mtime)
        _rename(old.pop(token), dst)
        _sync(dst.parent)
        done.append("restored DST's previous output, which a killed run had moved aside")
    for folder in old.values():
        _discard(beside, folder)
    if old:
        done.append("removed the output that a killed run had replaced")
    if not done:
        return None
    return f"DST {clip(dst)}: " + "; ".join(done) + "."


# --------------------------------------------------------------------------------------------- atomic output


def _make_staging(beside: _Beside) -> Path:
    while True:
        staging = beside.new_folder("partial")
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


def _commit(beside: _Beside, staging: Path) -> None:
    """Puts the complete `staging` in place as DST (the caller holds the lock). Each step is a rename, and after each
    one `recover` finishes the commit or undoes it: staging -> `ready` (from here the new output is kept), DST ->
    `old` (if there is one), `ready` -> DST, then the old output is deleted."""
    dst = beside.dst
    token = staging.name.rpartition("-")[2]
    ready = beside.folder("ready", token)
    _sync_tree(staging)  # the new output on the disk before it is marked complete
    _rename(staging, ready)
    _sync(dst.parent)
    try:
        retired = None
        if _exists(dst):
            retired = beside.folder("old", token)
            _rename(dst, retired)
        _rename(ready, dst)
        _sync(dst.parent)
    except OSError:
        with contextlib.suppress(OSError, ConversionError):
            recover(dst)  # undo (or finish) now rather than at the next run; the first error is the one reported
        raise
    if retired is not None:
        _discard(beside, retired)


@contextlib.contextmanager
def atomic_output_dir(dst: str | Path, replace: CheckpointFormat | None = None) -> Iterator[Path]:
    """Yields an empty staging folder beside `dst`, holding the lock on `dst` throughout; on normal exit the folder
    becomes `dst`. Before anything else, what a killed run left beside `dst` is finished or undone (`recover`, which
    logs one line saying which). An existing `dst` is refused unless `replace` (--force) is the format being written
    and `dst` holds one of its checkpoints and nothing else (see `check_replaceable`); it is replaced only once the
    new output is complete."""
    dst = check_destination(dst)
    try:
        with signals_deferred():
            created = _make_parents(dst.parent)
    except OSError as error:
        raise ConversionError(f"cannot create the folder of DST {clip(dst)}: {error.strerror}.") from None
    beside = _Beside(dst)
    try:
        with _destination_lock(beside):
            with signals_deferred():
                report = recover(dst)
            if report is not None:
                logger.warning(report)
            check_existing(dst, replace)  # after the recovery, which may have put an output back
            staging = None
            try:
                with signals_deferred():
                    staging = _make_staging(beside)
                yield staging
                with signals_deferred():
                    _commit(beside, staging)
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
    "check_name_length",
    "check_paths",
    "check_replaceable",
    "check_source",
    "recover",
]
